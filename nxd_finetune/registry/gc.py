"""``adapters gc``: remove what killed pushes of this registry left, and nothing else.

gc works only on a registry root, one that holds the marker every push writes
(:data:`~nxd_finetune.registry.layout.MARKER`); on any other root it deletes nothing and raises one
line. A root that holds published versions but no marker (a registry written before markers
existed) is marked with ``adopt=True`` (``adapters gc ROOT --adopt``) once its owner confirms it is
the registry root, not a folder above one.

What gc removes, each only where a push (or ``rm``) of this registry provably wrote it:

- a dead push's claim (``<name>/<v>/.claim-<gen>.json``; dead by the rules of
  :mod:`nxd_finetune.registry.claims`: on this machine, only once its process is gone) and, in an
  unpublished version directory, the files next to it that the claim lists (the names its push was
  uploading; a claim written before claims listed files vouches for every name a push uploads). gc first
  takes the claim itself, so no push starts writing there while it deletes;
- claims left in a published version (a push killed between the manifest and the cleanup);
- the files of a version whose number is retired (an ``rm`` killed after it removed the
  manifest) that the retired record lists (the manifest's files);
- temp files (local, ``.nxdtmp-<id>-<file>``) and incomplete multipart uploads (S3) of those
  files in a published version or one whose claim is dead; temp files of the registry's own small
  files (aliases, retired numbers, claims, the marker) older than :data:`MIN_AGE_S`;
- content locks of identical pushes (``<name>/pushing/<content>/.claim-<gen>.json``) whose
  holder is dead.

What gc never removes: a published version or any file it lists; a version a live push holds
(reported as busy); a damaged version (a manifest that does not parse: reported, ``adapters rm``
removes it by its number); and anything else under the root: files no push writes, files in a
version directory that no claim or retired number accounts for, deeper folders, other registries
below this one. Those in version-shaped directories (``<name>/<number>/<file>``) are reported as
left alone; the rest is not looked at.

``dry_run`` reports the same lists and changes nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from nxd_finetune.registry import manifest as mf
from nxd_finetune.registry.claims import CLAIM_RE
from nxd_finetune.registry.core import Registry
from nxd_finetune.registry.errors import RegistryError
from nxd_finetune.registry.layout import ALIASES, MARKER, PUSHING, RETIRED, is_marked, mark
from nxd_finetune.registry.ref import NAME_RE
from nxd_finetune.storage import Leftover, StorageNotFoundError
from nxd_finetune.storage.base import TMP_PREFIX
from nxd_finetune.storage.local import LocalStorage

MIN_AGE_S = 3600.0
"""Temp files outside version directories are removed only when older than this."""

_NAME = r"(?![^/]*\.\.)" + NAME_RE.pattern
_VERSION_KEY = re.compile(rf"({_NAME})/([1-9][0-9]{{0,17}})/([^/]+)")
_LOCK_KEY = re.compile(rf"({_NAME})/{PUSHING}/([0-9a-f]{{32}})/(\.claim-[1-9][0-9]*\.json)")
_SMALL_KEY = re.compile(rf"{re.escape(MARKER)}|{_NAME}/({ALIASES}/{_NAME}\.json|{RETIRED}/[1-9][0-9]*\.json"
                        rf"|{PUSHING}/[0-9a-f]{{32}}/\.claim-[1-9][0-9]*\.json)")
_TEMP_NAME = re.compile(rf"{re.escape(TMP_PREFIX)}[0-9a-f]{{32}}-[^/]+")


@dataclass(frozen=True)
class Garbage:
    """One thing ``gc`` removes (or would): ``what`` in words, the ``key`` under the registry root."""

    what: str
    key: str
    size: int | None = None


@dataclass
class GcReport:
    """What ``gc`` found: ``removed`` (or, with ``dry_run``, what it would remove), ``damaged``
    versions as ``name:version`` with the reason, ``busy``: version dirs a live push holds,
    ``left``: keys in version directories that no push of this registry wrote (never touched),
    ``kept``: version directories without a manifest (``name/v``) that stay because they hold such
    files (gc removes a directory only when nothing else is in it), ``adopted``: the root was marked as a
    registry by this call."""

    registry: str
    dry_run: bool
    removed: list[Garbage] = field(default_factory=list)
    damaged: list[tuple[str, str]] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    adopted: bool = False

    @property
    def bytes(self) -> int:
        return sum(g.size or 0 for g in self.removed)


def check_registry_root(reg: Registry, *, adopt: bool = False, dry_run: bool = False) -> bool:
    """Refuse (one line) a root that is not a registry by its marker; with ``adopt``, mark a root
    that holds published versions (unless ``dry_run``). Return whether it was adopted."""
    if is_marked(reg.storage):
        return False
    names = reg.list_names()
    usable = [n for n in names if reg._usable(n)[0]]
    if not usable:
        raise RegistryError(f"{reg.uri} is not an adapter registry (no {MARKER}, no published versions); "
                            "gc runs on a registry root, the folder or s3:// prefix that pushes go to")
    if not adopt:
        shown = ", ".join(usable[:3]) + (", ..." if len(usable) > 3 else "")
        raise RegistryError(f"{reg.uri} holds adapters ({shown}) but no registry marker {MARKER} (registries "
                            "written by earlier releases have none; every push writes it); if this is the "
                            f"registry root, mark it with: nxd-finetune adapters gc {reg.uri} --adopt")
    if not dry_run:
        mark(reg.storage)
    return True


def collect(reg: Registry, *, dry_run: bool = False, min_age_s: float = MIN_AGE_S, adopt: bool = False) -> GcReport:
    """Find (and unless ``dry_run`` remove) what dead pushes left in ``reg``; see the module docstring.
    Raises :class:`RegistryError` for a root that is not a registry (:func:`check_registry_root`)."""
    report = GcReport(reg.uri, dry_run, adopted=check_registry_root(reg, adopt=adopt, dry_run=dry_run))
    keys = reg.storage.list("")
    leftovers = reg.storage.leftovers("")
    dirs: dict[tuple[str, int], list[str]] = defaultdict(list)
    locks: dict[tuple[str, str], list[str]] = defaultdict(list)
    for key in keys:
        if m := _VERSION_KEY.fullmatch(key):
            dirs[(m.group(1), int(m.group(2)))].append(m.group(3))
        elif m := _LOCK_KEY.fullmatch(key):
            locks[(m.group(1), m.group(2))].append(key)
    stray: dict[tuple[str, int], list[Leftover]] = defaultdict(list)
    for item in leftovers:
        if item.size is not None and not _TEMP_NAME.fullmatch(item.handle.rsplit("/", 1)[-1]):
            continue  # not one of our writers' temp files
        if (m := _VERSION_KEY.fullmatch(item.key)) and mf.FILE_RE.fullmatch(m.group(3)):
            stray[(m.group(1), int(m.group(2)))].append(item)
        elif item.size is not None and _SMALL_KEY.fullmatch(item.key) and item.age_s >= min_age_s:
            _drop(reg, report, Garbage("temp file", item.handle, item.size), item)

    for name, v in sorted(set(dirs) | set(stray)):
        _version_dir(reg, report, name, v, dirs.get((name, v), []), stray.get((name, v), []))
    for (name, content), lock_keys in sorted(locks.items()):
        gens = reg.claims.generations(f"{name}/{PUSHING}", content)
        if gens and not _dead(reg, f"{name}/{PUSHING}/{content}/.claim-{gens[-1]}.json"):
            continue
        for key in lock_keys:
            _delete(reg, report, Garbage("lock of a dead push", key))
    return report


def _version_dir(reg: Registry, report: GcReport, name: str, v: int, files: list[str], stray: list[Leftover]) -> None:
    claims = [f for f in files if CLAIM_RE.fullmatch(f)]
    ours = [f for f in files if mf.FILE_RE.fullmatch(f) and f not in claims and f != mf.MANIFEST]
    others = [f for f in files if f not in claims and f not in ours and f != mf.MANIFEST]
    if mf.MANIFEST in files:
        try:
            listed = set(reg._manifest(name, v)["files"])
        except RegistryError as e:
            report.damaged.append((f"{name}:{v}", str(e)))
            return
        for f in claims:
            _delete(reg, report, Garbage("claim of a finished push", f"{name}/{v}/{f}"))
        report.left += [f"{name}/{v}/{f}" for f in files if f not in listed and f != mf.MANIFEST and f not in claims]
        _drop_all(reg, report, stray)
        return
    if not claims:  # no push holds it: an rm killed midway (a retired number), else not ours
        if v in reg.retired(name):
            written = _listed(reg, [f"{name}/{RETIRED}/{v}.json"], ours)
            _delete_files(reg, report, "file of a removed version", name, v, written)
            _drop_all(reg, report, stray)
            _keep(report, name, v, others + [f for f in ours if f not in written])
        else:
            _keep(report, name, v, files)
        return
    # the names the dead pushes said they would write: only those are theirs to remove
    written = _listed(reg, [f"{name}/{v}/{f}" for f in claims], ours)
    others += [f for f in ours if f not in written]
    ours = written
    # unpublished: take the claim (as a push taking over would), so nobody writes here meanwhile
    gen = None if report.dry_run else reg.claims.take(name, v, f"gc-{uuid.uuid4().hex}")
    if report.dry_run:
        gens = reg.claims.generations(name, v)
        busy = bool(gens) and not _dead(reg, f"{name}/{v}/.claim-{gens[-1]}.json")
    else:
        busy = gen is None
    if busy or reg.storage.exists(f"{name}/{v}/{mf.MANIFEST}"):
        if gen is not None:
            reg.claims.drop(name, v, gen)
        if busy:
            report.busy.append(f"{name}:{v}")
        return
    for f in claims:
        _delete(reg, report, Garbage("claim of a dead push", f"{name}/{v}/{f}"))
    _delete_files(reg, report, "file of an unpublished version", name, v, ours)
    _drop_all(reg, report, stray)
    _keep(report, name, v, others)
    if gen is not None:
        reg.claims.drop(name, v, gen)


def _keep(report: GcReport, name: str, v: int, files: list[str]) -> None:
    """``files`` (in ``name/v``, a directory without a manifest) are no push's: left, and with them
    the directory."""
    report.left += [f"{name}/{v}/{f}" for f in files]
    if files:
        report.kept.append(f"{name}/{v}")


def _listed(reg: Registry, record_keys: list[str], candidates: list[str]) -> list[str]:
    """Those of ``candidates`` (file names a push may upload) that the claims or retired records at
    ``record_keys`` list (``files``: what their push wrote or their rm was removing). A record
    without that list (written by a release before it existed) vouches for every candidate, as gc
    did then; one that is gone or does not parse vouches for none."""
    names: set[str] = set()
    for key in record_keys:
        try:
            record = json.loads(reg.storage.get_bytes(key))
        except (StorageNotFoundError, ValueError):
            continue
        files = record.get("files") if isinstance(record, dict) else None
        if files is None and isinstance(record, dict):
            return candidates
        if isinstance(files, list):
            names.update(f for f in files if isinstance(f, str))
    return [f for f in candidates if f in names]


def _dead(reg: Registry, claim_key: str) -> bool:
    """Whether the claim at ``claim_key`` is gone, unreadable or held by a dead push."""
    try:
        return reg.claims.is_stale(json.loads(reg.storage.get_bytes(claim_key)))
    except (StorageNotFoundError, ValueError):
        return True


def _size(reg: Registry, key: str) -> int | None:
    """Bytes of ``key`` on a local registry (S3 listings here carry no sizes)."""
    if not isinstance(reg.storage, LocalStorage):
        return None
    try:
        return (reg.storage.root / key).stat().st_size
    except OSError:
        return None


def _delete(reg: Registry, report: GcReport, g: Garbage) -> None:
    if not report.dry_run:
        reg.storage.delete(g.key)
    report.removed.append(g)


def _delete_files(reg: Registry, report: GcReport, what: str, name: str, v: int, files: list[str]) -> None:
    for f in files:
        _delete(reg, report, Garbage(what, f"{name}/{v}/{f}", _size(reg, f"{name}/{v}/{f}")))


def _drop_all(reg: Registry, report: GcReport, items: list[Leftover]) -> None:
    for item in items:
        _drop(reg, report, Garbage("temp file" if item.size is not None else "incomplete upload", item.handle,
                                   item.size), item)


def _drop(reg: Registry, report: GcReport, g: Garbage, item: Leftover) -> None:
    if not report.dry_run:
        reg.storage.drop_leftover(item)
    report.removed.append(g)

"""``adapters gc``: remove what killed pushes left in a registry, never what a live push needs.

What a push leaves when it dies (SIGKILL, lost machine, network) and what ``gc`` does with it:

- an unpublished version directory (claims, uploaded files, no ``manifest.json``): removed whole
  once its claim is dead (by the rules of :mod:`nxd_finetune.registry.claims`); ``gc`` first takes
  the claim itself, so no push can start writing there while it deletes;
- claims left in a published version (a push killed between the manifest and the cleanup): removed;
- temp files (local) and incomplete multipart uploads (S3) inside a version directory: removed when
  the version is published or its claim is dead; elsewhere (tags, retired numbers) when older than
  :data:`MIN_AGE_S`;
- files in a published version that its manifest does not list: removed;
- content locks of identical pushes (``<name>/pushing/``) whose holder is dead: removed;
- damaged versions (a manifest that does not parse) are reported, not removed: ``adapters rm``
  removes one by its number.

``dry_run`` reports the same list and changes nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import defaultdict
from dataclasses import dataclass, field

from nxd_finetune.registry import manifest as mf
from nxd_finetune.registry.claims import CLAIM_RE
from nxd_finetune.registry.core import _PUSHING, Registry
from nxd_finetune.registry.errors import RegistryError
from nxd_finetune.storage import Leftover, StorageNotFoundError
from nxd_finetune.storage.local import LocalStorage

MIN_AGE_S = 3600.0
"""Temp files and uploads outside version directories are removed only when older than this."""

_VERSION_KEY = re.compile(r"([^/]+)/([1-9][0-9]*)/(.+)")
_LOCK_KEY = re.compile(rf"([^/]+)/{_PUSHING}/([^/]+)/(\.claim-[1-9][0-9]*\.json)")


@dataclass(frozen=True)
class Garbage:
    """One thing ``gc`` removes (or would): ``what`` in words, the ``key`` under the registry root."""

    what: str
    key: str
    size: int | None = None


@dataclass
class GcReport:
    """What ``gc`` found: ``removed`` (or, with ``dry_run``, what it would remove), ``damaged``
    versions as ``name:version`` with the reason, and ``busy``: version dirs a live push holds."""

    registry: str
    dry_run: bool
    removed: list[Garbage] = field(default_factory=list)
    damaged: list[tuple[str, str]] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(g.size or 0 for g in self.removed)


def collect(reg: Registry, *, dry_run: bool = False, min_age_s: float = MIN_AGE_S) -> GcReport:
    """Find (and unless ``dry_run`` remove) what dead pushes left in ``reg``; see the module docstring."""
    report = GcReport(reg.uri, dry_run)
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
        if m := _VERSION_KEY.fullmatch(item.key):
            stray[(m.group(1), int(m.group(2)))].append(item)
        elif item.age_s >= min_age_s:
            _drop(reg, report, Garbage(_leftover_word(item), item.handle, item.size), item)

    for name, v in sorted(set(dirs) | set(stray)):
        _version_dir(reg, report, name, v, dirs.get((name, v), []), stray.get((name, v), []))
    for (name, content), lock_keys in sorted(locks.items()):
        gens = reg.claims.generations(f"{name}/{_PUSHING}", content)
        if gens and not _dead(reg, f"{name}/{_PUSHING}/{content}/.claim-{gens[-1]}.json"):
            continue
        for key in lock_keys:
            _delete(reg, report, Garbage("lock of a dead push", key))
    return report


def _version_dir(reg: Registry, report: GcReport, name: str, v: int, files: list[str], stray: list[Leftover]) -> None:
    claims = [f for f in files if CLAIM_RE.fullmatch(f)]
    if mf.MANIFEST in files:
        try:
            listed = set(reg._manifest(name, v)["files"])
        except RegistryError as e:
            report.damaged.append((f"{name}:{v}", str(e)))
            return
        for f in claims:
            _delete(reg, report, Garbage("claim of a finished push", f"{name}/{v}/{f}"))
        for f in files:
            if f not in listed and f != mf.MANIFEST and not CLAIM_RE.fullmatch(f):
                _delete(reg, report, Garbage("file its manifest does not list", f"{name}/{v}/{f}"))
        for item in stray:
            _drop(reg, report, Garbage(_leftover_word(item), item.handle, item.size), item)
        return
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
    for f in files:
        what = "claim of a dead push" if CLAIM_RE.fullmatch(f) else "file of an unpublished version"
        _delete(reg, report, Garbage(what, f"{name}/{v}/{f}", _size(reg, f"{name}/{v}/{f}")))
    for item in stray:
        _drop(reg, report, Garbage(_leftover_word(item), item.handle, item.size), item)
    if gen is not None:
        reg.claims.drop(name, v, gen)


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


def _leftover_word(item: Leftover) -> str:
    return "temp file" if item.size is not None else "incomplete upload"


def _delete(reg: Registry, report: GcReport, g: Garbage) -> None:
    if not report.dry_run:
        reg.storage.delete(g.key)
    report.removed.append(g)


def _drop(reg: Registry, report: GcReport, g: Garbage, item: Leftover) -> None:
    if not report.dry_run:
        reg.storage.drop_leftover(item)
    report.removed.append(g)

"""The adapter registry: versioned PEFT adapters under one storage root (local directory or S3 prefix).

Layout under the root::

    <name>/<version>/adapter_config.json, adapter_model.safetensors, [other allowed files], manifest.json
    <name>/<version>/.claim-<gen>.json      only while a push is in flight
    <name>/aliases/<tag>.json               {"version": N, "manifest_sha256": ...}; "latest" is
                                            rewritten after every push/rm
    <name>/retired/<N>.json                 a removed version's number: never given out again
    <name>/pushing/<content>/.claim-<gen>.json  a push of that content is in flight: identical
                                            pushes take turns, so they make one version
    .nxd-registry.json                      the root marker every push writes (:mod:`.layout`)

Visibility: a version exists iff its ``manifest.json`` exists. The manifest is written last, with a
conditional create, so a push killed at any point leaves no visible version.

Version numbers are allocated by claims (:mod:`nxd_finetune.registry.claims`): a push claims the
next free number before it uploads anything, so concurrent pushes never write into the same
version, and a claim left by a killed push is taken over by the next push on the same machine.

``latest`` is resolved by listing (the highest visible version), which stays right under
concurrent pushes; ``aliases/latest.json`` is a best-effort copy for tools that read the layout.

All user-facing failures raise one-line :class:`~nxd_finetune.errors.NxdError` subclasses
(:class:`RegistryError`, :class:`IntegrityError`, :class:`StorageError` and its subclasses).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from nxd_finetune.registry import manifest as mf
from nxd_finetune.registry.claims import CLAIM_RE, Claims
from nxd_finetune.registry.errors import IntegrityError, RegistryError
from nxd_finetune.registry.layout import ALIASES, PUSHING, RETIRED, mark, read_alias, retired_number
from nxd_finetune.registry.ref import LATEST, check_name, check_tag
from nxd_finetune.storage import Storage, StorageError, StorageNotFoundError, open_storage
from nxd_finetune.storage.atomic import publish_dir

PushProgress = Callable[[str, int], None]
"""``progress(file_name, bytes_since_last_call)`` during push."""

_VERSION_MANIFEST_RE = re.compile(r"([^/]+)/([1-9][0-9]*)/manifest\.json")
_MAX_ATTEMPTS = 20
_LOCK_POLL_S = 0.2
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Version:
    """One published version. ``reused`` is True when a push found identical content already at the latest version."""

    registry: str
    name: str
    version: int
    manifest: mf.AdapterManifest = field(repr=False)
    tags: tuple[str, ...] = ()
    reused: bool = False

    @property
    def ref(self) -> str:
        return f"{self.registry.rstrip('/')}/{self.name}:{self.version}"


class Registry:
    """A registry rooted at a :class:`Storage` (or a URI for :func:`open_storage`)."""

    def __init__(self, storage: Storage | str | os.PathLike, *, claim_ttl: float = 6 * 3600.0):
        self.storage = storage if isinstance(storage, Storage) else open_storage(storage)
        self.claims = Claims(self.storage, claim_ttl)

    @property
    def uri(self) -> str:
        return self.storage.uri

    # -- reading --------------------------------------------------------------------------------

    def list_names(self) -> list[str]:
        """Names that have at least one visible version, sorted."""
        names = {m.group(1) for k in self.storage.list("") if (m := _VERSION_MANIFEST_RE.fullmatch(k))}
        return sorted(names)

    def versions(self, name: str) -> list[int]:
        """Visible version numbers of ``name``, ascending (empty if none)."""
        check_name(name)
        found = []
        for key in self.storage.list(f"{name}/"):
            m = _VERSION_MANIFEST_RE.fullmatch(key)
            if m and m.group(1) == name:
                found.append(int(m.group(2)))
        return sorted(found)

    def retired(self, name: str) -> list[int]:
        """Version numbers of ``name`` that were removed: never given to a push again."""
        out = []
        for key in self.storage.list(f"{check_name(name)}/{RETIRED}/"):
            if (n := retired_number(key.rsplit("/", 1)[1].removesuffix(".json"))) is not None:
                out.append(n)
        return sorted(out)

    def list_tags(self, name: str) -> dict[str, int]:
        """User tags of ``name`` -> version (``latest`` excluded: it is derived); malformed alias
        files are skipped (:meth:`read_tags` reports them)."""
        return self.read_tags(name)[0]

    def read_tags(self, name: str) -> tuple[dict[str, int], list[str]]:
        """``(tags, problems)``: user tags of ``name`` -> version, and one line for each alias file
        that is not a tag (malformed: hand-edited, a bad version number)."""
        tags, problems = {}, []
        for key in self.storage.list(f"{check_name(name)}/{ALIASES}/"):
            tag = key.rsplit("/", 1)[1].removesuffix(".json")
            if tag == LATEST or not key.endswith(".json") or "/" in key[len(name) + len(ALIASES) + 2:]:
                continue
            try:
                tags[tag] = read_alias(self.storage.get_bytes(key))[0]
            except StorageNotFoundError:
                continue  # removed meanwhile
            except RegistryError as e:
                problems.append(f"{self.uri.rstrip('/')}/{key} is malformed ({e}): tag {tag!r} skipped")
        return tags, problems

    def list_versions(self, name: str) -> list[Version]:
        """Every visible version of ``name`` with its manifest and tags, ascending."""
        tags = self.list_tags(name)
        out = []
        for v in self.versions(name):
            try:
                manifest = self._manifest(name, v)
            except RegistryError:
                continue  # removed while listing
            out.append(Version(self.uri, name, v, manifest, tuple(sorted(t for t, tv in tags.items() if tv == v))))
        return out

    def resolve(self, name: str, version: int | None = None, tag: str | None = None) -> int:
        """The version number a selector names: ``version``, else ``tag``, else the latest."""
        check_name(name)
        where = f"{self.uri.rstrip('/')}/{name}"
        if version is None and tag not in (None, LATEST):
            try:
                data = self.storage.get_bytes(f"{name}/{ALIASES}/{check_tag(tag)}.json")
            except StorageNotFoundError:
                raise RegistryError(f"{where} has no tag {tag!r}") from None
            try:
                version, sha = read_alias(data)
            except RegistryError as e:
                raise RegistryError(f"{where}: alias {tag!r} is malformed ({e})") from None
            self._check_tagged(name, tag, version, sha)
        if version is not None:
            if not self.storage.exists(f"{name}/{version}/{mf.MANIFEST}"):
                known = ", ".join(map(str, self.versions(name))) or "none"
                via = f" (tag {tag!r})" if tag else ""
                raise RegistryError(f"{where}:{version}{via} does not exist (versions: {known})")
            return version
        good, damaged = self._usable(name)
        if not good:
            if damaged:
                raise RegistryError(f"{where} has no usable version (damaged: {', '.join(map(str, damaged))})")
            raise RegistryError(f"no adapter {name!r} in {self.uri}")
        return good[-1]

    def _usable(self, name: str) -> tuple[list[int], list[int]]:
        """``(usable, damaged)`` visible versions of ``name``: a damaged one has a manifest that
        does not parse; ``latest``, push's unchanged check and ``ls`` skip it (it keeps its number)."""
        good, damaged = [], []
        for v in self.versions(name):
            try:
                self._manifest(name, v)
            except RegistryError:
                if self.storage.exists(f"{name}/{v}/{mf.MANIFEST}"):
                    damaged.append(v)
                continue
            good.append(v)
        return good, damaged

    def show(self, name: str, version: int | None = None, tag: str | None = None) -> Version:
        """The resolved version with its manifest and tags."""
        v = self.resolve(name, version, tag)
        tags = tuple(sorted(t for t, tv in self.list_tags(name).items() if tv == v))
        try:
            manifest = self._manifest(name, v)
        except RegistryError as e:
            if not self.storage.exists(f"{name}/{v}/{mf.MANIFEST}"):
                raise
            raise RegistryError(f"{self.uri.rstrip('/')}/{name}:{v} is damaged ({e}); "
                                f"remove it with: nxd-finetune adapters rm {self.uri.rstrip('/')}/{name}:{v} --yes"
                                ) from None
        return Version(self.uri, name, v, manifest, tags)

    def _manifest(self, name: str, v: int) -> mf.AdapterManifest:
        key = f"{name}/{v}/{mf.MANIFEST}"
        try:
            return mf.parse_manifest(self.storage.get_bytes(key), f"{self.uri}/{key}")
        except StorageNotFoundError:
            raise RegistryError(f"{self.uri}/{name}:{v} does not exist") from None

    # -- pull -----------------------------------------------------------------------------------

    def pull(self, name: str, dest: str | os.PathLike, version: int | None = None, tag: str | None = None) -> Version:
        """Download a version into ``dest`` (absent or empty) and verify every file's size and sha256.

        Files land in a temp dir beside ``dest`` that is renamed to ``dest`` only when all match;
        on any failure the temp dir is removed and ``dest`` is left as it was (IntegrityError for a
        mismatch or missing file). ``dest`` also receives the version's ``manifest.json``.
        """
        found = self.show(name, version, tag)
        dest = Path(dest).absolute()
        try:
            return self._pull_into(found, dest)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise RegistryError(f"cannot write {dest}: {e.strerror or e}") from None

    def _pull_into(self, found: Version, dest: Path) -> Version:
        name = found.name
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise RegistryError(f"destination {dest} already exists and is not an empty directory")
        with publish_dir(dest) as tmp:
            for fname, entry in found.manifest["files"].items():
                local = tmp / fname
                try:
                    self.storage.get_file(f"{name}/{found.version}/{fname}", local)
                except StorageNotFoundError:
                    raise IntegrityError(f"{found.ref} is incomplete: {fname} is missing from storage") from None
                size, digest = local.stat().st_size, mf.sha256_file(local)
                if size != entry["size"] or digest != entry["sha256"]:
                    raise IntegrityError(
                        f"{found.ref}: {fname} does not match its manifest (size {size} vs {entry['size']}, "
                        f"sha256 {digest[:12]}.. vs {entry['sha256'][:12]}..); nothing written to {dest}"
                    )
            (tmp / mf.MANIFEST).write_bytes(mf.dumps(found.manifest))
        return found

    # -- push -----------------------------------------------------------------------------------

    def push(
        self,
        src: str | os.PathLike,
        name: str,
        tags: Iterable[str] = (),
        metadata: Mapping[str, object] | None = None,
        progress: PushProgress | None = None,
    ) -> Version:
        """Publish the adapter directory ``src`` as the next version of ``name``; return it.

        ``metadata`` keys: ``recipe``, ``metrics``, ``parallel`` (dicts), ``lineage`` (parent REF),
        ``base_model`` (extra keys such as ``config_sha256``, merged over the values read from
        ``adapter_config.json``). If the files equal those of the latest version, nothing is
        uploaded and that version is returned with ``reused=True`` (tags are still applied).
        """
        check_name(name)
        tags = [self._user_tag(t) for t in tags]
        meta = mf.check_metadata(metadata)
        files = mf.scan_adapter_dir(Path(src))
        meta["objective"] = mf.adapter_objective(files)
        entries = mf.file_entries(files)
        adapter_base = mf.adapter_base(files)
        push_id = uuid.uuid4().hex
        # pushes of identical content take turns (a lock named by the content): the first publishes,
        # the others then find it as the latest version and reuse it
        content = hashlib.sha256(mf.dumps(entries)).hexdigest()[:32]
        waited = False
        while True:
            same = self._latest_with(name, entries)
            if same is not None:
                for t in tags:
                    self._write_alias(name, t, same)
                return dataclasses.replace(self.show(name, same), reused=True)
            lock = self.claims.take(f"{name}/{PUSHING}", content, push_id)
            if lock is not None:
                break
            if not waited:
                log.warning("note: an identical push of %s is in flight; waiting for it", name)
                waited = True
            time.sleep(_LOCK_POLL_S)
        try:
            if (same := self._latest_with(name, entries)) is None:
                return self._push_new(name, files, entries, adapter_base, meta, tags, push_id, progress)
            for t in tags:
                self._write_alias(name, t, same)
            return dataclasses.replace(self.show(name, same), reused=True)
        finally:
            try:
                self.claims.drop(f"{name}/{PUSHING}", content, lock)
            except Exception:  # noqa: BLE001 - never mask the push's own outcome; gc removes it
                pass

    def _latest_with(self, name: str, entries: Mapping[str, mf.FileEntry]) -> int | None:
        """The latest usable version if its files equal ``entries``, else None."""
        good, _ = self._usable(name)
        if good and self._manifest(name, good[-1])["files"] == entries:
            return good[-1]
        return None

    def _push_new(self, name, files, entries, adapter_base, meta, tags, push_id, progress) -> Version:
        versions, retired = self.versions(name), self.retired(name)
        for _ in range(_MAX_ATTEMPTS):
            v, gen = self.claims.claim(name, push_id, max([0, *versions, *retired]) + 1, files)
            try:
                published = self._upload_and_publish(name, v, gen, files, entries, adapter_base, meta, progress)
            except BaseException:
                self.claims.release(name, v, gen, files, push_id)
                raise
            if published is not None:
                self.claims.clear(name, v)
                for t in tags:
                    self._write_alias(name, t, v)
                self._refresh_latest(name)
                return Version(self.uri, name, v, published, tuple(sorted(tags)))
            versions, retired = self.versions(name), self.retired(name)  # lost the race: the next number
        raise RegistryError(f"could not publish {name} after {_MAX_ATTEMPTS} attempts (too much contention)")

    def _upload_and_publish(
        self, name, v, gen, files, entries, adapter_base, meta, progress
    ) -> mf.AdapterManifest | None:
        try:
            for fname, path in files.items():
                cb = (lambda n, _f=fname: progress(_f, n)) if progress else None
                self.storage.put_file(path, f"{name}/{v}/{fname}", cb)
        except (OSError, StorageError) as e:
            if not isinstance(e, OSError) or e.errno not in (errno.ENOSPC, errno.EDQUOT):
                self._check_owned(name, v, gen)  # the upload failed because a taker removed it
            raise
        for key in self.storage.list(f"{name}/{v}/"):  # leftovers of a dead push we took over
            base = key.rsplit("/", 1)[1]
            if base not in files and not CLAIM_RE.fullmatch(base) and base != mf.MANIFEST:
                self.storage.delete(key)
        # its temp files / unfinished uploads; not a claim's or the manifest's: another push may be
        # writing one here right now (a claim attempt, or the manifest of a push that lost its claim)
        for item in self.storage.leftovers(f"{name}/{v}/"):
            base = item.key.rsplit("/", 1)[1]
            if not CLAIM_RE.fullmatch(base) and base != mf.MANIFEST:
                self.storage.drop_leftover(item)
        manifest = mf.build_manifest(name, v, adapter_base, entries, meta)
        self._check_owned(name, v, gen)
        mark(self.storage)  # a root with a version is a registry: adapters gc works there, and only there
        if self.storage.put_bytes(f"{name}/{v}/{mf.MANIFEST}", mf.dumps(manifest), if_none_match=True):
            return manifest
        return None

    def _check_owned(self, name: str, v: int, gen: int) -> None:
        """The one line a push that lost its claim ends with (only a push on another machine that
        ran past the claim TTL can lose it: on this machine a claim lives as long as its process)."""
        if not self.claims.owns(name, v, gen):
            raise RegistryError(
                f"push of {name}:{v} lost its claim (it ran longer than the claim TTL of {self.claims.ttl:.0f}s "
                "and another push or adapters gc on another machine took the version over); push again"
            )

    # -- tags and removal -------------------------------------------------------------------------

    def _user_tag(self, tag: str) -> str:
        if check_tag(tag) == LATEST:
            raise RegistryError("tag 'latest' is maintained automatically and cannot be set")
        return tag

    def _manifest_sha(self, name: str, v: int) -> str | None:
        """sha256 of version ``v``'s manifest bytes; None when it does not exist."""
        try:
            return hashlib.sha256(self.storage.get_bytes(f"{name}/{v}/{mf.MANIFEST}")).hexdigest()
        except StorageNotFoundError:
            return None

    def _check_tagged(self, name: str, tag: str, v: int, sha: str | None) -> None:
        """A tag names a version and its manifest's sha256 (tags written before that: the version
        only): refuse one whose version is gone or whose content changed."""
        where = f"{self.uri.rstrip('/')}/{name}"
        current = self._manifest_sha(name, v)
        if current is None:
            raise RegistryError(f"tag {tag!r} of {where} names version {v}, which was removed; tag another version")
        if sha is not None and sha != current:
            raise IntegrityError(f"tag {tag!r} of {where} names version {v}, whose manifest changed since it was "
                                 f"tagged (sha256 {current[:12]}.. vs {sha[:12]}..)")

    def _write_alias(self, name: str, tag: str, v: int) -> None:
        """Point ``tag`` at ``v`` and the sha256 of its manifest, then check the version is still
        there: a tag racing a removal of its version is taken back and refused, never left dangling."""
        sha = self._manifest_sha(name, v)
        where = f"{self.uri.rstrip('/')}/{name}:{v}"
        if sha is None:
            raise RegistryError(f"{where} does not exist; tag {tag!r} not set")
        key = f"{name}/{ALIASES}/{tag}.json"
        body = mf.dumps({"version": v, "manifest_sha256": sha})
        self.storage.put_bytes(key, body)
        if self._manifest_sha(name, v) != sha:
            try:
                if self.storage.get_bytes(key) == body:
                    self.storage.delete(key)
            except StorageNotFoundError:
                pass
            raise RegistryError(f"{where} was removed while tagging it; tag {tag!r} not set")

    def _refresh_latest(self, name: str) -> None:
        versions, _ = self._usable(name)
        if versions:
            try:
                self._write_alias(name, LATEST, versions[-1])
            except RegistryError:
                pass  # removed meanwhile: best effort (latest is resolved by listing)
        else:
            self.storage.delete(f"{name}/{ALIASES}/{LATEST}.json")

    def tag(self, name: str, tag: str, version: int | None = None, from_tag: str | None = None) -> Version:
        """Point ``tag`` at the version ``version``/``from_tag`` selects (latest if neither); moves an existing tag."""
        self._user_tag(tag)
        v = self.resolve(name, version, from_tag)
        self._write_alias(name, tag, v)
        return self.show(name, v)

    def remove(self, name: str, version: int | None = None, tag: str | None = None) -> Version:
        """Delete one version (manifest first, so it vanishes at once, then its files).

        Tags that pointed to it are dropped (they are listed in the returned ``Version.tags``).
        A bare name without ``version``/``tag`` is refused: removal must name what it removes.
        """
        if version is None and tag in (None, LATEST):
            raise RegistryError(f"say which version of {name} to remove: NAME:VERSION or NAME@TAG")
        try:
            found = self.show(name, version, tag)
        except RegistryError:
            v = self.resolve(name, version, tag) if version is not None else None
            if v is None or not self.storage.exists(f"{name}/{v}/{mf.MANIFEST}"):
                raise
            # damaged: removable by its number (its manifest does not parse: an empty one stands in)
            found = Version(self.uri, name, v, cast(mf.AdapterManifest, {}))
        # the number is retired before the version disappears: no later push takes it again, so a
        # REF to it (lineage, a tag copied elsewhere) never names other weights
        # with the files it lists: all that gc removes there if this rm dies before deleting them
        listed = sorted((found.manifest or {}).get("files", {}))
        self.storage.put_bytes(f"{name}/{RETIRED}/{found.version}.json",
                               mf.dumps({"version": found.version, "files": listed}))
        self.storage.delete(f"{name}/{found.version}/{mf.MANIFEST}")
        self.storage.delete_prefix(f"{name}/{found.version}/")
        # listed again now that the manifest is gone: a tag written before that is dropped here, a
        # tag written after it finds the version gone and takes itself back (_write_alias)
        tags = {t for t, tv in self.list_tags(name).items() if tv == found.version} | set(found.tags)
        for t in sorted(tags):
            key = f"{name}/{ALIASES}/{t}.json"
            try:
                if read_alias(self.storage.get_bytes(key))[0] == found.version:
                    self.storage.delete(key)  # not a tag moved elsewhere meanwhile
            except (StorageNotFoundError, RegistryError):
                pass
        self._refresh_latest(name)
        return dataclasses.replace(found, tags=tuple(sorted(tags)))


# -- REF-level API ------------------------------------------------------------------------------


def open_registry(uri: str | os.PathLike, **storage_options) -> Registry:
    """A :class:`Registry` on ``uri`` (local path, ``file://`` or ``s3://``)."""
    return Registry(open_storage(uri, **storage_options))

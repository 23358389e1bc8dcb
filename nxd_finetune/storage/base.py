"""The one storage seam: local directories and ``s3://`` prefixes behind one small interface.

Used by the adapter registry and by training checkpoints. A storage is a *root*
(a directory, or a bucket plus key prefix); every method takes a *key* relative to that root,
``/``-separated, without ``..`` or empty components. Listing is always recursive over keys; there
are no directory objects (``list_dirs`` derives "directories" from key prefixes).

Contracts shared by every backend:

- writes are all-or-nothing: a reader sees the old object, the new one, or none, never a prefix
  (local: temp file + ``os.replace``; S3: an object appears only when its upload completes);
- ``put_bytes(key, data, if_none_match=True)`` is an atomic create-if-absent: exactly one of
  several concurrent callers gets ``True``;
- a missing key raises :class:`StorageNotFoundError`; credentials, missing bucket and access
  problems raise the one-line :class:`StorageError` subclasses below.

``boto3`` is imported only by :mod:`nxd_finetune.storage.s3`, and only when an ``s3://`` URI is opened.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from nxd_finetune.storage.cache import staging_dir, sweep_staging
from nxd_finetune.storage.errors import StorageError

Progress = Callable[[int], None]
"""Called with the number of bytes moved since the previous call."""
Keys = list[str]
"""Sorted keys (an alias because ``list`` is also a method name of :class:`Storage`)."""

TMP_PREFIX = ".nxdtmp-"
"""Names of temp files that writers use; never listed."""


@dataclass(frozen=True)
class Leftover:
    """What a killed writer left behind: a local temp file or an incomplete S3 multipart upload.

    ``key``: the object it was writing (its directory tells whose it was); ``age_s``: seconds since
    it was started; ``size``: bytes held, where known; ``handle``: the backend's own name for it
    (the temp file's key, or the multipart upload id)."""

    key: str
    age_s: float
    size: int | None
    handle: str


@dataclass(frozen=True)
class ObjectHead:
    """What :meth:`Storage.head` reads of an object without fetching it: its size, a version tag
    that changes whenever its content does (S3's ETag), and its sha256 where it carries one (hex)."""

    size: int
    etag: str
    sha256: str | None


Leftovers = list[Leftover]
"""Unfinished writes (an alias because ``list`` is also a method name of :class:`Storage`)."""


def check_key(key: str, *, allow_empty: bool = False) -> str:
    """Return ``key`` if it is a clean relative key, else raise :class:`StorageError`."""
    if key == "" and allow_empty:
        return key
    parts = key.rstrip("/").split("/") if allow_empty else key.split("/")
    if key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in key:
        raise StorageError(f"invalid storage key {key!r} (relative, '/'-separated, no '..' or empty parts)")
    return key


class Storage(ABC):
    """A root under which objects are stored by key; see the module docstring for the contracts."""

    uri: str

    @abstractmethod
    def put_file(self, local: str | os.PathLike, key: str, progress: Progress | None = None) -> None:
        """Upload a local file to ``key`` (overwrites); large files go in parts where the backend can."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False) -> bool:
        """Write ``data`` to ``key``. With ``if_none_match`` create only if absent: ``False`` if it existed."""

    @abstractmethod
    def get_file(self, key: str, local: str | os.PathLike) -> None:
        """Download ``key`` to the local path (overwritten). Missing key: :class:`StorageNotFoundError`."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Return the content of ``key``. Missing key: :class:`StorageNotFoundError`."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object is stored at ``key``."""

    @abstractmethod
    def list(self, prefix: str = "") -> Keys:
        """All keys under ``prefix`` (a plain string prefix, recursive), sorted."""

    def head(self, key: str) -> ObjectHead:
        """Size, version tag and (where known) sha256 of object ``key``, without fetching it; what
        a data file fetch keys its cache entry on. Missing key: :class:`StorageNotFoundError`.
        A backend whose data files are not fetched need not have it."""
        raise StorageError(f"{self.uri} cannot tell an object's size and version ({type(self).__name__} has no head)")

    def check_root(self) -> None:  # noqa: B027  (a no-op unless a backend can tell)
        """Raise StorageError where the root itself is unusable (a local root at or under a file), so
        that a listing does not report "nothing here" for a wrong path. A no-op by default."""

    @abstractmethod
    def list_dirs(self, prefix: str = "") -> Keys:
        """Names of the immediate "subdirectories" of ``prefix`` (which is empty or ends in ``/``), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (must end in ``/``); return how many were deleted."""
        if not prefix.endswith("/"):
            raise StorageError(f"delete_prefix needs a prefix ending in '/', got {prefix!r}")
        keys = self.list(prefix)
        for key in keys:
            self.delete(key)
        return len(keys)

    @contextlib.contextmanager
    def staged(self, key: str) -> Iterator[Path]:
        """A local path to write ``key``'s content to; stored at ``key`` when the block ends
        without an error, removed in any case.

        Here (remote backends): a file under ``<cache>/staging`` (see
        :mod:`nxd_finetune.storage.cache`), named with this process's PID, so that files of
        killed writers are found and removed by the next staging on this machine, never left in the
        system temp directory. A local backend stages beside ``key`` itself (no copy).
        """
        directory = staging_dir()
        sweep_staging(directory)
        path = directory / f"{os.getpid()}-{uuid.uuid4().hex}-{key.rsplit('/', 1)[-1]}"
        try:
            yield path
            self.put_file(path, key)
        finally:
            path.unlink(missing_ok=True)

    def leftovers(self, prefix: str = "") -> Leftovers:
        """Unfinished writes under ``prefix`` (temp files, incomplete uploads); none by default."""
        return []

    def drop_leftover(self, item: Leftover) -> None:
        """Remove one unfinished write found by :meth:`leftovers` (already gone is not an error)."""
        raise NotImplementedError(f"{type(self).__name__} reports no leftovers")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

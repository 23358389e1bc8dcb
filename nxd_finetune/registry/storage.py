"""The one storage seam: local directories and ``s3://`` prefixes behind one small interface.

Used by the adapter registry and meant for training checkpoints too. A storage is a *root*
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

``boto3`` is imported only by :mod:`nxd_finetune.registry.s3`, and only when an ``s3://`` URI is opened.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from nxd_finetune.registry.errors import StorageError, StorageNotFoundError

Progress = Callable[[int], None]
"""Called with the number of bytes moved since the previous call."""
Keys = list[str]
"""Sorted keys (an alias because ``list`` is also a method name of :class:`Storage`)."""

_TMP_PREFIX = ".nxdtmp-"
_COPY_CHUNK = 1 << 20


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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


class LocalStorage(Storage):
    """A directory tree. Keys map to files under ``root``; temp files (``.nxdtmp-*``) are never listed."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().absolute()
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _tmp_beside(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.with_name(f"{_TMP_PREFIX}{uuid.uuid4().hex}-{path.name}")

    def put_file(self, local: str | os.PathLike, key: str, progress: Progress | None = None) -> None:
        dst = self._path(key)
        tmp = self._tmp_beside(dst)
        try:
            with open(local, "rb") as src, open(tmp, "wb") as out:
                while chunk := src.read(_COPY_CHUNK):
                    out.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False) -> bool:
        dst = self._path(key)
        tmp = self._tmp_beside(dst)
        try:
            with open(tmp, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            if not if_none_match:
                os.replace(tmp, dst)
                return True
            return _link_exclusive(tmp, dst, data)
        finally:
            tmp.unlink(missing_ok=True)

    def get_file(self, key: str, local: str | os.PathLike) -> None:
        try:
            shutil.copyfile(self._path(key), local)
        except FileNotFoundError:
            raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from None

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> Keys:
        # Walk only the directory that contains the prefix, then filter by the string prefix.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / check_key(base) if base else self.root
        keys = []
        for dirpath, _dirs, files in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for f in files:
                if f.startswith(_TMP_PREFIX):
                    continue
                key = f if rel == "." else f"{rel}/{f}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def list_dirs(self, prefix: str = "") -> Keys:
        if prefix and not prefix.endswith("/"):
            raise StorageError(f"list_dirs needs '' or a prefix ending in '/', got {prefix!r}")
        start = self.root / check_key(prefix.rstrip("/")) if prefix else self.root
        if not start.is_dir():
            return []
        return sorted(p.name for p in start.iterdir() if p.is_dir() and any(_has_files(p)))

    def delete_prefix(self, prefix: str) -> int:
        """As :meth:`Storage.delete_prefix`; also removes temp files that killed writers left there."""
        count = super().delete_prefix(prefix)
        directory = self.root / check_key(prefix.rstrip("/"))
        if directory.is_dir():
            shutil.rmtree(directory, ignore_errors=True)
            self._prune(directory.parent)
        return count

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        self._prune(path.parent)

    def _prune(self, parent: Path) -> None:
        """Remove directories left empty up to the root, so removed versions do not linger as folders."""
        while parent != self.root and parent.is_relative_to(self.root):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def _has_files(path: Path):
    for _dirpath, _dirs, files in os.walk(path):
        yield from (f for f in files if not f.startswith(_TMP_PREFIX))


def _link_exclusive(tmp: Path, dst: Path, data: bytes) -> bool:
    """Publish the complete temp file at ``dst`` only if ``dst`` is absent (``link`` fails on EEXIST).

    Hard links make the create atomic *and* complete: nobody sees a half-written file. Where the
    filesystem has no hard links, fall back to ``O_CREAT|O_EXCL`` (atomic create, content written after).
    """
    try:
        os.link(tmp, dst)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
    try:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    return True


def open_storage(uri: str | os.PathLike, **options) -> Storage:
    """Open a storage root: a local path, ``file://PATH`` or ``s3://BUCKET[/PREFIX]``.

    ``options`` go to the backend (for S3: ``endpoint_url``, ``region``, ``multipart_threshold``,
    ``multipart_chunksize``, ``max_attempts``; see :class:`nxd_finetune.registry.s3.S3Storage`).
    Other schemes raise :class:`StorageError`.
    """
    text = os.fspath(uri)
    if text.startswith("s3://"):
        from nxd_finetune.registry.s3 import S3Storage  # the only route to boto3

        return S3Storage.from_uri(text, **options)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        scheme = text.split("://", 1)[0]
        raise StorageError(
            f"unsupported storage URI scheme {scheme!r} in {text!r} (use a local path, file:// or s3://)"
        )
    if options:
        raise StorageError(f"local storage takes no options, got {sorted(options)}")
    if not text:
        raise StorageError("empty storage path")
    return LocalStorage(text)

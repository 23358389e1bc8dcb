"""Local backend of the storage seam: a directory tree (see :mod:`nxd_finetune.storage.base`).

The operating system's refusals (a path component over the file system's name limit, a file where
a directory should be, permissions) are one-line :class:`StorageError` errors naming the path; a full
disk stays the ``OSError`` it is (the CLI says "no space left" and exits 1).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from nxd_finetune.storage.base import TMP_PREFIX, Keys, Leftover, Leftovers, Progress, Storage, check_key
from nxd_finetune.storage.errors import StorageError, StorageNotFoundError

_COPY_CHUNK = 1 << 20
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _os_errors(op: str) -> Callable[[Callable[Concatenate[LocalStorage, _P], _R]],
                                    Callable[Concatenate[LocalStorage, _P], _R]]:
    """Turn an ``OSError`` of a :class:`LocalStorage` method into one :class:`StorageError` line
    ("cannot ``op`` PATH: reason"); ENOSPC/EDQUOT propagate unchanged."""

    def wrap(method: Callable[Concatenate[LocalStorage, _P], _R]) -> Callable[Concatenate[LocalStorage, _P], _R]:
        @functools.wraps(method)
        def wrapper(self: LocalStorage, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return method(self, *args, **kwargs)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if e.errno in (errno.ENOTDIR, errno.EEXIST) and (file := _file_in_the_way(e.filename)):
                    raise StorageError(f"cannot {op} under {self.uri}: {file} is a file, not a directory") from None
                raise StorageError(f"cannot {op} {e.filename or self.uri}: {e.strerror or e}") from None

        return wrapper

    return wrap


class LocalStorage(Storage):
    """A directory tree. Keys map to files under ``root``; temp files (``.nxdtmp-*``) are never listed."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().absolute()
        self.uri = str(self.root)

    @_os_errors("list")
    def check_root(self) -> None:
        """StorageError (one line) when the root is, or lies under, a file: listing it would say
        "nothing here" where the user gave a wrong path."""
        if file := _file_in_the_way(self.root):
            raise StorageError(f"cannot list under {self.uri}: {file} is a file, not a directory")

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _tmp_beside(self, path: Path) -> Path:
        """A new, empty temp file beside ``path`` (its directory made). From then on the directory
        holds a file, so no concurrent :meth:`delete` prunes it under the writer."""
        tmp = path.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}-{path.name}")
        in_dir(tmp.parent, lambda: os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)))
        return tmp

    @_os_errors("write")
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

    @contextlib.contextmanager
    def staged(self, key: str) -> Iterator[Path]:
        """As :meth:`Storage.staged`: a temp file beside ``key`` (``.nxdtmp-*``, never listed, found
        by :meth:`leftovers`), synced and renamed onto ``key`` at the end."""
        dst = self._path(key)
        tmp = self._tmp_beside(dst)
        try:
            yield tmp
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)

    @_os_errors("write")
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

    @_os_errors("read")
    def get_file(self, key: str, local: str | os.PathLike) -> None:
        try:
            shutil.copyfile(self._path(key), local)
        except FileNotFoundError:
            raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from None

    @_os_errors("read")
    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from None

    @_os_errors("read")
    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    @_os_errors("list")
    def list(self, prefix: str = "") -> Keys:
        # Walk only the directory that contains the prefix, then filter by the string prefix.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / check_key(base) if base else self.root
        keys = []
        for dirpath, _dirs, files in os.walk(start, onerror=_walk_error):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for f in files:
                if f.startswith(TMP_PREFIX):
                    continue
                key = f if rel == "." else f"{rel}/{f}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    @_os_errors("list")
    def leftovers(self, prefix: str = "") -> Leftovers:
        """Temp files (``.nxdtmp-<id>-<name>``) of writers that never finished, under ``prefix``."""
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / check_key(base) if base else self.root
        now = time.time()
        found = []
        for dirpath, _dirs, files in os.walk(start, onerror=_walk_error):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for f in files:
                if not f.startswith(TMP_PREFIX):
                    continue
                handle = f if rel == "." else f"{rel}/{f}"
                target = f[len(TMP_PREFIX):].split("-", 1)[-1]
                key = target if rel == "." else f"{rel}/{target}"
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, f))
                except FileNotFoundError:
                    continue  # finished meanwhile
                found.append(Leftover(key, max(0.0, now - st.st_mtime), st.st_size, handle))
        return sorted(found, key=lambda x: x.handle)

    @_os_errors("delete")
    def drop_leftover(self, item: Leftover) -> None:
        path = self.root / check_key(item.handle)
        if not path.name.startswith(TMP_PREFIX):
            raise StorageError(f"{self.uri}/{item.handle} is not a temp file")
        path.unlink(missing_ok=True)
        self._prune(path.parent)

    @_os_errors("list")
    def list_dirs(self, prefix: str = "") -> Keys:
        if prefix and not prefix.endswith("/"):
            raise StorageError(f"list_dirs needs '' or a prefix ending in '/', got {prefix!r}")
        start = self.root / check_key(prefix.rstrip("/")) if prefix else self.root
        if not start.is_dir():
            return []
        return sorted(p.name for p in start.iterdir() if p.is_dir() and any(_has_files(p)))

    @_os_errors("delete")
    def delete_prefix(self, prefix: str) -> int:
        """As :meth:`Storage.delete_prefix`; also removes temp files that killed writers left there."""
        count = super().delete_prefix(prefix)
        directory = self.root / check_key(prefix.rstrip("/"))
        if directory.is_dir():
            shutil.rmtree(directory, ignore_errors=True)
            self._prune(directory.parent)
        return count

    @_os_errors("delete")
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


def in_dir(directory: Path, create: Callable[[], _R], attempts: int = 100) -> _R:
    """Make ``directory`` (and its parents), then run ``create``, which makes an entry in it.

    A concurrent delete prunes directories it left empty (:meth:`LocalStorage.delete`), so the
    directory can vanish between ``mkdir`` and ``create`` (``create`` fails with ENOENT), or even
    inside ``mkdir`` (made by another writer, then pruned before ``mkdir`` saw it: EEXIST, with no
    file in the way): then both run again. Once ``create`` has made its entry the directory is not
    empty and no prune removes it."""
    for attempt in range(attempts):
        last = attempt == attempts - 1
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            if last or _file_in_the_way(directory) is not None:
                raise
            continue  # pruned meanwhile: make it again
        except FileNotFoundError:
            if last:
                raise
            continue
        try:
            return create()
        except FileNotFoundError:
            if last:
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def _walk_error(e: OSError) -> None:
    """``os.walk``'s error hook: a root that does not exist (yet) lists nothing; any other
    refusal (permissions, a name over the limit) is raised, not taken for an empty listing."""
    if e.errno not in (errno.ENOENT, errno.ENOTDIR):
        raise e


def _file_in_the_way(filename: object) -> Path | None:
    """The nearest existing ancestor of ``filename`` (or itself) when it is not a directory."""
    if not isinstance(filename, str | os.PathLike):
        return None
    path = Path(filename)
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            return None if p.is_dir() else p
    return None


def _has_files(path: Path):
    for _dirpath, _dirs, files in os.walk(path):
        yield from (f for f in files if not f.startswith(TMP_PREFIX))


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

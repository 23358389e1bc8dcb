"""Data files fetched from remote storage into a local cache, checked: training data
(``data.train`` / ``data.eval`` may name objects of a scheme whose record says ``data``
(:mod:`nxd_finetune.storage.schemes`): ``s3://bucket/key``; ``.jsonl``, ``.json``, ``.parquet``,
``.csv``, ``.arrow``), read as local files once fetched
(:func:`nxd_finetune.data.datasets.resolve_sources`, ``validate``'s data checks).

Each object is fetched once per machine into the data cache,
``<data cache>/<scheme>/<digest of the URI, ETag and size>/<name>`` (``s3/...``): downloaded to a
temporary file beside it, its sha256 computed, then renamed into place with the digest in
``<name>.sha256``. A later run of the same object (same ETag and size) reads the cached copy after
checking it against that digest (a damaged copy is fetched again); a changed object gets a new
entry. When the object carries a sha256 (S3: user metadata ``sha256``, or its ``ChecksumSHA256``),
the download must match it. A fetch holds a shared lock on ``.<name>.lock`` in the entry while it
writes there (``flock``: the kernel drops it when the process dies, SIGKILL included); one that
finds no other fetch holding it removes the entry's temporary files, which are then a dead fetch's
(a killed download), and a live fetch's files are never touched. A full disk is one line and leaves
no entry behind. Errors are one line: a missing object is ``data file not found: s3://...`` as for
a local file; credentials, bucket and access problems are the storage layer's
(:mod:`nxd_finetune.storage`).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypedDict

from nxd_finetune.errors import DataError
from nxd_finetune.storage.base import ObjectHead, Storage
from nxd_finetune.storage.errors import StorageNotFoundError
from nxd_finetune.storage.schemes import data_scheme

_CHUNK = 1 << 20


class FileEntry(TypedDict):
    """A stored file as a manifest lists it (registry versions, checkpoints): its sha256 and size."""

    sha256: str
    size: int


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _cached(path: Path) -> bool:
    """Whether ``path`` is a complete fetched copy: its recorded sha256 matches its bytes."""
    record = path.with_name(path.name + ".sha256")
    if not (path.is_file() and record.is_file()):
        return False
    try:
        words = record.read_text(encoding="utf-8").split()
        return bool(words) and words[0] == sha256_file(path)
    except (OSError, UnicodeDecodeError):
        return False  # an unreadable record (or copy) is a missing one: the copy is fetched again


@contextmanager
def _fetch_lock(entry: Path, name: str) -> Iterator[None]:
    """Held by a fetch into ``entry`` while it writes there: a shared ``flock`` on
    ``.<name>.lock``, which the kernel drops when the process dies (SIGKILL included). Taken
    exclusively first: got, no fetch of this entry is alive, so every temporary file of the entry
    is a dead fetch's and is removed. The last fetch out removes the lock file. On a file system
    without locks, nothing is removed (a live fetch is never told from a dead one)."""
    lock = entry / f".{name}.lock"
    try:
        fd = _open_locked(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # fetches are running: their files are theirs
        fd = _open_locked(lock, fcntl.LOCK_SH)
    else:
        if fd is not None:
            _remove_temp_files(entry, name)
            fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        yield
    finally:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock.unlink(missing_ok=True)  # the last one out
            except BlockingIOError:
                pass
            finally:
                os.close(fd)


def _open_locked(lock: Path, op: int) -> int | None:
    """A descriptor of ``lock`` (created, with its directory, if absent) holding ``flock`` ``op``;
    None where the file system has no locks. BlockingIOError: ``op`` is non-blocking and refused."""
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # the emptied entry was removed meanwhile: made again
        try:
            fcntl.flock(fd, op)
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return None
            raise
        os.close(fd)  # the lock file was removed by the last fetch out meanwhile: lock the new one


def _remove_temp_files(entry: Path, name: str) -> None:
    """Remove the temporary files of dead fetches (``.<name>.<pid>.part*``, records being written):
    every ``.<name>.*`` but the lock."""
    lock = f".{name}.lock"
    for p in entry.glob(f".{glob.escape(name)}.*"):
        if p.name != lock:
            p.unlink(missing_ok=True)


def _swept(entry: Path, name: str) -> None:
    """The temporary files dead fetches left beside a complete copy removed, if no fetch is running;
    nothing changes where that cannot be done (a read-only cache: the copy is still used)."""
    if not any(p.name != f".{name}.lock" for p in entry.glob(f".{glob.escape(name)}.*")):
        return
    try:
        with _fetch_lock(entry, name):
            pass
    except OSError:
        pass


def fetch_object(uri: str, cache_root: str | os.PathLike) -> Path:
    """The local copy of object ``uri`` (``s3://bucket/key``, or another scheme whose record says
    ``data``) under ``<cache_root>/<scheme>/``, fetched if absent or damaged (see the module
    docstring)."""
    scheme = data_scheme(uri)
    if scheme is None:
        raise DataError(f"data source {uri!r}: not a scheme whose data files are fetched")
    rest = uri[len(scheme.prefix):]
    parent, name = posixpath.split(rest)
    if not name or "/" not in rest:
        raise DataError(f"data source {uri!r}: name an object, {scheme.prefix}BUCKET/KEY")
    storage = scheme.open(scheme.prefix + parent)
    try:
        head = storage.head(name)
    except StorageNotFoundError:
        raise DataError(f"data file not found: {uri}") from None
    key = hashlib.sha256(f"{uri}\n{head.etag}\n{head.size}".encode()).hexdigest()[:16]
    entry = Path(cache_root) / scheme.name / key
    local = entry / name
    if _cached(local):
        _swept(entry, name)
        return local
    created = not entry.exists()
    try:
        with _fetch_lock(entry, name):
            if not _cached(local):  # else another fetch completed it meanwhile
                _download(storage, uri, head, local)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"{uri}: no space left on the device to fetch it into {entry} "
                            f"({head.size} bytes): free some space or set NXD_FINETUNE_CACHE") from None
        raise DataError(f"{uri}: cannot fetch it into {entry}: {e.strerror or e}") from None
    finally:
        if created and not local.exists():
            _remove_empty(entry, Path(cache_root))
    return local


def _download(storage: Storage, uri: str, head: ObjectHead, local: Path) -> None:
    """Object ``local.name`` of ``storage`` into ``local``: fetched beside it, checked against
    ``head`` (size, sha256), renamed into place, then its sha256 record (written last: it marks the
    copy complete). Temporary files are removed on any failure."""
    name = local.name
    tmp = local.with_name(f".{name}.{os.getpid()}.part")
    record = local.with_name(f".{name}.{os.getpid()}.sha256")
    try:
        storage.get_file(name, tmp)
        digest = sha256_file(tmp)
        if tmp.stat().st_size != head.size:
            raise DataError(f"{uri}: fetched {tmp.stat().st_size} bytes, the object has {head.size}")
        if head.sha256 is not None and head.sha256 != digest:
            raise DataError(f"{uri}: the fetched bytes have sha256 {digest}, the object says {head.sha256}")
        record.write_text(f"{digest}  {name}\n")  # before the copy: a full disk fails here with nothing placed
        os.replace(tmp, local)
        os.replace(record, local.with_name(name + ".sha256"))
    finally:
        tmp.unlink(missing_ok=True)
        record.unlink(missing_ok=True)


def _remove_empty(entry: Path, root: Path) -> None:
    """Remove ``entry`` and the parents it made below ``root``, where empty."""
    for d in (entry, entry.parent):
        try:
            if d != root:
                d.rmdir()
        except OSError:
            return

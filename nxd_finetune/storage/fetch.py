"""Objects fetched from S3 into a local cache, checked: training data (``data.train`` /
``data.eval`` may name ``s3://bucket/key`` objects: ``.jsonl``, ``.json``, ``.parquet``, ``.csv``,
``.arrow``), read as local files once fetched (:func:`nxd_finetune.data.datasets.resolve_sources`,
``validate``'s data checks).

Each object is fetched once per machine into the data cache,
``<data cache>/s3/<digest of the URI, ETag and size>/<name>``: downloaded to a temporary file beside
it, its sha256 computed, then renamed into place with the digest in ``<name>.sha256``. A later
run of the same object (same ETag and size) reads the cached copy after checking it against that
digest (a damaged copy is fetched again); a changed object gets a new entry. When the object
carries a sha256 (user metadata ``sha256``, or S3's ``ChecksumSHA256``), the download must match
it. A fetch removes the temporary files of earlier fetches of the same entry whose process is gone
(a killed download); a full disk is one line and leaves no entry behind. Errors are one line: a
missing object is ``data file not found: s3://...`` as for a local file; credentials, bucket and
access problems are the storage layer's (:mod:`nxd_finetune.storage`).
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import posixpath
from pathlib import Path
from typing import TypedDict

from nxd_finetune.errors import DataError
from nxd_finetune.storage.errors import StorageNotFoundError

S3_SCHEME = "s3://"
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
    except (OSError, UnicodeDecodeError):
        return False  # an unreadable record is a missing one: the copy is fetched again
    return bool(words) and words[0] == sha256_file(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _clean_dead_fetches(entry: Path, name: str) -> None:
    """Remove the temporary files (``.<name>.<pid>.part`` / ``.sha256``) of fetches whose process
    is gone (killed mid-download); a live fetch's are left to it."""
    prefix = f".{name}."
    for p in entry.glob(f".{glob.escape(name)}.*"):
        pid, _, suffix = p.name[len(prefix):].partition(".")
        if suffix in ("part", "sha256") and pid.isdigit() and not _pid_alive(int(pid)):
            p.unlink(missing_ok=True)


def fetch_s3(uri: str, cache_root: str | os.PathLike) -> Path:
    """The local copy of object ``uri`` (``s3://bucket/key``) under ``<cache_root>/s3/``, fetched
    if absent or damaged. Raises DataError (one line) for a missing object or a sha256 mismatch."""
    from nxd_finetune.storage.s3 import S3Storage  # boto3: only when an s3:// source is used

    parent, name = posixpath.split(uri[len(S3_SCHEME):])
    if not name or "/" not in uri[len(S3_SCHEME):]:
        raise DataError(f"data source {uri!r}: name an object, s3://BUCKET/KEY")
    storage = S3Storage.from_uri(S3_SCHEME + parent)
    try:
        head = storage.head(name)
    except StorageNotFoundError:
        raise DataError(f"data file not found: {uri}") from None
    key = hashlib.sha256(f"{uri}\n{head.etag}\n{head.size}".encode()).hexdigest()[:16]
    entry = Path(cache_root) / "s3" / key
    local = entry / name
    if entry.is_dir():
        _clean_dead_fetches(entry, name)
    if _cached(local):
        return local
    created = not entry.exists()
    tmp = entry / f".{name}.{os.getpid()}.part"
    record = entry / f".{name}.{os.getpid()}.sha256"
    try:
        entry.mkdir(parents=True, exist_ok=True)
        storage.get_file(name, tmp)
        digest = sha256_file(tmp)
        if tmp.stat().st_size != head.size:
            raise DataError(f"{uri}: fetched {tmp.stat().st_size} bytes, the object has {head.size}")
        if head.sha256 is not None and head.sha256 != digest:
            raise DataError(f"{uri}: the fetched bytes have sha256 {digest}, the object says {head.sha256}")
        os.replace(tmp, local)
        record.write_text(f"{digest}  {name}\n")
        os.replace(record, local.with_name(name + ".sha256"))  # written last: marks the copy complete
    except OSError as e:
        if created and not local.exists():
            _remove_empty(entry, Path(cache_root))
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DataError(f"{uri}: no space left on the device to fetch it into {entry} "
                            f"({head.size} bytes): free some space or set NXD_FINETUNE_CACHE") from None
        raise DataError(f"{uri}: cannot fetch it into {entry}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
    return local


def _remove_empty(entry: Path, root: Path) -> None:
    """Remove ``entry`` and the parents it made below ``root``, where empty."""
    for d in (entry, entry.parent):
        try:
            if d != root:
                d.rmdir()
        except OSError:
            return

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
it. Errors are one line: a missing object is ``data file not found: s3://...`` as for a local
file; credentials, bucket and access problems are the storage layer's (:mod:`nxd_finetune.storage`).
"""

from __future__ import annotations

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
    return record.read_text().split()[0] == sha256_file(path)


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
    if _cached(local):
        return local
    entry.mkdir(parents=True, exist_ok=True)
    tmp = entry / f".{name}.{os.getpid()}.part"
    try:
        storage.get_file(name, tmp)
        digest = sha256_file(tmp)
        if tmp.stat().st_size != head.size:
            raise DataError(f"{uri}: fetched {tmp.stat().st_size} bytes, the object has {head.size}")
        if head.sha256 is not None and head.sha256 != digest:
            raise DataError(f"{uri}: the fetched bytes have sha256 {digest}, the object says {head.sha256}")
        os.replace(tmp, local)
    finally:
        tmp.unlink(missing_ok=True)
    record = entry / f".{name}.{os.getpid()}.sha256"
    record.write_text(f"{digest}  {name}\n")
    os.replace(record, local.with_name(name + ".sha256"))  # written last: marks the copy complete
    return local

"""The storage layer below the registry and training checkpoints.

- :mod:`.base`: the :class:`Storage` interface and its contracts (keys, atomic writes, errors);
- :mod:`.local` / :mod:`.s3`: the two backends (``boto3`` is imported only by :mod:`.s3`, and only
  when an ``s3://`` URI is opened); :func:`open_storage` picks one from a URI;
- :mod:`.atomic`: :func:`publish_dir`, the one way a local directory is published atomically;
- :mod:`.cache`: where nxd-finetune keeps its caches (``$NXD_FINETUNE_CACHE``).

Nothing here imports the registry, checkpoints or training code.
"""

from __future__ import annotations

import os

from nxd_finetune.storage.base import Keys, Leftover, Progress, Storage, check_key
from nxd_finetune.storage.errors import (
    StorageAccessDeniedError,
    StorageBucketNotFoundError,
    StorageCredentialsError,
    StorageError,
    StorageNotFoundError,
)
from nxd_finetune.storage.local import LocalStorage


def open_storage(uri: str | os.PathLike, **options) -> Storage:
    """Open a storage root: a local path, ``file://PATH`` or ``s3://BUCKET[/PREFIX]``.

    ``options`` go to the backend (for S3: ``endpoint_url``, ``region``, ``multipart_threshold``,
    ``multipart_chunksize``, ``max_attempts``; see :class:`nxd_finetune.storage.s3.S3Storage`).
    Other schemes raise :class:`StorageError`.
    """
    text = os.fspath(uri)
    if text.startswith("s3://"):
        from nxd_finetune.storage.s3 import S3Storage  # the only route to boto3

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


__all__ = [
    "Keys",
    "Leftover",
    "LocalStorage",
    "Progress",
    "Storage",
    "StorageAccessDeniedError",
    "StorageBucketNotFoundError",
    "StorageCredentialsError",
    "StorageError",
    "StorageNotFoundError",
    "check_key",
    "open_storage",
]

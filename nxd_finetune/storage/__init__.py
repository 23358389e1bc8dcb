"""The storage layer below the registry and training checkpoints.

- :mod:`.base`: the :class:`Storage` interface and its contracts (keys, atomic writes, errors);
- :mod:`.local` / :mod:`.s3`: the two backends (``boto3`` is imported only by :mod:`.s3`, and only
  when an ``s3://`` URI is opened);
- :mod:`.schemes`: one record per URL scheme (how a root on it opens, whether its data files are
  fetched); :func:`open_storage` picks the backend from a URI there;
- :mod:`.atomic`: :func:`publish_dir`, the one way a local directory is published atomically;
- :mod:`.cache`: where nxd-finetune keeps its caches (``$NXD_FINETUNE_CACHE``).

Nothing here imports the registry, checkpoints or training code.
"""

from __future__ import annotations

from nxd_finetune.storage.base import Keys, Leftover, Progress, Storage, check_key
from nxd_finetune.storage.errors import (
    StorageAccessDeniedError,
    StorageBucketNotFoundError,
    StorageCredentialsError,
    StorageError,
    StorageNotFoundError,
)
from nxd_finetune.storage.local import LocalStorage
from nxd_finetune.storage.schemes import Scheme, open_storage, register_scheme

__all__ = [
    "Keys",
    "Leftover",
    "LocalStorage",
    "Progress",
    "Scheme",
    "Storage",
    "StorageAccessDeniedError",
    "StorageBucketNotFoundError",
    "StorageCredentialsError",
    "StorageError",
    "StorageNotFoundError",
    "check_key",
    "open_storage",
    "register_scheme",
]

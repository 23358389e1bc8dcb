"""Adapter registry on one storage seam (local directories and ``s3://``); see ``core`` for the contracts.

Importing this package does not import boto3; only opening an ``s3://`` URI does.
"""

from nxd_finetune.registry.core import (
    Registry,
    Version,
    list_names,
    list_versions,
    open_registry,
    pull,
    push,
    remove,
    show,
    tag,
)
from nxd_finetune.registry.errors import (
    IntegrityError,
    RegistryError,
    StorageAccessDeniedError,
    StorageBucketNotFoundError,
    StorageCredentialsError,
    StorageError,
    StorageNotFoundError,
)
from nxd_finetune.registry.ref import Ref, parse_ref
from nxd_finetune.registry.storage import LocalStorage, Storage, open_storage

__all__ = [
    "IntegrityError",
    "LocalStorage",
    "Ref",
    "Registry",
    "RegistryError",
    "Storage",
    "StorageAccessDeniedError",
    "StorageBucketNotFoundError",
    "StorageCredentialsError",
    "StorageError",
    "StorageNotFoundError",
    "Version",
    "list_names",
    "list_versions",
    "open_registry",
    "open_storage",
    "parse_ref",
    "pull",
    "push",
    "remove",
    "show",
    "tag",
]

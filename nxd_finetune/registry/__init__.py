"""Adapter registry on the storage layer (:mod:`nxd_finetune.storage`: local directories and ``s3://``); see
``core`` for the contracts.

Importing this package does not import boto3; only opening an ``s3://`` URI does.
"""

from nxd_finetune.registry.api import list_names, list_versions, pull, push, remove, show, tag
from nxd_finetune.registry.core import Registry, Version, open_registry
from nxd_finetune.registry.errors import IntegrityError, RegistryError
from nxd_finetune.registry.ref import Ref, parse_ref

__all__ = [
    "IntegrityError",
    "Ref",
    "Registry",
    "RegistryError",
    "Version",
    "list_names",
    "list_versions",
    "open_registry",
    "parse_ref",
    "pull",
    "push",
    "remove",
    "show",
    "tag",
]

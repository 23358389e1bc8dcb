"""Adapter registry on the storage layer (:mod:`nxd_finetune.storage`: local directories and ``s3://``); see
``core`` for the contracts.

Importing this package does not import boto3; only opening an ``s3://`` URI does. Nor does it import
the registry's modules or the storage layer: the names below are loaded on first use (PEP 562), so the
CLI mounts its ``adapters`` sub-app (:mod:`.cli`) without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nxd_finetune.registry.api import list_names, list_versions, pull, push, remove, show, tag
    from nxd_finetune.registry.core import Registry, Version, open_registry
    from nxd_finetune.registry.errors import IntegrityError, RegistryError
    from nxd_finetune.registry.ref import Ref, parse_ref

# exported name -> the module defining it
_EXPORTS = {
    "IntegrityError": "errors",
    "Ref": "ref",
    "Registry": "core",
    "RegistryError": "errors",
    "Version": "core",
    "list_names": "api",
    "list_versions": "api",
    "open_registry": "core",
    "parse_ref": "ref",
    "pull": "api",
    "push": "api",
    "remove": "api",
    "show": "api",
    "tag": "api",
}
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


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)

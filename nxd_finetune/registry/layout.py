"""The registry's own files besides versions: the root marker and the alias (tag) files.

The marker ``.nxd-registry.json`` at the root says "this root is an adapter registry". Every push
writes it before its manifest (a conditional create, so once; a push that fails earlier, on a full
disk say, leaves no trace); ``adapters gc`` works only on a root that has it, so gc
run on a folder above a registry, or on any other folder, deletes nothing. Registries written
before markers existed are marked by ``adapters gc ROOT --adopt`` (see :mod:`.gc`).

An alias file ``<name>/aliases/<tag>.json`` holds ``{"version": N, "manifest_sha256": ...}``; a
file that is not that (hand-edited, ``{"version": 1e999}``) is malformed: :func:`read_alias`
says so in one line, and listings report it and go on.
"""

from __future__ import annotations

import json
from typing import Any

from nxd_finetune.registry.errors import RegistryError
from nxd_finetune.registry.manifest import dumps
from nxd_finetune.registry.ref import VERSION_RE
from nxd_finetune.storage import Storage, StorageNotFoundError

MARKER = ".nxd-registry.json"
MARKER_FORMAT = "nxd-adapter-registry/1"
RETIRED = "retired"  # <name>/retired/<N>.json: removed version numbers, never reused
PUSHING = "pushing"  # <name>/pushing/<content>/.claim-<gen>.json: a push of that content is in flight
ALIASES = "aliases"  # <name>/aliases/<tag>.json


def read_alias(data: bytes) -> tuple[int, str | None]:
    """``(version, manifest_sha256)`` of an alias file's bytes; :class:`RegistryError` when they are
    not ``{"version": <int >= 1>, "manifest_sha256": <str>}`` (tags written before the sha have none;
    a float, ``1e999``, a string or a bool as the version are refused)."""
    try:
        alias: Any = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise RegistryError("not JSON") from None
    v = alias.get("version") if isinstance(alias, dict) else None
    if type(v) is not int or not VERSION_RE.fullmatch(str(v)):
        raise RegistryError(f"'version' must be an integer >= 1, got {json.dumps(v)[:40]}")
    sha = alias.get("manifest_sha256")
    if sha is not None and not isinstance(sha, str):
        raise RegistryError("'manifest_sha256' must be a string")
    return v, sha


def retired_number(stem: str) -> int | None:
    """The number a ``retired/<N>.json`` file stem names, or None for any other name."""
    return int(stem) if VERSION_RE.fullmatch(stem) else None


def is_marked(storage: Storage) -> bool:
    """Whether ``storage``'s root holds a registry marker (:class:`RegistryError` if it holds a
    file of that name that is not one)."""
    try:
        data = storage.get_bytes(MARKER)
    except StorageNotFoundError:
        return False
    try:
        ok = json.loads(data).get("format") == MARKER_FORMAT
    except (UnicodeDecodeError, ValueError, AttributeError):
        ok = False
    if not ok:
        raise RegistryError(f"{storage.uri}/{MARKER} is not an nxd-finetune registry marker")
    return True


def mark(storage: Storage) -> None:
    """Write the marker at ``storage``'s root unless one is there."""
    storage.put_bytes(MARKER, dumps({"format": MARKER_FORMAT}), if_none_match=True)

"""Turning an adapter *source* into a local adapter directory (``merge --adapter``, ``lora.init_from``).

A source is, in this order:

1. a local directory holding ``adapter_config.json`` (ours or one written by HF PEFT): used in place;
2. a registry REF ``REGISTRY/NAME[:VERSION|@TAG]`` (local or ``s3://``): pulled into a temporary
   directory with every file checked against the version's manifest (sha256, size);
3. a storage prefix holding an adapter directly (``s3://bucket/path/to/adapter``, no registry):
   its ``*.json`` / ``*.safetensors`` files are downloaded as they are (there is no manifest to
   check them against).

Only a registry source has a lineage: the REF pinned to the version that was pulled
(``s3://bucket/team/support-bot:3``); it is what a run records as its parent in the manifest.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nxd_finetune.errors import NxdError
from nxd_finetune.registry.core import open_registry
from nxd_finetune.registry.errors import RegistryError
from nxd_finetune.registry.manifest import FILE_RE, REQUIRED_FILES
from nxd_finetune.registry.ref import Ref, parse_ref
from nxd_finetune.storage import open_storage

ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class FetchedAdapter:
    """``path``: a local adapter directory; ``lineage``: the pinned REF for a registry source, else
    None; ``source``: the string it was resolved from."""

    path: Path
    lineage: str | None
    source: str


@contextmanager
def fetch_adapter(source: str, what: str = "adapter") -> Iterator[FetchedAdapter]:
    """Resolve ``source`` (see the module docstring); a downloaded copy lives until the ``with``
    block ends. ``what`` names the source in errors (``"lora.init_from"``). Raises
    :class:`RegistryError` (one line) when the source is none of the three kinds, and the
    registry's errors (IntegrityError, StorageError, ...) for a failed pull."""
    text = str(source).strip()
    local = Path(text).expanduser()
    if "://" not in text and (local / ADAPTER_CONFIG).is_file():
        yield FetchedAdapter(local, None, text)
        return
    tmp = Path(tempfile.mkdtemp(prefix="nxd-adapter-"))
    try:
        yield _download(text, what, tmp / "adapter")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _download(text: str, what: str, dest: Path) -> FetchedAdapter:
    if "://" not in text and Path(text).expanduser().is_dir() and not _is_registry_name(text):
        raise RegistryError(f"{what} {text}: not an adapter directory (no {ADAPTER_CONFIG})")
    try:
        ref = parse_ref(text)
    except RegistryError:
        raise RegistryError(f"{what} {text!r} is not an adapter directory or a REGISTRY/NAME[:VERSION|@TAG]") from None
    try:
        return _pull(ref, text, what, dest)
    except NxdError as e:
        if str(e).startswith(what):
            raise
        raise type(e)(f"{what} {text}: {e}") from None


def _is_registry_name(text: str) -> bool:
    """A local ``REGISTRY/NAME`` directory holds ``<version>/manifest.json`` entries."""
    return any(Path(text).expanduser().glob("*/manifest.json"))


def _pull(ref: Ref, text: str, what: str, dest: Path) -> FetchedAdapter:
    registry = open_registry(ref.registry)
    if ref.version is None and ref.tag is None and not registry.versions(ref.name):
        remote = "://" in text
        if remote and open_storage(text).exists(ADAPTER_CONFIG):
            return _download_plain(text, dest)
        if not remote and not Path(text).expanduser().exists():
            problem = "no such directory"
        else:
            problem = f"not an adapter directory (no {ADAPTER_CONFIG})"
        raise RegistryError(f"{what} {text}: {problem}, and no adapter {ref.name!r} in registry {registry.uri}")
    found = registry.pull(ref.name, dest, ref.version, ref.tag)
    return FetchedAdapter(dest, found.ref, text)


def _download_plain(uri: str, dest: Path) -> FetchedAdapter:
    """An adapter stored as plain files under a prefix (not a registry version)."""
    storage = open_storage(uri)
    names = [k for k in storage.list("") if "/" not in k and FILE_RE.fullmatch(k) and ".." not in k]
    missing = [f for f in REQUIRED_FILES if f not in names]
    if missing:
        raise RegistryError(f"{uri} is not an adapter directory: missing {', '.join(missing)}")
    dest.mkdir(parents=True)
    for name in names:
        storage.get_file(name, dest / name)
    return FetchedAdapter(dest, None, uri)

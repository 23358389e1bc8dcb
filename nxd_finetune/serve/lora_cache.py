"""Registry adapters by name, pulled once into a local cache: what the vLLM resolver serves.

A *selector* is ``NAME``, ``NAME:VERSION`` or ``NAME@TAG`` (a registry REF without its registry;
a bare NAME is the latest version). :meth:`AdapterCache.fetch` looks NAME up in an ordered list of
registries (local directories or ``s3://`` prefixes); the first registry that holds NAME answers.
The version it names is pulled with :meth:`~nxd_finetune.registry.Registry.pull`, which checks every
file's size and sha256 against the version's manifest, into ::

    <cache>/<registry key>/<NAME>/<VERSION>-<content key>/

The registry key hashes the registry URI; the content key hashes the manifest's file table, so a
version removed and pushed again under the same number never reuses a stale copy. A cached copy
is checked against the manifest again before it is used (and pulled again if it differs); copies
appear by rename, so servers sharing a cache see a whole copy or none.

When the adapter records the hash of its base model's config (``run`` writes one) and the served
base is a local directory, the two must match: an adapter trained on another base is refused
before vLLM loads it.

Configuration from the environment (:meth:`AdapterCache.from_env`):

- ``NXD_FINETUNE_LORA_REGISTRY``: one registry URI, or several separated by commas, searched in order;
- ``NXD_FINETUNE_LORA_CACHE``: the cache directory (default ``<nxd-finetune cache>/lora-cache``,
  i.e. under ``$NXD_FINETUNE_CACHE`` or ``~/.cache/nxd-finetune``).

Nothing here imports vLLM; :mod:`nxd_finetune.serve.vllm_resolver` adapts it to vLLM's interface.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nxd_finetune.registry.core import Registry, open_registry
from nxd_finetune.registry.errors import IntegrityError, RegistryError
from nxd_finetune.registry.manifest import MANIFEST, sha256_file
from nxd_finetune.registry.ref import parse_ref

ENV_REGISTRY = "NXD_FINETUNE_LORA_REGISTRY"
ENV_CACHE = "NXD_FINETUNE_LORA_CACHE"


@dataclass(frozen=True)
class Selector:
    """A parsed selector: ``version`` or ``tag`` (at most one), neither for the latest."""

    name: str
    version: int | None = None
    tag: str | None = None


@dataclass(frozen=True)
class CachedAdapter:
    """A verified local copy: ``path`` (a PEFT adapter directory) of the version ``ref`` pins."""

    path: Path
    ref: str
    name: str
    version: int


def parse_selector(text: str) -> Selector | None:
    """``NAME[:VERSION|@TAG]`` -> :class:`Selector`; None when ``text`` is not one (a path, a
    hub id with ``/``, a malformed name): such requests are for other resolvers."""
    if not text or "/" in text or "\\" in text:
        return None
    try:
        ref = parse_ref(f"_/{text}")
    except RegistryError:
        return None
    return Selector(ref.name, ref.version, ref.tag)


class AdapterCache:
    """Resolves selectors against ``registries`` (searched in order) into verified copies under ``cache_dir``."""

    def __init__(self, registries: Sequence[str], cache_dir: str | os.PathLike):
        if not registries:
            raise RegistryError(f"no adapter registry given (set {ENV_REGISTRY})")
        self.registries = [str(r).strip() for r in registries]
        self.cache_dir = Path(cache_dir).expanduser().absolute()
        self._opened: dict[str, Registry] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AdapterCache | None:
        """The cache ``NXD_FINETUNE_LORA_REGISTRY`` / ``NXD_FINETUNE_LORA_CACHE`` describe; None when
        no registry is set."""
        registries = [r.strip() for r in environ.get(ENV_REGISTRY, "").split(",") if r.strip()]
        if not registries:
            return None
        from nxd_finetune.storage.cache import cache_home

        given = environ.get(ENV_CACHE)
        cache = Path(given) if given else cache_home(environ.get("NXD_FINETUNE_CACHE") or None) / "lora-cache"
        return cls(registries, cache)

    def _registry(self, uri: str) -> Registry:
        if uri not in self._opened:
            self._opened[uri] = open_registry(uri)
        return self._opened[uri]

    def fetch(self, selector: str, base_model: str | None = None) -> CachedAdapter | None:
        """The verified local copy of the version ``selector`` names.

        Returns None when ``selector`` is not a selector or no registry holds its NAME. Raises
        :class:`IntegrityError` when a stored file does not match the manifest (nothing is cached),
        :class:`RegistryError` for an unknown version or tag, or when ``base_model`` (a local model
        directory) is not the base the adapter was trained on, and
        :class:`~nxd_finetune.registry.StorageError` when a registry cannot be read.
        """
        sel = parse_selector(selector)
        if sel is None:
            return None
        for uri in self.registries:
            registry = self._registry(uri)
            if not registry.versions(sel.name):
                continue
            found = registry.show(sel.name, sel.version, sel.tag)
            path = self._cached_copy(registry, found.name, found.version, found.manifest)
            if base_model is not None:
                check_base(path, base_model, found.ref)
            return CachedAdapter(path, found.ref, found.name, found.version)
        return None

    def _cached_copy(self, registry: Registry, name: str, version: int, manifest: dict) -> Path:
        files = manifest["files"]
        content_key = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
        registry_key = hashlib.sha256(registry.uri.encode()).hexdigest()[:16]
        dest = self.cache_dir / registry_key / name / f"{version}-{content_key}"
        if dest.is_dir():
            if _matches(dest, files):
                return dest
            shutil.rmtree(dest, ignore_errors=True)  # altered on disk: pull it again
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}"
        registry.pull(name, tmp, version)  # checks every sha256; leaves nothing behind on failure
        pulled = json.loads((tmp / MANIFEST).read_text())["files"]
        if pulled != files:  # the version was removed and pushed again between show and pull
            shutil.rmtree(tmp, ignore_errors=True)
            raise IntegrityError(f"{registry.uri}/{name}:{version} changed while it was pulled; try again")
        try:
            os.rename(tmp, dest)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
            if not _matches(dest, files):
                raise
        return dest


def _matches(path: Path, files: Mapping[str, Mapping]) -> bool:
    """Every manifest file is in ``path`` with its size and sha256."""
    for fname, entry in files.items():
        local = path / fname
        if not local.is_file() or local.stat().st_size != entry["size"] or sha256_file(local) != entry["sha256"]:
            return False
    return True


def check_base(adapter_dir: Path, base_model: str, ref: str) -> None:
    """Raise :class:`RegistryError` when the adapter records a base-config hash and ``base_model``,
    a local model directory of a supported architecture, has another one. Bases that are not local
    directories (hub ids) or not of a supported architecture are not checked: vLLM checks shapes."""
    from nxd_finetune.errors import ModelLoadError
    from nxd_finetune.lora.identity import base_mismatches
    from nxd_finetune.models.config import DecoderConfig

    if not (Path(base_model) / "config.json").is_file():
        return
    try:
        config = DecoderConfig.from_hf(base_model)
    except ModelLoadError:
        return
    problems = base_mismatches(adapter_dir, config)
    if problems:
        raise RegistryError(f"{ref} does not fit the served base {base_model}: {'; '.join(problems)}")

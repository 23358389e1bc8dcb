"""Registry adapters by name, pulled into a local cache: what the vLLM resolver serves.

A *selector* is ``NAME``, ``NAME:VERSION`` or ``NAME@TAG`` (a registry REF without its registry;
a bare NAME is the latest version). :meth:`AdapterCache.fetch` looks NAME up in an ordered list of
registries (local directories or ``s3://`` prefixes); the first registry that holds NAME answers.
The version it names is pulled with :meth:`~nxd_finetune.registry.Registry.pull`, which checks every
file's size and sha256 against the version's manifest, into ::

    <cache>/<registry key>/<NAME>/<VERSION>-<content key>/

The registry key hashes the registry URI; the content key hashes the manifest's file table, so a
version removed and pushed again under the same number never reuses a stale copy. A copy appears
whole, by rename (servers sharing a cache see a whole copy or none), with read-only files, and is
never removed or changed afterwards: a server may read it again at any time (vLLM keeps only the
path). A copy found missing or altered is not repaired in place: the version is pulled again, into
the same path if it is gone, else into the next free ``<VERSION>-<content key>.<N>``.

Every use checks the files: :meth:`AdapterCache.fetch` before handing a copy out, and
:meth:`AdapterCache.ensure` before a server reads a path it was handed earlier (it answers the path
of a verified copy of the same content, pulling the version again when no copy is left).

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
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.lora.identity import base_mismatches
from nxd_finetune.models.config import DecoderConfig
from nxd_finetune.registry.core import Registry, open_registry
from nxd_finetune.registry.errors import IntegrityError, RegistryError
from nxd_finetune.registry.manifest import MANIFEST, sha256_file
from nxd_finetune.registry.ref import parse_ref
from nxd_finetune.storage.atomic import publish_dir
from nxd_finetune.storage.cache import cache_home

ENV_REGISTRY = "NXD_FINETUNE_LORA_REGISTRY"
ENV_CACHE = "NXD_FINETUNE_LORA_CACHE"
MAX_COPIES = 100
"""Copies of one version kept side by side at most (each replaces a missing or altered one)."""

# vLLM configures the "vllm" logger (handlers, format, VLLM_LOGGING_LEVEL); the resolver logs here too
logger = logging.getLogger("vllm.plugins.nxd_finetune")
_COPY_RE = re.compile(r"(?P<version>[1-9][0-9]*)-(?P<key>[0-9a-f]{16})(?:\.(?P<n>[1-9][0-9]*))?")


class WrongBaseError(RegistryError):
    """The adapter was trained on another base than the one served."""


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


def read_selector(text: str) -> Selector:
    """``NAME[:VERSION|@TAG]`` -> :class:`Selector`; raises :class:`RegistryError` saying why ``text``
    is not one (a path, a hub id with ``/``, a malformed name, version or tag)."""
    if not text or "/" in text or "\\" in text:
        raise RegistryError(f"{text!r} is not a registry adapter name: expected NAME, NAME:VERSION or NAME@TAG")
    try:
        ref = parse_ref(f"_/{text}")
    except RegistryError as e:
        raise RegistryError(str(e).replace(f" in REF {f'_/{text}'.strip()!r}", "")) from None
    return Selector(ref.name, ref.version, ref.tag)


def parse_selector(text: str) -> Selector | None:
    """:func:`read_selector`, or None when ``text`` is not a selector: such requests are for other resolvers."""
    try:
        return read_selector(text)
    except RegistryError:
        return None


class AdapterCache:
    """Resolves selectors against ``registries`` (searched in order) into verified copies under ``cache_dir``."""

    def __init__(self, registries: Sequence[str], cache_dir: str | os.PathLike):
        if not registries:
            raise RegistryError(f"no adapter registry given (set {ENV_REGISTRY})")
        self.registries = [str(r).strip() for r in registries]
        self.cache_dir = Path(cache_dir).expanduser().absolute()
        self._opened: dict[str, Registry] = {}
        self._moved: dict[Path, Path] = {}  # a path handed out -> the copy that replaced it

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AdapterCache | None:
        """The cache ``NXD_FINETUNE_LORA_REGISTRY`` / ``NXD_FINETUNE_LORA_CACHE`` describe; None when
        no registry is set."""
        registries = [r.strip() for r in environ.get(ENV_REGISTRY, "").split(",") if r.strip()]
        if not registries:
            return None
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
        :class:`RegistryError` for an unknown version or tag, :class:`WrongBaseError` when
        ``base_model`` (a local model directory) is not the base the adapter was trained on, and
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
            path = self._copy(registry, found.name, found.version, found.manifest["files"])
            if base_model is not None:
                check_base(path, base_model, found.ref)
            return CachedAdapter(path, found.ref, found.name, found.version)
        return None

    def holds(self, path: str | os.PathLike) -> bool:
        """``path`` is the path of a copy in this cache (whatever its state)."""
        return _copy_location(self.cache_dir, Path(path).absolute()) is not None

    def ensure(self, path: str | os.PathLike) -> Path:
        """The path of a verified copy with the content of ``path``, a copy :meth:`fetch` handed out
        earlier (perhaps to another process): ``path`` itself while its files match, else the copy
        that replaced it, pulled again from its registry if none is left (the cache removed by hand,
        a file altered). Paths outside the cache are returned as they are. Raises
        :class:`IntegrityError` when no registry of this cache can give that content again (the
        version removed or published again with other files), and what :meth:`fetch` raises.
        """
        path = Path(path).absolute()
        where = _copy_location(self.cache_dir, path)
        if where is None:
            return path
        registry_key, name, version, key = where
        for candidate in (self._moved.get(path), path):
            if candidate is not None and _verified(candidate, key):
                return candidate
        registry = next((r for r in map(self._registry, self.registries) if _registry_key(r) == registry_key), None)
        if registry is None:
            raise IntegrityError(f"{path} is missing or altered, and came from a registry this cache is not given")
        files = registry.show(name, version).manifest["files"]
        if _content_key(files) != key:
            raise IntegrityError(f"{path} is missing or altered, and {registry.uri.rstrip('/')}/{name}:{version} "
                                 "now holds other files")
        found = self._copy(registry, name, version, files)
        logger.warning("nxd-finetune registry: the cached copy %s is missing or altered; using %s", path, found)
        self._moved[path] = found
        return found

    def _copy(self, registry: Registry, name: str, version: int, files: Mapping[str, Mapping]) -> Path:
        """The first verified copy of ``name:version`` with ``files``, pulling one into the first
        free path when none verifies. Nothing is ever removed: a server may read any copy again."""
        key = _content_key(files)
        parent = self.cache_dir / _registry_key(registry) / name
        for n in range(MAX_COPIES):
            dest = parent / (f"{version}-{key}" + (f".{n}" if n else ""))
            if os.path.lexists(dest):
                if _verified(dest, key):
                    return dest
                logger.warning("nxd-finetune registry: the cached copy %s is altered; it is left as it is", dest)
                continue
            if self._pull(registry, name, version, files, dest):
                return dest
        raise IntegrityError(f"{parent}: no verified copy of {name}:{version} among {MAX_COPIES}; "
                             "clear the cache (see docs/serving.md)")

    @staticmethod
    def _pull(registry: Registry, name: str, version: int, files: Mapping[str, Mapping], dest: Path) -> bool:
        """Pull into a hidden temp dir, make its files read-only and publish it as ``dest``
        (:func:`~nxd_finetune.storage.atomic.publish_dir`). False when another process published
        ``dest`` first with content that does not verify."""
        key = _content_key(files)
        try:
            with publish_dir(dest, already_published=lambda d: _verified(d, key)) as tmp:
                registry.pull(name, tmp, version)  # checks every sha256; leaves nothing behind on failure
                if json.loads((tmp / MANIFEST).read_text())["files"] != files:
                    # the version was removed and pushed again between show and pull
                    raise IntegrityError(f"{registry.uri.rstrip('/')}/{name}:{version} changed while it was "
                                         "pulled; try again")
                for f in tmp.iterdir():
                    f.chmod(0o444)
        except OSError:
            if dest.is_dir() and any(dest.iterdir()):
                return False  # another process published it first, and its copy does not verify
            raise
        return True


def _content_key(files: Mapping[str, Mapping]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def _registry_key(registry: Registry) -> str:
    return hashlib.sha256(registry.uri.encode()).hexdigest()[:16]


def _copy_location(cache_dir: Path, path: Path) -> tuple[str, str, int, str] | None:
    """``(registry key, NAME, VERSION, content key)`` of a copy's path under ``cache_dir``, else None."""
    try:
        parts = path.relative_to(cache_dir).parts
    except ValueError:
        return None
    if len(parts) != 3 or not (m := _COPY_RE.fullmatch(parts[2])):
        return None
    return parts[0], parts[1], int(m["version"]), m["key"]


def _verified(path: Path, key: str) -> bool:
    """``path`` is a copy whose own manifest has the content key ``key`` and whose every file has
    the size and sha256 that manifest gives."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        return _content_key(files) == key and all(
            (path / fname).is_file() and (path / fname).stat().st_size == entry["size"]
            and sha256_file(path / fname) == entry["sha256"]
            for fname, entry in files.items()
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return False


def check_base(adapter_dir: Path, base_model: str, ref: str) -> None:
    """Raise :class:`WrongBaseError` when the adapter records a base-config hash and ``base_model``,
    a local model directory of a supported architecture, has another one. Bases that are not local
    directories (hub ids) or not of a supported architecture are not checked: vLLM checks shapes."""
    if not (Path(base_model) / "config.json").is_file():
        return
    try:
        config = DecoderConfig.from_hf(base_model)
    except ModelLoadError:
        return
    problems = base_mismatches(adapter_dir, config)
    if problems:
        raise WrongBaseError(f"{ref} does not fit the served base {base_model}: {'; '.join(problems)}")

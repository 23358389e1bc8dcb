"""The registry by REF (``REGISTRY/NAME[:VERSION|@TAG]``): one call per command, each opening the
registry the REF names (:func:`~nxd_finetune.registry.core.open_registry`) and delegating to its
:class:`~nxd_finetune.registry.core.Registry`."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from nxd_finetune.registry.core import PushProgress, Version, open_registry
from nxd_finetune.registry.errors import RegistryError
from nxd_finetune.registry.ref import parse_ref


def push(
    src: str | os.PathLike,
    ref: str,
    tags: Iterable[str] = (),
    metadata: Mapping[str, object] | None = None,
    progress: PushProgress | None = None,
) -> Version:
    """Push ``src`` to ``REGISTRY/NAME`` (a version or tag in ``ref`` is refused: use ``tags``)."""
    r = parse_ref(ref)
    if r.version is not None or r.tag is not None:
        raise RegistryError(f"push takes REGISTRY/NAME without :VERSION/@TAG (got {ref!r}); tag with --tag")
    return open_registry(r.registry).push(src, r.name, tags, metadata, progress)


def pull(ref: str, dest: str | os.PathLike) -> Version:
    """Pull ``REGISTRY/NAME[:VERSION|@TAG]`` into ``dest``; see :meth:`Registry.pull`."""
    r = parse_ref(ref)
    return open_registry(r.registry).pull(r.name, dest, r.version, r.tag)


def show(ref: str) -> Version:
    """The version ``ref`` names, with manifest and tags."""
    r = parse_ref(ref)
    return open_registry(r.registry).show(r.name, r.version, r.tag)


def remove(ref: str) -> Version:
    """Remove the version ``ref`` names (needs ``:VERSION`` or ``@TAG``)."""
    r = parse_ref(ref)
    return open_registry(r.registry).remove(r.name, r.version, r.tag)


def tag(ref: str, new_tag: str) -> Version:
    """Point ``new_tag`` at the version ``ref`` names."""
    r = parse_ref(ref)
    return open_registry(r.registry).tag(r.name, new_tag, r.version, r.tag)


def list_names(registry: str | os.PathLike) -> list[str]:
    """Adapter names with at least one version in ``registry``."""
    return open_registry(registry).list_names()


def list_versions(registry: str | os.PathLike, name: str) -> list[Version]:
    """All versions of ``name`` in ``registry``, ascending."""
    return open_registry(registry).list_versions(name)

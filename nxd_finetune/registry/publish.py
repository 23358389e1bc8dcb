"""Publishing the adapter a training run produced (``output.registry``).

``output.registry`` is ``REGISTRY/NAME`` (``s3://bucket/prefix/NAME``, ``./registry/NAME``): at the
end of a LoRA run the final adapter is pushed as the next version of NAME, with the run's recipe,
metrics, parallel layout, base model and lineage (the registry REF it started from) in the
manifest. Only adapters are published: ``checkpoint.save_mode: merged`` and full SFT have none,
and :func:`check_publish_target` refuses them before training starts.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nxd_finetune.registry.api import push
from nxd_finetune.registry.core import Version
from nxd_finetune.registry.errors import RegistryError
from nxd_finetune.registry.manifest import (
    ALLOWED_FILES,
    FILE_RE,
    MANIFEST,
    check_links,
)
from nxd_finetune.registry.ref import parse_ref

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"


def check_publish_target(registry_ref: str, save_mode: str | None) -> None:
    """Fail early (before training) when ``output.registry`` cannot be honoured: a malformed REF,
    a REF naming a version or tag, or a run that writes no adapter (``save_mode`` None = full SFT,
    or ``merged``). Raises :class:`RegistryError` with one line."""
    ref = parse_ref(registry_ref)
    if ref.version is not None or ref.tag is not None:
        raise RegistryError(f"output.registry {registry_ref!r} must be REGISTRY/NAME, without :VERSION or @TAG")
    if save_mode is None:
        raise RegistryError("output.registry is set, but a full SFT run writes no adapter to publish; unset it")
    if save_mode == "merged":
        raise RegistryError(
            "output.registry is set, but checkpoint.save_mode=merged writes no adapter; "
            "use save_mode adapter or base_and_adapter"
        )


def _adapter_dir(final_dir: Path) -> Path:
    for candidate in (final_dir, final_dir / "adapter"):  # save modes adapter / base_and_adapter
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise RegistryError(f"{final_dir} holds no adapter to publish (no {ADAPTER_CONFIG}, nor in adapter/)")


def _json_safe(value: Any) -> Any:
    """Metadata as strict JSON: NaN/inf (a diverged loss) become null, paths and other objects strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


def publish_run(
    final_dir: str | os.PathLike,
    registry_ref: str,
    *,
    recipe_dict: Mapping[str, object] | None,
    metrics: Mapping[str, object] | None,
    parallel: Mapping[str, object] | None,
    lineage: str | None,
    base_model: Mapping[str, object] | None = None,
) -> Version:
    """Push the adapter of a finished run to ``registry_ref`` (``REGISTRY/NAME``); return the version.

    ``final_dir``: the run's final output: an adapter directory (save mode ``adapter``) or one with
    ``adapter/`` (``base_and_adapter``). Files the registry does not accept
    (:data:`~nxd_finetune.registry.manifest.ALLOWED_FILES`) are left out, with a warning; the adapter files
    themselves are pushed byte for byte. Manifest: ``recipe`` = ``recipe_dict``, ``metrics``,
    ``parallel``, ``lineage`` (the REF the run started from, or None) and ``base_model`` (caller keys
    over what the adapter records, :func:`~nxd_finetune.registry.manifest.adapter_base`).
    Non-finite floats in the metadata are stored as null.
    Raises :class:`RegistryError` (and the storage errors) with one line.
    """
    src = _adapter_dir(Path(final_dir))
    base = dict(base_model or {})
    metadata = _json_safe(
        {"recipe": recipe_dict, "metrics": metrics, "parallel": parallel, "lineage": lineage, "base_model": base}
    )
    check_links(src)  # before the copy below follows them
    files = sorted(p for p in src.iterdir() if p.name != MANIFEST)
    skipped = [p.name for p in files if p.is_dir() or not FILE_RE.fullmatch(p.name) or ".." in p.name]
    if not skipped:
        return push(src, registry_ref, metadata=metadata)
    log.warning("warning: not published (the registry keeps %s): %s", ALLOWED_FILES, ", ".join(skipped))
    with tempfile.TemporaryDirectory(prefix="nxd-publish-") as tmp:
        for p in files:
            if p.name not in skipped:
                shutil.copyfile(p, Path(tmp) / p.name)
        return push(tmp, registry_ref, metadata=metadata)

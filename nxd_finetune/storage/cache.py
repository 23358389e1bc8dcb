"""Where nxd-finetune keeps its caches: one root, ``$NXD_FINETUNE_CACHE`` (default
``~/.cache/nxd-finetune``), with ``models/`` (the built-in quickstart model) and ``data/``
(tokenized datasets, unless the recipe sets ``data.cache_dir``) under it.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "NXD_FINETUNE_CACHE"


def cache_home(override: str | os.PathLike | None = None) -> Path:
    """nxd-finetune's cache: ``override`` if given, else ``$NXD_FINETUNE_CACHE``, else
    ``~/.cache/nxd-finetune``."""
    if override is not None:
        return Path(override)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "nxd-finetune"


def models_cache(override: str | os.PathLike | None = None) -> Path:
    """Built models (``<cache>/models``)."""
    return cache_home(override) / "models"


def data_cache(override: str | os.PathLike | None = None) -> Path:
    """Tokenized datasets (``<cache>/data``) when the recipe sets no ``data.cache_dir``."""
    return cache_home(override) / "data"

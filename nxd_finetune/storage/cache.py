"""Where nxd-finetune keeps its caches: one root, ``$NXD_FINETUNE_CACHE`` (default
``~/.cache/nxd-finetune``), with ``models/`` (the built-in quickstart model) and ``data/``
(tokenized datasets, unless the recipe sets ``data.cache_dir``) under it, and ``staging/``
(files on their way to remote storage: :meth:`nxd_finetune.storage.Storage.staged`).
"""

from __future__ import annotations

import os
import socket
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


def staging_dir(override: str | os.PathLike | None = None) -> Path:
    """Files being written before an upload (``<cache>/staging/<host>``), created if absent."""
    path = cache_home(override) / "staging" / socket.gethostname()
    path.mkdir(parents=True, exist_ok=True)
    return path


def sweep_staging(directory: Path) -> list[Path]:
    """Remove the staged files of processes that no longer run (named ``<pid>-...``); return them."""
    removed = []
    for p in directory.iterdir():
        pid = p.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (ours or another user's)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        p.unlink(missing_ok=True)
        removed.append(p)
    return removed

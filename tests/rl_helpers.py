"""Helpers of the GRPO tests."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def grpo_trainer() -> type:
    """TRL's ``GRPOTrainer``, imported with ``tests/`` off ``sys.path``: pytest puts it there (the
    tests are no package), where ``tests/vllm`` would pass for vLLM in TRL's ``is_vllm_available``
    (a version of 'N/A', which fails its import)."""
    removed = [p for p in sys.path if p and Path(p).resolve() == TESTS]
    for p in removed:
        sys.path.remove(p)
    try:
        from trl.trainer.grpo_trainer import GRPOTrainer
    finally:
        sys.path[:0] = removed
    return GRPOTrainer

"""Learning-rate schedules: linear warmup, then cosine | linear | constant decay."""

from __future__ import annotations

import math


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str, min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak LR for optimizer step ``step`` (0-based).

    Warmup rises linearly to 1 over ``warmup_steps`` (step 0 already gets 1/warmup), then decays
    to ``min_lr_ratio`` at ``total_steps`` (cosine or linear) or stays at 1 (constant).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif kind == "linear":
        decay = 1.0 - progress
    else:
        raise ValueError(f"unknown scheduler {kind!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay

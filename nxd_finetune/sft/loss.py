"""Causal-LM loss on HF-style labels (aligned with input_ids, -100 = ignored)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets for each position: labels[:, 1:] with -100 appended, shape [B, T]."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of ``logits`` [B, T, V] against ``labels`` [B, T] shifted by one.

    ``reduction``: ``mean`` over non-ignored targets, ``sum``, or ``none`` (per-token [B, T], 0 where
    ignored). Computed in fp32 whatever the logits dtype.
    """
    targets = shift_labels(labels)
    per_token = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none",
    ).view_as(targets)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (targets != IGNORE_INDEX).sum().clamp(min=1)

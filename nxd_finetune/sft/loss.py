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


def target_index(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into the B*T positions that predict a target, and those targets ([N] each)."""
    targets = shift_labels(labels).reshape(-1)
    index = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    return index, targets.index_select(0, index)


def causal_lm_loss_at_targets(model, batch: dict[str, torch.Tensor], reduction: str = "sum") -> torch.Tensor:
    """``causal_lm_loss(model(...), labels, reduction)`` (``sum`` or ``mean``) with logits computed
    only where a target is predicted: ``model`` must take ``logits_index`` (DecoderForCausalLM).

    In SFT most positions are prompt or padding (label -100), and the vocabulary projection is the
    widest matmul of a small model; its fp32 logits and softmax ([positions, V] each, kept for
    backward) are often the peak of activation memory. Same loss up to summation order.
    """
    index, targets = target_index(batch["labels"])
    logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"), logits_index=index)
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    return loss if reduction == "sum" else loss / max(1, targets.numel())

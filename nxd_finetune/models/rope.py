"""Rotary position embeddings: inverse frequencies per rope type, cos/sin tables, and their
application in HF's rotate-half layout."""

from __future__ import annotations

import math

import torch

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.models.config import DecoderConfig


def rope_inv_freq(config: DecoderConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for ``default``, ``linear`` and ``llama3`` RoPE."""
    dim = config.head_dim
    assert dim is not None  # DecoderConfig.__post_init__ derives it
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")


def rotary_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, T, head_dim] computed in fp32 (HF's rotate-half layout)."""
    freqs = position_ids[:, :, None].float() * inv_freq[None, None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, T, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def _rotary_tokens_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` for x laid out ``[B, T, heads, D]`` (the projection's own layout, so the
    result is contiguous in it and per-sample attention can split it along tokens without copies).
    ``rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2)``: the sign goes on the small sin."""
    half = x.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    x1, x2 = x.split(half, dim=-1)
    return torch.addcmul(x * cos[:, :, None], torch.cat((x2, x1), dim=-1), sin[:, :, None])


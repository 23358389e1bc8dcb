"""Rotary position embeddings: inverse frequencies per rope type, cos/sin tables, and their
application in HF's rotate-half layout."""

from __future__ import annotations

import math

import torch

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.models.config import DecoderConfig


def _kind(config: DecoderConfig) -> str:
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def _longrope_original(config: DecoderConfig) -> int:
    scaling = config.rope_scaling or {}
    original = scaling.get("original_max_position_embeddings") or config.original_max_position_embeddings
    if not original:
        raise ModelLoadError("longrope needs original_max_position_embeddings in config.json")
    return int(original)


def _longrope_attention_factor(config: DecoderConfig) -> float:
    """HF's: ``attention_factor``, else ``sqrt(1 + log(factor) / log(original))`` (1 when factor <= 1)."""
    scaling = config.rope_scaling or {}
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = _longrope_original(config)
    factor = scaling.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_inv_freq(config: DecoderConfig, device: torch.device | None = None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [rotary_dim/2] for ``default``, ``linear``, ``llama3`` and ``longrope`` RoPE
    (rotary_dim: ``head_dim * partial_rotary_factor``; ``long``: longrope's long factors)."""
    assert config.head_dim is not None  # DecoderConfig.__post_init__ derives it
    dim = int(config.head_dim * config.partial_rotary_factor)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv = 1.0 / (config.rope_theta ** exponent)
    scaling = config.rope_scaling
    if not scaling:
        return inv
    kind = _kind(config)
    if kind == "default":
        return inv
    if kind == "longrope":  # Phi-3 long-context checkpoints: per-frequency factors, as HF computes them
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (factors * config.rope_theta ** exponent)
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
    raise ModelLoadError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3, longrope)")


def rotary_cos_sin(
    inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, T, rotary_dim] computed in fp32 (HF's rotate-half layout), times ``scale``."""
    freqs = position_ids[:, :, None].float() * inv_freq[None, None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTables:
    """cos/sin for given positions under a config's rope, the inverse frequencies cached per device.
    ``longrope`` takes its long factors when a batch reaches past ``original_max_position_embeddings``
    (HF's rule: the largest position + 1; read on the host) and scales cos/sin by its attention factor."""

    def __init__(self, config: DecoderConfig) -> None:
        self.config = config
        longrope = _kind(config) == "longrope"
        self.long_after = _longrope_original(config) if longrope else None
        self.scale = _longrope_attention_factor(config) if longrope else 1.0
        self._inv_freq: dict[tuple[torch.device, bool], torch.Tensor] = {}

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        long = self.long_after is not None and int(position_ids.max()) + 1 > self.long_after
        key = (position_ids.device, long)
        if key not in self._inv_freq:
            self._inv_freq[key] = rope_inv_freq(self.config, position_ids.device, long)
        return rotary_cos_sin(self._inv_freq[key], position_ids, dtype, self.scale)


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
    ``rotate_half(x) * sin == cat(x2, x1) * cat(-sin1, sin2)``: the sign goes on the small sin.
    cos/sin narrower than the head (partial rotary): only the head's first dimensions turn."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((_rotary_tokens_first(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    x1, x2 = x.split(half, dim=-1)
    return torch.addcmul(x * cos[:, :, None], torch.cat((x2, x1), dim=-1), sin[:, :, None])


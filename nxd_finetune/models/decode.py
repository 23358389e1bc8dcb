"""Incremental decoding on :class:`~nxd_finetune.models.llama.DecoderForCausalLM`: a KV cache.

:func:`decode` runs the decoder on the next ``t`` tokens of each row, reading the keys and values of
the earlier ones from a :class:`KVCache` and appending their own. The layer's own parts compute
it (input norm, projections, per-head norms, rope: :meth:`Attention.qkv`; ``o_proj``, residuals,
norms and MLP or experts after attention), so every family's variant is the training model's; only
the attention core differs, reading the cache under a mask built from the cache's slots:

- rows are left-padded (or hold padding anywhere): a slot whose token is padding is never a key;
  a row's positions count its real tokens (HF's ``cumsum(attention_mask) - 1``);
- a sliding window (Mistral, Gemma 2/3 sliding layers) keeps keys whose position is less than the
  window behind the query's, as the full forward's mask does;
- soft-capped scores (Gemma 2) go through the same capped softmax as the full forward.

The cache holds every slot (a sliding layer's too): it is sized for the prompt and completion at
once. This module imports nothing from ``parallel``; under tensor parallel a rank's layers hold its
share of the heads and its cache those heads' keys and values.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import torch
import torch.nn.functional as F

from nxd_finetune.errors import NxdError
from nxd_finetune.models.attention import _softcapped
from nxd_finetune.models.llama import DecoderForCausalLM, DecoderLayer, _layer_after, _layer_before


@dataclasses.dataclass
class KVCache:
    """Keys and values of the tokens decoded so far, per layer name (``[B, S, kv_heads, head_dim]``,
    ``S`` the capacity), with each slot's ``valid`` flag (``[B, S]``: a real token, not padding) and
    position (``[B, S]``). ``length``: slots filled."""

    keys: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]
    valid: torch.Tensor
    positions: torch.Tensor
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def fill_from(self, other: KVCache, rows: torch.Tensor) -> None:
        """This (empty) cache holds row ``rows[i]`` of ``other`` as its row ``i``."""
        self.keys = {name: k.index_select(0, rows) for name, k in other.keys.items()}
        self.values = {name: v.index_select(0, rows) for name, v in other.values.items()}
        self.valid = other.valid.index_select(0, rows)
        self.positions = other.positions.index_select(0, rows)
        self.length = other.length

    def seen(self) -> torch.Tensor:
        """Real tokens per row so far ``[B]`` (the next real token's position)."""
        return self.valid[:, : self.length].sum(dim=1)


def new_cache(batch: int, capacity: int, device: torch.device) -> KVCache:
    """An empty cache for ``batch`` rows of up to ``capacity`` tokens; each layer's keys and values
    are allocated at its first :func:`decode` (this rank's heads, the dtype attention takes)."""
    return KVCache({}, {}, torch.zeros(batch, capacity, dtype=torch.bool, device=device),
                   torch.zeros(batch, capacity, dtype=torch.long, device=device))


def decode(model: DecoderForCausalLM, ids: torch.Tensor, valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits ``[B, t, V]`` of the next ``t`` tokens of each row (``ids``, ``valid [B, t]``: False
    at padding), given the earlier ones in ``cache``, which then holds these too. A padding slot's
    logits are not meaningful (it attends to itself only); nothing attends to it."""
    return model.head(decode_hidden(model, ids, valid, cache))


def decode_hidden(model: DecoderForCausalLM, ids: torch.Tensor, valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """:func:`decode`'s final (normed) hidden states ``[B, t, H]``, before the output layer. Under
    autograd the gradients reach every earlier token's keys and values through the cache."""
    b, t = ids.shape
    start = cache.length
    if start + t > cache.capacity:
        raise NxdError(f"the KV cache holds {cache.capacity} tokens; decoding {t} more after {start} overflows it")
    valid = valid.to(torch.bool)
    positions = cache.seen()[:, None] + valid.long().cumsum(dim=1) - 1
    positions = positions.masked_fill(~valid, 0)
    cache.valid[:, start:start + t] = valid
    cache.positions[:, start:start + t] = positions
    cache.length = start + t
    inner = model.model
    if inner.embed_tokens is None or inner.norm is None or model.lm_head is None:
        raise NxdError("decoding with a KV cache needs the whole model; this one is a pipeline stage")
    x = inner.embed_tokens(ids)
    if model.config.embed_scale:  # as DecoderModel.forward
        x = x * torch.tensor(model.config.hidden_size ** 0.5, dtype=x.dtype)
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    masks: dict[int | None, torch.Tensor] = {}
    for name, module in inner.layers.items():
        layer = cast(DecoderLayer, module)
        kind = "sliding_attention" if layer.layer_type == "sliding_attention" else "full_attention"
        if kind not in tables:
            tables[kind] = inner.ropes[kind](positions, x.dtype)
        window = layer.self_attn.sliding_window
        if window not in masks:
            masks[window] = _cache_mask(cache, start, t, window)
        q, k, v = _layer_before(layer, x, *tables[kind])
        if name not in cache.keys:
            cache.keys[name] = k.new_zeros(b, cache.capacity, *k.shape[2:])
            cache.values[name] = v.new_zeros(b, cache.capacity, *v.shape[2:])
        cache.keys[name][:, start:start + t] = k
        cache.values[name][:, start:start + t] = v
        attention = _cached_attention(layer, q, cache.keys[name][:, :cache.length],
                                      cache.values[name][:, :cache.length], masks[window])
        x = _layer_after(layer, x, attention, None)
    return inner.norm(x)


def _cache_mask(cache: KVCache, start: int, t: int, window: int | None) -> torch.Tensor:
    """``[B, 1, t, L]`` (True = may attend) for queries in slots ``start..start+t`` over the ``L``
    filled slots: real earlier (or the same) slots, within ``window`` positions; a query always
    sees its own slot (so a padding query's softmax has a term)."""
    length = cache.length
    slots = torch.arange(length, device=cache.valid.device)
    query_slots = slots[start:start + t]
    mask = (slots[None, :] <= query_slots[:, None])[None] & cache.valid[:, None, :length]
    if window is not None:
        query_pos = cache.positions[:, start:start + t]
        mask = mask & (query_pos[:, :, None] - cache.positions[:, None, :length] < window)
    mask = mask | (slots[None, :] == query_slots[:, None])[None]
    return mask[:, None]


def _cached_attention(layer: DecoderLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """Queries ``[B, t, heads, D]`` over cached keys/values ``[B, L, kv_heads, D]`` -> ``[B, t, heads * D]``."""
    attention = layer.self_attn
    b, t = q.shape[:2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if attention.softcap is not None:
        out = _softcapped(q, k, v, mask, attention.scale or attention.head_dim ** -0.5, attention.softcap)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attention.scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).reshape(b, t, -1)

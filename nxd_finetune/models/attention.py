"""Self-attention of the decoder: masks and packed-row layouts, the CPU-friendly SDPA paths, and
:class:`Attention` with the families' variants (fused ``qkv_proj``, per-head q/k norms, a softmax
scale from ``query_pre_attn_scalar``, attention logit soft-capping, per-layer sliding windows)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from nxd_finetune.models.config import DecoderConfig
from nxd_finetune.models.flex import flex_attention_tokens_first
from nxd_finetune.models.norms import RMSNorm
from nxd_finetune.models.rope import _rotary_tokens_first


def attention_mask(
    segment_ids: torch.Tensor | None, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean mask [B or 1, 1, T, T] (True = may attend), or None for plain causal attention.

    A token attends to itself and earlier tokens of the same segment, and, with a sliding window,
    only to the last ``sliding_window`` of those.
    """
    if segment_ids is None and (sliding_window is None or sliding_window >= seq_len):
        return None
    pos = torch.arange(seq_len, device=device)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None and sliding_window < seq_len:
        mask = mask & (pos[:, None] - pos[None, :] < sliding_window)
    mask = mask[None, None]
    if segment_ids is not None:
        same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        mask = mask & same
    return mask


@dataclasses.dataclass(frozen=True)
class SegmentRuns:
    """Packed rows as runs of tokens: ``lengths`` of the contiguous same-segment runs, row after row
    (they sum to B*T). Attention then runs causally within each run, which is what the segment mask
    says when no segment id occurs in two separate runs of a row."""

    lengths: list[int]


def segment_runs(segment_ids: torch.Tensor) -> SegmentRuns | None:
    """:class:`SegmentRuns` of ``segment_ids`` [B, T], or None when a row repeats an id after another
    (only the mask expresses that). Reads the ids on the host: meant for CPU tensors."""
    b, t = segment_ids.shape
    starts = torch.ones(b, t, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    ordered = segment_ids.sort(dim=1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1)
    if not torch.equal(distinct, starts.sum(dim=1)):
        return None
    idx = starts.flatten().nonzero().squeeze(1)
    return SegmentRuns(torch.diff(idx, append=idx.new_tensor([b * t])).tolist())


def attention_layout(
    segment_ids: torch.Tensor | None, seq_len: int, sliding_window: int | None, device: torch.device,
    runs: bool = True,
) -> torch.Tensor | SegmentRuns | None:
    """What :class:`Attention` gets as ``mask``: None (plain causal), :class:`SegmentRuns` (packed rows
    on CPU: per-sample causal attention, which skips the cross-sample blocks a mask would still
    compute -- 2.6x faster for 512-token rows of ~150-token samples), or the boolean mask of
    :func:`attention_mask` (sliding windows, non-contiguous segments, accelerators, where reading
    the ids on the host would stall the device). ``runs=False``: never runs (soft-capped attention
    takes a mask). This is the SDPA side of ``model.attention``; where flex attention runs (CUDA
    under ``auto``), :func:`nxd_finetune.models.flex.flex_block_mask` gives the layout instead."""
    windowed = sliding_window is not None and sliding_window < seq_len
    if runs and segment_ids is not None and not windowed and device.type == "cpu" and segment_ids.device.type == "cpu":
        found = segment_runs(segment_ids)
        if found is not None:
            return found
    return attention_mask(segment_ids, seq_len, sliding_window, device)


MASK_MAX_LEN = 256
"""Packed rows up to this many tokens may take the boolean mask in one fused attention call instead of
their runs (:func:`cheaper_layout`); above it the runs' causal block skipping wins."""

RUN_OVERHEAD = 1536
"""One run's fixed cost in :func:`cheaper_layout`, in units of one score of a padded run (about
0.2 ms per run and layer forward + backward, measured with 9 heads of 64 on 1 CPU thread)."""


def cheaper_layout(layout: torch.Tensor | SegmentRuns | None, segment_ids: torch.Tensor | None, seq_len: int,
                   device: torch.device) -> torch.Tensor | SegmentRuns | None:
    """``layout`` (:func:`attention_layout`'s), or the segment mask when it costs less than the runs:
    short packed rows (up to :data:`MASK_MAX_LEN` tokens) whose runs, each padded to
    :data:`RUN_MULTIPLE` and called on its own, add up to more score entries than the rows' full
    ``B x T x T`` (rows of 128 tokens holding ~60-token samples: 10 fused-kernel calls of 64 or 128
    tokens per layer against one masked call over 4 x 128, 1.6x faster forward + backward; the same
    numbers, ``bench/README.md``)."""
    if not isinstance(layout, SegmentRuns) or segment_ids is None or seq_len > MASK_MAX_LEN:
        return layout
    rows = segment_ids.shape[0]
    runs_cost = sum((-(-n // RUN_MULTIPLE) * RUN_MULTIPLE) ** 2 + RUN_OVERHEAD for n in layout.lengths)
    if rows * seq_len * seq_len > runs_cost:
        return layout
    return attention_mask(segment_ids, seq_len, None, device)


def _keep(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Rows ``index`` of ``x [B, T, F]`` flattened to ``[B*T, F]``: ``[N, F]``; ``x`` when None."""
    return x if index is None else x.reshape(-1, x.shape[-1]).index_select(0, index)


RUN_MULTIPLE = 64
"""Each run of a packed row goes into attention padded at its end to a multiple of this many
tokens. torch's fused CPU attention keeps state for every sequence length it has seen (2.5-5 MB
per length in bf16, torch 2.13), so a run whose samples have many lengths grew by about 22 MB per
step and ~0.9 GB over every length up to 512; padded, a 512-token row has 8 lengths. Unpacked
batches on CPU (``T`` = the longest row) are padded the same way. Exact: causal attention never
lets a real token see the padding after it (``bench/README.md``)."""


def _run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention within each run; q/k/v ``[B, T, heads, D]`` (kv heads may be fewer) -> like q.

    Each run goes in as ``[1, heads, L, D]``: SDPA's fused CPU kernel (flash attention for CPU, with
    its own backward) takes only 4-D inputs; 3-D ones fall back to the unfused math path, which
    materialises the scores and is 1.3-1.7x slower forward+backward here (bench/README.md). ``L``
    is the run's length rounded up to :data:`RUN_MULTIPLE` (zero rows at the end, whose outputs are
    dropped)."""
    b, t, h, d = q.shape
    pieces = zip(q.reshape(1, b * t, h, d).split(lengths, 1), k.reshape(1, b * t, -1, d).split(lengths, 1),
                 v.reshape(1, b * t, -1, d).split(lengths, 1), strict=True)
    return torch.cat([_padded_causal(qs, ks, vs, scale) for qs, ks, vs in pieces], 1).view(b, t, h, d)


def _padded_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal SDPA of tokens-first ``[B, T, heads, D]`` q/k/v (kv heads may be fewer) -> like q,
    with ``T`` padded at the end to :data:`RUN_MULTIPLE` for the kernel and cut back after."""
    t = q.shape[1]
    pad = -t % RUN_MULTIPLE
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=k.shape[2] != q.shape[2], scale=scale).transpose(1, 2)
    return out[:, :t] if pad else out


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                softcap: float) -> torch.Tensor:
    """Attention with capped scores, ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2;
    no fused kernel takes it). q/k/v ``[B, heads, T, D]`` (kv heads may be fewer), ``mask`` a
    boolean ``[B or 1, 1, T, T]`` or None (causal); softmax in fp32, as HF's eager attention."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * (scale / softcap)) * softcap
    if mask is None:
        t = q.shape[2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


class Attention(nn.Module):
    """Grouped-query self-attention; heads are derived from the projection sizes so that a
    tensor-parallel plan that shards q/k/v/o on heads needs no change here. ``sliding_window``: this
    layer's window (:meth:`DecoderConfig.layer_window`); the model builds each layer's mask from it."""

    def __init__(self, config: DecoderConfig, index: int = 0) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        assert d is not None and config.num_key_value_heads is not None  # DecoderConfig.__post_init__ sets both
        self.head_dim = d
        nq, nkv = config.num_attention_heads * d, config.num_key_value_heads * d
        if config.fused_qkv:  # Phi: one projection, rows [q | k | v] (a rank's share of each under TP)
            self.qkv_proj: nn.Module | None = nn.Linear(h, nq + 2 * nkv, bias=config.qkv_bias)
            self.kv_group = config.num_attention_heads // config.num_key_value_heads
        else:
            self.q_proj = nn.Linear(h, nq, bias=config.qkv_bias)
            self.k_proj = nn.Linear(h, nkv, bias=config.qkv_bias)
            self.v_proj = nn.Linear(h, nkv, bias=config.qkv_bias)
            self.qkv_proj = None
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=config.o_bias)
        # Qwen3, Gemma 3: per-head norms before rope; they act on whatever heads this rank holds under TP
        offset = config.norm_unit_offset
        self.q_norm = RMSNorm(d, config.rms_norm_eps, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, offset) if config.qk_norm else None
        self.scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.layer_window(index)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | SegmentRuns | BlockMask | None,
        keep_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``mask``: as :func:`attention_layout` returns (None = causal, a bool mask, or runs), or a
        flex :class:`BlockMask` (:func:`nxd_finetune.models.flex.flex_block_mask`).
        ``keep_index`` (long [N], flat indices into the B*T positions): attention still runs over
        every position, but only these rows of its output go through ``o_proj``: output ``[N, H]``.
        The three parts, :meth:`qkv`, :meth:`core` and ``o_proj``, are also called one by one
        (:class:`~nxd_finetune.models.llama.DecoderLayer` compiles all but the core)."""
        return self.o_proj(_keep(self.core(*self.qkv(x, cos, sin), mask), keep_index))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[B, T, heads, head_dim]`` of ``x``: projected, per-head normed
        (Qwen3, Gemma 3) and rotated, in the dtype attention takes."""
        q, k, v = self._project(x)
        b, t = q.shape[:2]  # not x.shape: under sequence parallel x holds T/tp positions
        # Under autocast the projections come out in the autocast dtype while cos/sin stay in the
        # residual stream's dtype (fp32 weights: fp32), so the rotary product promotes q and k to
        # fp32 (as in HF). Attention then takes q/k/v in v's dtype, the projections' compute dtype:
        # the autocast dtype under autocast, the model dtype outside it. CPU and CUDA autocast cast
        # SDPA's inputs to it anyway (same numbers); torch_xla's autocast does not, and SDPA
        # refuses mixed dtypes.
        q, k = q.view(b, t, -1, self.head_dim), k.view(b, t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = _rotary_tokens_first(q, cos, sin).to(v.dtype)
        k = _rotary_tokens_first(k, cos, sin).to(v.dtype)
        return q, k, v.view(b, t, -1, self.head_dim)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | SegmentRuns | BlockMask | None) -> torch.Tensor:
        """Attention of :meth:`qkv`'s outputs under ``mask`` (see :meth:`forward`): ``[B, T, heads * head_dim]``."""
        b, t = q.shape[:2]
        if isinstance(mask, BlockMask):
            return flex_attention_tokens_first(q, k, v, mask, self.scale, self.softcap).reshape(b, t, -1)
        if isinstance(mask, SegmentRuns):
            return _run_attention(q, k, v, mask.lengths, self.scale).reshape(b, t, -1)
        if mask is None and q.device.type == "cpu" and self.softcap is None:  # unpacked rows: T varies per batch
            return _padded_causal(q, k, v, self.scale).reshape(b, t, -1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.softcap is not None:
            out = _softcapped(q, k, v, mask, self.scale or self.head_dim ** -0.5, self.softcap)
        elif mask is None:  # GQA inside the kernel: no repeated K/V copies kept for backward
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1],
                                                 scale=self.scale)
        elif q.device.type == "cpu":  # the fused CPU kernel takes a mask with GQA: no repeated K/V copies
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1],
                                                 scale=self.scale)
        else:  # masked kernels on accelerators (memory-efficient attention) do not take enable_gqa
            if k.shape[1] != q.shape[1]:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return out.transpose(1, 2).reshape(b, t, -1)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, T, heads * head_dim]`` (this rank's heads under TP)."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = self.qkv_proj(x)
        # [q | k | v] with q = kv_group * kv (no replicated KV heads with a fused projection)
        kv = qkv.shape[-1] // (self.kv_group + 2)
        q, k, v = qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], dim=-1)
        return q, k, v

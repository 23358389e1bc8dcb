"""A plain PyTorch decoder for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) with HF
module names; the families' differences are fields of :class:`DecoderConfig`.

Module names equal HuggingFace's so checkpoints load by name and LoRA adapters come out in PEFT
layout without a renaming table. ``model.layers`` is an ``nn.ModuleDict`` keyed ``"0".."N-1"``: a
pipeline stage may delete layers it does not own, or set ``embed_tokens``/``norm``/``lm_head`` to
None, and the remaining names stay those of the full model.

This module imports nothing from ``nxd_finetune.parallel``; parallelism is applied from outside by
replacing ``nn.Linear``/``nn.Embedding`` modules according to a plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nxd_finetune.models.config import DecoderConfig
from nxd_finetune.models.norms import RMSNorm
from nxd_finetune.models.rope import RopeTables, _rotary_tokens_first

__all__ = ["RMSNorm", "DecoderForCausalLM", "DecoderModel", "DecoderLayer", "Attention", "MLP"]


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
    segment_ids: torch.Tensor | None, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor | SegmentRuns | None:
    """What :class:`Attention` gets as ``mask``: None (plain causal), :class:`SegmentRuns` (packed rows
    on CPU: per-sample causal attention, which skips the cross-sample blocks a mask would still
    compute -- 2.6x faster for 512-token rows of ~150-token samples), or the boolean mask of
    :func:`attention_mask` (sliding windows, non-contiguous segments, accelerators, where reading
    the ids on the host would stall the device)."""
    windowed = sliding_window is not None and sliding_window < seq_len
    if segment_ids is not None and not windowed and device.type == "cpu" and segment_ids.device.type == "cpu":
        runs = segment_runs(segment_ids)
        if runs is not None:
            return runs
    return attention_mask(segment_ids, seq_len, sliding_window, device)


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


def _run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Causal attention within each run; q/k/v ``[B, T, heads, D]`` (kv heads may be fewer) -> like q.

    Each run goes in as ``[1, heads, L, D]``: SDPA's fused CPU kernel (flash attention for CPU, with
    its own backward) takes only 4-D inputs; 3-D ones fall back to the unfused math path, which
    materialises the scores and is 1.3-1.7x slower forward+backward here (bench/README.md). ``L``
    is the run's length rounded up to :data:`RUN_MULTIPLE` (zero rows at the end, whose outputs are
    dropped)."""
    b, t, h, d = q.shape
    pieces = zip(q.reshape(1, b * t, h, d).split(lengths, 1), k.reshape(1, b * t, -1, d).split(lengths, 1),
                 v.reshape(1, b * t, -1, d).split(lengths, 1), strict=True)
    return torch.cat([_padded_causal(qs, ks, vs) for qs, ks, vs in pieces], 1).view(b, t, h, d)


def _padded_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of tokens-first ``[B, T, heads, D]`` q/k/v (kv heads may be fewer) -> like q,
    with ``T`` padded at the end to :data:`RUN_MULTIPLE` for the kernel and cut back after."""
    t = q.shape[1]
    pad = -t % RUN_MULTIPLE
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)
    return out[:, :t] if pad else out


class Attention(nn.Module):
    """Grouped-query self-attention; heads are derived from the projection sizes so that a
    tensor-parallel plan that shards q/k/v/o on heads needs no change here."""

    def __init__(self, config: DecoderConfig) -> None:
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
        # Qwen3: per-head norms before rope; they act on whatever heads this rank holds under TP
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | SegmentRuns | None,
        keep_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``mask``: as :func:`attention_layout` returns (None = causal, a bool mask, or runs).
        ``keep_index`` (long [N], flat indices into the B*T positions): attention still runs over
        every position, but only these rows of its output go through ``o_proj``: output ``[N, H]``."""
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
        v = v.view(b, t, -1, self.head_dim)
        if isinstance(mask, SegmentRuns):
            return self.o_proj(_keep(_run_attention(q, k, v, mask.lengths).reshape(b, t, -1), keep_index))
        if mask is None and q.device.type == "cpu":  # unpacked rows: T (the longest row) varies per batch
            return self.o_proj(_keep(_padded_causal(q, k, v).reshape(b, t, -1), keep_index))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is None:  # GQA inside the kernel: no repeated K/V copies kept for backward
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        else:  # masked kernels on accelerators (memory-efficient attention) do not take enable_gqa
            if k.shape[1] != q.shape[1]:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(_keep(out.transpose(1, 2).reshape(b, t, -1), keep_index))


    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, T, heads * head_dim]`` (this rank's heads under TP)."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = self.qkv_proj(x)
        # [q | k | v] with q = kv_group * kv (no replicated KV heads with a fused projection)
        kv = qkv.shape[-1] // (self.kv_group + 2)
        q, k, v = qkv.split([qkv.shape[-1] - 2 * kv, kv, kv], dim=-1)
        return q, k, v


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` that keeps only ``gate`` and ``up`` for backward and recomputes
    ``silu(gate)`` there: one ``[N, intermediate]`` tensor less per layer held between forward and
    backward than the two autograd ops would keep (the MLP holds most of a layer's activations)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); Phi's ``gate_up_proj`` computes [gate | up] at once."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        if config.fused_gate_up:
            self.gate_up_proj: nn.Module | None = nn.Linear(h, 2 * i, bias=config.mlp_bias)
        else:
            self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
            self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
            self.gate_up_proj = None
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down_proj(_SwiGLU.apply(gate, up))
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | SegmentRuns | None,
        keep_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, T, H]`` -> ``[B, T, H]``, or ``[N, H]`` at the positions of ``keep_index`` only
        (attention still reads every position's keys and values; see :class:`Attention`)."""
        h = self.self_attn(self.input_layernorm(x), cos, sin, mask, keep_index)
        x = _keep(x, keep_index) + h
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Module | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in range(config.num_hidden_layers)})
        self.norm: nn.Module | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RopeTables(config)

    def forward(
        self,
        hidden_or_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        keep_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden_or_ids``: token ids [B, T] when this stage owns the embeddings, else hidden
        states [B, T, H]. Returns hidden states [B, T, H] (normed when this stage owns ``norm``).

        ``keep_index`` (long [N], flat indices into the B*T positions; not under sequence parallel,
        where a rank holds T/tp positions): return ``[N, H]``, those positions only. The last layer
        then runs ``o_proj``, its residual, norm and MLP on those N rows alone, since no later
        position reads them: with SFT's target positions (about half the tokens in bench/'s data)
        that skips ~45% of the last layer's matmul work."""
        x = self.embed_tokens(hidden_or_ids) if self.embed_tokens is not None else hidden_or_ids
        b = x.shape[0]
        if position_ids is None:
            # from the ids (full length T); stages fed hidden states under sequence parallel hold
            # T/tp positions and must be given position_ids
            t = hidden_or_ids.shape[1]
            position_ids = torch.arange(t, device=x.device).expand(b, t)
        t = position_ids.shape[1]
        cos, sin = self.rope(position_ids.to(x.device), x.dtype)
        mask = attention_layout(segment_ids, t, self.config.sliding_window, x.device)
        layers = list(self.layers.values())
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, mask, keep_index if i == len(layers) - 1 else None)
        if not layers:
            x = _keep(x, keep_index)
        return self.norm(x) if self.norm is not None else x


class DecoderForCausalLM(nn.Module):
    """Causal LM with HF names: ``model.*`` and ``lm_head``.

    ``forward(input_ids [B,T], position_ids=None [B,T], segment_ids=None [B,T]) -> logits [B,T,V]``.
    For packed batches pass per-sample ``position_ids`` (restarting at 0) and ``segment_ids``;
    no token then attends across a segment boundary. With ``logits_index`` (long [N], flat indices
    into the B*T positions) only those rows of logits are computed: ``[N, V]``. SFT needs logits at
    the target positions only (prompts and padding carry label -100), so the vocabulary projection,
    its fp32 logits and the loss's softmax shrink to those rows, and so does the last layer's work
    after attention (``DecoderModel``'s ``keep_index``; see ``loss.target_index``).
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head: nn.Module | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.return_hidden = False  # a pipeline's last stage whose loss runs the head itself, in chunks
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``model.embed_tokens.weight`` (tied-embedding configs)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.lm_head is None or self.return_hidden:
            return self.model(input_ids, position_ids, segment_ids)
        return self.lm_head(self.model(input_ids, position_ids, segment_ids, logits_index))

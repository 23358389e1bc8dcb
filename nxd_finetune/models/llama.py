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
import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from nxd_finetune.errors import NxdError
from nxd_finetune.models.activations import _SwiGLU, swiglu
from nxd_finetune.models.attention import (
    RUN_MULTIPLE,
    Attention,
    SegmentRuns,
    _keep,
    _run_attention,
    attention_layout,
    attention_mask,
    cheaper_layout,
    segment_runs,
)
from nxd_finetune.models.config import DecoderConfig
from nxd_finetune.models.flex import ATTENTIONS, flex_block_mask, uses_flex
from nxd_finetune.models.moe import SparseMoeBlock
from nxd_finetune.models.norms import RMSNorm
from nxd_finetune.models.rope import RopeTables

# re-exported: tests and bench/ reach the attention helpers through this module
__all__ = ["RMSNorm", "DecoderForCausalLM", "DecoderModel", "DecoderLayer", "Attention", "MLP", "SparseMoeBlock",
           "_SwiGLU", "RUN_MULTIPLE",
           "SegmentRuns", "attention_layout", "attention_mask", "segment_runs", "_run_attention"]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), or GeGLU with tanh-approximated GELU (Gemma's
    ``gelu_pytorch_tanh``); Phi's ``gate_up_proj`` computes [gate | up] at once."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
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
        if self.gelu:
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(swiglu(gate, up))


class DecoderLayer(nn.Module):
    """Layer ``index`` of the decoder. With ``sandwich_norms`` (Gemma) ``post_attention_layernorm``
    norms the attention output before the residual, and ``pre_feedforward_layernorm`` /
    ``post_feedforward_layernorm`` the MLP's input and output; otherwise ``post_attention_layernorm``
    is the MLP's input norm (Llama). ``layer_type``: HF's ``layer_types`` entry. ``mlp`` is a
    mixture-of-experts block on the layers :meth:`DecoderConfig.is_moe_layer` names."""

    def __init__(self, config: DecoderConfig, index: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, index)
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(config, index) if config.is_moe_layer(index) else MLP(config)
        self.layer_type = config.layer_types[index] if config.layer_types else "full_attention"

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if config.sandwich_norms else None
        self.post_feedforward_layernorm = norm() if config.sandwich_norms else None
        self.compiled: str | None = None  # model.compile's torch.compile backend (DecoderForCausalLM.set_compile)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | SegmentRuns | BlockMask | None,
        keep_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [B, T, H]`` -> ``[B, T, H]``, or ``[N, H]`` at the positions of ``keep_index`` only
        (attention still reads every position's keys and values; see :class:`Attention`).

        With :attr:`compiled` the parts before and after the attention kernel run through
        ``torch.compile`` (:func:`compiled_regions`); the kernel itself, whose mask may be a host-side
        run list or a block mask, runs as it is."""
        before, after, after_kept = (compiled_regions(self.compiled) if self.compiled is not None
                                     else (_layer_before, _layer_after, _layer_after))
        q, k, v = before(self, x, cos, sin)
        return (after if keep_index is None else after_kept)(self, x, self.self_attn.core(q, k, v, mask), keep_index)


def _layer_before(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's input norm and :meth:`Attention.qkv`."""
    return layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)


def _layer_after(layer: DecoderLayer, x: torch.Tensor, attention: torch.Tensor,
                 keep_index: torch.Tensor | None) -> torch.Tensor:
    """A layer's ``o_proj`` of the ``attention`` output, the residuals, norms and MLP."""
    h = layer.self_attn.o_proj(_keep(attention, keep_index))
    if layer.pre_feedforward_layernorm is None or layer.post_feedforward_layernorm is None:
        x = _keep(x, keep_index) + h
        return x + layer.mlp(layer.post_attention_layernorm(x))
    x = _keep(x, keep_index) + layer.post_attention_layernorm(h)
    return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))


def _layer_after_kept(layer: DecoderLayer, x: torch.Tensor, attention: torch.Tensor,
                      keep_index: torch.Tensor | None) -> torch.Tensor:
    """:func:`_layer_after` under its own name: compiled apart, its graphs (with ``keep_index``)
    do not count against the other's recompile limit."""
    return _layer_after(layer, x, attention, keep_index)


@functools.cache
def compiled_regions(backend: str = "inductor") -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                                                         Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``torch.compile`` of :func:`_layer_before` and of :func:`_layer_after` twice (without and
    with ``keep_index``, the last layer's), made once per process and shared by every layer: the
    layer is an argument, so its parameters are graph inputs and layers alike reuse one graph
    (torch's ``inline_inbuilt_nn_modules``). Sizes that change from batch to batch (rows per
    micro-batch, unpacked rows' length, ``keep_index``'s) become dynamic after their first change.
    inductor draws dropout's random numbers as eager does (``fallback_random``), so a compiled run
    repeats an eager one's LoRA dropout. ``backend``: torch.compile's backend (``inductor``; a
    device's own, e.g. TorchNeuron's ``neuron``), made once per backend."""
    options: dict[str, str | int | bool | Callable[..., object]] | None = (
        {"fallback_random": True} if backend == "inductor" else None)
    return (torch.compile(_layer_before, backend=backend, options=options),
            torch.compile(_layer_after, backend=backend, options=options),
            torch.compile(_layer_after_kept, backend=backend, options=options))


def compile_backend(compiled: bool | str) -> str | None:
    """``model.compile``'s torch.compile backend: True -> inductor, False -> None (eager), a name as is."""
    if isinstance(compiled, str):
        return compiled
    return "inductor" if compiled else None


def _embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; under the meta device (shapes only, the weights loaded later)
    without its ``normal_`` init, whose meta kernel imports ``torch._dynamo`` (~70 MB resident)."""
    weight = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=weight if weight.is_meta else None)


class DecoderModel(nn.Module):
    """Embeddings, layers and final norm (HF's ``model.`` prefix). Each layer gets the mask of its
    own sliding window (built once per batch and window, shared by the layers) and, with
    ``rope_local_base_freq`` (Gemma 3), the sliding layers their own rope tables. ``attention``: the
    attention kernel choice (:data:`nxd_finetune.models.flex.ATTENTIONS`; set it through
    :meth:`DecoderForCausalLM.set_attention`)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Module | None = _embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, i) for i in range(config.num_hidden_layers)})
        self.norm: nn.Module | None = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        self.attention = "auto"
        self.rope = RopeTables(config)
        local = config.rope_local_base_freq
        self.ropes = {"full_attention": self.rope, "sliding_attention": self.rope if local is None else
                      RopeTables(dataclasses.replace(config, rope_theta=local, rope_scaling=None))}

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
        if self.embed_tokens is not None:
            x = self.embed_tokens(hidden_or_ids)
            if self.config.embed_scale:  # Gemma: the scale rounded to the weights' dtype, as HF
                x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        else:
            x = hidden_or_ids
        b = x.shape[0]
        if position_ids is None:
            # from the ids (full length T); stages fed hidden states under sequence parallel hold
            # T/tp positions and must be given position_ids
            t = hidden_or_ids.shape[1]
            position_ids = torch.arange(t, device=x.device).expand(b, t)
        t = position_ids.shape[1]
        position_ids = position_ids.to(x.device)
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[int | None, torch.Tensor | SegmentRuns | BlockMask | None] = {}
        softcap = self.config.attn_logit_softcapping
        layers = cast(list[DecoderLayer], list(self.layers.values()))
        for i, layer in enumerate(layers):
            kind = "sliding_attention" if layer.layer_type == "sliding_attention" else "full_attention"
            if kind not in tables:
                tables[kind] = self.ropes[kind](position_ids, x.dtype)
            window = layer.self_attn.sliding_window
            if window not in masks and uses_flex(self.attention, x.device, segment_ids, t, window, softcap):
                masks[window] = flex_block_mask(segment_ids, t, window, x.device)
            elif window not in masks:  # soft-capped scores take a mask, not runs
                masks[window] = cheaper_layout(attention_layout(segment_ids, t, window, x.device, runs=softcap is None),
                                               segment_ids, t, x.device)
            x = layer(x, *tables[kind], masks[window], keep_index if i == len(layers) - 1 else None)
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

    def set_attention(self, attention: str) -> None:
        """The attention kernels (``model.attention``): ``auto``, ``sdpa`` or ``flex``
        (:data:`nxd_finetune.models.flex.ATTENTIONS`). Numbers agree within float rounding; the
        choice is one of speed and memory. Raises NxdError for another name."""
        if attention not in ATTENTIONS:
            raise NxdError(f"model.attention={attention!r} is not one of {', '.join(ATTENTIONS)}")
        self.model.attention = attention

    def set_compile(self, compiled: bool | str) -> None:
        """``model.compile``: run each decoder layer's work around the attention kernel through
        ``torch.compile`` (:meth:`DecoderLayer.forward`) with backend ``compiled`` (True: inductor;
        False: eager). The same numbers within float rounding."""
        backend = compile_backend(compiled)
        for layer in self.model.layers.values():
            cast(DecoderLayer, layer).compiled = backend

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
        return self.head(self.model(input_ids, position_ids, segment_ids, logits_index))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states: ``lm_head``, then ``final_logit_softcapping`` (Gemma 2) as
        ``cap * tanh(logits / cap)``, elementwise, so a vocab-parallel shard of the logits is capped
        alike. Losses that run the output layer themselves (in chunks) take this, not ``lm_head``."""
        assert self.lm_head is not None  # the last stage's (or the whole model's) head
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

"""Tensor-parallel plans as data, and the one function that applies them.

A plan maps module-name patterns (``*`` matches one dotted name component) to a style:

- ``column``:    ``nn.Linear`` -> :class:`ColumnParallelLinear`, output dim split, output left sharded.
- ``column_kv``: ``column`` for the K/V projections, split on KV heads; when tp exceeds the KV
  head count each head is replicated over ``tp / num_key_value_heads`` consecutive ranks.
- ``column_qkv``: a fused ``[q | k | v]`` projection (Phi's ``qkv_proj``), split by head: rank ``r``
  holds its query heads' rows, then its KV heads' k rows and v rows (``Shard.parts``), never a
  contiguous block of the fused rows. KV heads cannot be replicated (tp must divide them).
- ``column_gate_up``: a fused ``[gate | up]`` projection (Phi's ``gate_up_proj``), each half split
  on its own, so a rank's output is its gate columns then its up columns.
- ``row``:       ``nn.Linear`` -> :class:`RowParallelLinear`, input dim split, input already sharded.
- ``vocab``:     ``nn.Embedding`` -> :class:`VocabParallelEmbedding`.
- ``replicate``: kept whole on every TP rank (norms). Under sequence parallel these modules run on
  sequence chunks, so their gradients are partial sums over TP (``Partial`` on tp).
- ``replicate_heads``: kept whole on every TP rank, applied to this rank's attention heads (Qwen3's
  per-head ``q_norm``/``k_norm``): each rank's gradient covers its heads only, so it is always a
  partial sum over TP (``Partial`` on tp, with or without sequence parallel).

Llama-family attention under TP: q/o are split on query heads (rank ``r`` holds heads
``[r*nq/tp, (r+1)*nq/tp)``), k/v on KV heads. The model derives head counts from projection sizes,
so it needs no change. When ``tp <= num_key_value_heads`` (tp dividing it), rank ``r`` holds KV heads
``[r*nkv/tp, (r+1)*nkv/tp)``, exactly those its query heads use. When ``tp > num_key_value_heads``
(nkv dividing tp), rank ``r`` holds the single KV head ``r // (tp/nkv)``, which is the head its
query heads use: its queries ``[r*nq/tp, ...)`` all fall in group ``r*nkv/tp`` of ``nq/nkv``
queries. The ``tp/nkv`` ranks sharing a KV head sum their K/V gradients
(:func:`allreduce_replicated_grads`). Anything else is an NxdError with the numbers.

Order of model building: build on the meta device -> ``apply_tp_plan`` -> (LoRA injection) ->
``materialize(..., reader=make_slice_reader(model))``. ``apply_tp_plan`` also works on a
materialised model (each layer copies its slice), which tests use.
"""

from __future__ import annotations

import re
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune.errors import ModelLoadError, NxdError
from nxd_finetune.models.families import FAMILIES
from nxd_finetune.models.loading import TensorSlice
from nxd_finetune.parallel.layers import TP, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from nxd_finetune.parallel.placement import Partial, Placement, iter_placements
from nxd_finetune.parallel.state import ParallelState

STYLES = ("column", "column_kv", "column_qkv", "column_gate_up", "row", "vocab", "replicate", "replicate_heads")

def tp_plan_for(config: object) -> dict[str, str]:
    """The plan of ``config.architecture``'s family (:data:`~nxd_finetune.models.families.FAMILIES`;
    ``config``: a HeadConfig, or anything with that attribute); NxdError listing the supported ones
    otherwise."""
    arch = getattr(config, "architecture", None)
    if not isinstance(arch, str) or arch not in FAMILIES:
        raise NxdError(f"no tensor-parallel plan for {arch!r}; supported: {', '.join(FAMILIES)}")
    return dict(FAMILIES[arch].tp_plan)


class HeadConfig(Protocol):
    """The sizes a TP plan splits, as a model's config holds them (``DecoderConfig``, an HF config).
    ``num_key_value_heads`` / ``head_dim``: None only before ``DecoderConfig`` fills them in."""

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int | None: ...
    @property
    def head_dim(self) -> int | None: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def _kv_heads(config: HeadConfig) -> int:
    nkv = config.num_key_value_heads
    assert nkv is not None  # DecoderConfig.__post_init__ sets it
    return nkv


def check_tp_config(config: HeadConfig, tp: int, sequence_parallel: bool = False, seq_len: int | None = None) -> None:
    """Raise NxdError (one line, with the numbers) when ``config`` cannot be split ``tp`` ways.

    Checks query heads, KV heads (split or replicated, see the module docstring), intermediate
    size and vocabulary; under sequence parallel also ``seq_len`` when given. Cheap, so the
    recipe check can call it before any worker starts.
    """
    nq, nkv = config.num_attention_heads, _kv_heads(config)
    if nq % tp:
        raise NxdError(f"num_attention_heads={nq} is not divisible by tp={tp}")
    if nkv % tp and tp % nkv:
        raise NxdError(
            f"num_key_value_heads={nkv} and tp={tp}: one must divide the other "
            f"(KV heads are split when tp divides them, replicated when they divide tp)"
        )
    if getattr(config, "fused_qkv", False) and nkv % tp:
        raise NxdError(f"num_key_value_heads={nkv} is not divisible by tp={tp} (a fused qkv_proj splits its KV "
                       "heads, it cannot replicate them)")
    if config.intermediate_size % tp:
        raise NxdError(f"intermediate_size={config.intermediate_size} is not divisible by tp={tp}")
    if config.vocab_size % tp:
        raise NxdError(f"vocab_size={config.vocab_size} is not divisible by tp={tp}")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise NxdError(f"sequence parallel: sequence length {seq_len} is not divisible by tp={tp}")


def _fused_parts(config: HeadConfig, style: str) -> tuple[int, ...]:
    """The pieces of a fused projection's output (``Shard.parts``); () for the other styles."""
    if style == "column_qkv":
        d, nkv = config.head_dim, _kv_heads(config)
        assert d is not None  # DecoderConfig.__post_init__ sets it
        return (config.num_attention_heads * d, nkv * d, nkv * d)
    if style == "column_gate_up":
        return (config.intermediate_size, config.intermediate_size)
    return ()


def kv_replication(config: HeadConfig, tp: int) -> int:
    """How many consecutive TP ranks share one KV head (1 when tp divides the KV head count)."""
    nkv = _kv_heads(config)
    return tp // nkv if tp > nkv else 1


def _compile(plan: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    out = []
    for pattern, style in plan.items():
        if style not in STYLES:
            raise NxdError(f"TP plan entry {pattern!r}: unknown style {style!r} (use one of {', '.join(STYLES)})")
        out.append((re.compile(re.escape(pattern).replace(r"\*", r"[^.]+")), style))
    return out


def _style_of(name: str, compiled: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, style in compiled:
        if pattern.fullmatch(name):
            return style
    return None


def _expect(module: nn.Module, name: str, cls: type[nn.Module]) -> None:
    if type(module) is not cls:
        raise NxdError(
            f"TP plan: {name} is {type(module).__name__}, expected {cls.__name__} "
            f"(apply the TP plan before LoRA injection)"
        )


def apply_tp_plan(
    model: nn.Module, plan: dict[str, str], state: ParallelState, sequence_parallel: bool = False
) -> nn.Module:
    """Swap ``model``'s modules for tensor-parallel ones as ``plan`` says; returns ``model``.

    ``model`` (usually on the meta device; then the new layers are on meta too) must have a
    ``config`` with the Llama-family head fields. Module and parameter names are unchanged.
    Tied embeddings are re-tied (``lm_head`` and ``embed_tokens`` shard the vocab alike).
    With tp == 1 this is a no-op. Collective over the world when KV heads are replicated (it
    creates the KV subgroups), so every rank must call it. Raises NxdError for a config that
    does not split (see :func:`check_tp_config`), a module with parameters that no plan entry
    covers, or a module of the wrong type for its style.

    Under ``sequence_parallel`` the residual stream between layers is ``[B, T/tp, H]``: the
    embedding reduce-scatters, column layers all-gather their input, row layers reduce-scatter
    their output; ``lm_head`` all-gathers, so logits are ``[B, T, V/tp]``.
    """
    tp = state.size("tp")
    if tp == 1:
        return model
    config: HeadConfig = model.config  # type: ignore[assignment]  # nn.Module types attributes as Tensor | Module
    check_tp_config(config, tp)
    replicas = kv_replication(config, tp)
    group, sp = state.group("tp"), sequence_parallel
    compiled = _compile(plan)
    for name, module in list(model.named_modules()):
        style = _style_of(name, compiled)
        if style is None:
            if any(p is not None for p in module._parameters.values()):
                raise NxdError(f"TP plan: no entry covers module {name!r} (it holds parameters)")
            continue
        if style == "replicate_heads" or (style == "replicate" and sp):
            module.placements = {
                a: Placement(tuple(p.shape), ((TP, Partial()),)) for a, p in module._parameters.items() if p is not None
            }
            continue
        if style == "replicate":
            continue
        if style == "vocab":
            _expect(module, name, nn.Embedding)
            new: nn.Module = VocabParallelEmbedding.from_embedding(module, group, sequence_parallel=sp)
        elif style == "row":
            _expect(module, name, nn.Linear)
            new = RowParallelLinear.from_linear(module, group, input_is_parallel=True, sequence_parallel=sp)
        else:
            _expect(module, name, nn.Linear)
            new = ColumnParallelLinear.from_linear(
                module, group, sequence_parallel=sp, replicas=replicas if style == "column_kv" else 1,
                parts=_fused_parts(config, style),
            )
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    if replicas > 1:
        state.subgroup("tp", replicas)  # collective: create the KV-sharing groups on every rank now
    tie_weights = getattr(model, "tie_weights", None)
    if tie_weights is not None:
        tie_weights()
    return model


def make_slice_reader(model: nn.Module):
    """A ``reader(key, safe_slice, target)`` for ``nxd_finetune.models.materialize``.

    For a parameter of a sharded layer it reads only this rank's slice through
    ``safe_slice[...]`` (checking the checkpoint holds the full shape the layer expects:
    ModelLoadError otherwise); anything else is read whole. When the model is sharded, every
    tensor is copied out of the memory-mapped file: a slice view would keep the whole file mapped,
    and a column slice touches every page of its tensor, so the rank's resident memory would count
    the other ranks' shares too (the copies hold exactly this rank's bytes, contiguous for the
    matmuls). Unsharded models keep the zero-copy views of the mapping. Build it after ``apply_tp_plan``
    (and LoRA injection), before ``materialize``: parameters are matched by identity.
    """
    specs: dict[int, tuple[torch.Tensor, Placement]] = {}
    for _, module, attr, placement in iter_placements(model):
        param = module._parameters[attr]
        assert param is not None  # iter_placements yields set parameters only
        specs[id(param)] = (param, placement)

    def reader(key: str, safe_slice: TensorSlice, target: torch.Tensor) -> torch.Tensor:
        entry = specs.get(id(target))
        if entry is None or entry[0] is not target or not entry[1].sharded:
            return safe_slice[:] if not specs else safe_slice[:].clone()
        placement = entry[1]
        shape = tuple(safe_slice.get_shape())
        if shape != placement.full_shape:
            raise ModelLoadError(
                f"tensor {key!r} has shape {shape} in the checkpoint, the model expects {placement.full_shape}"
            )
        return placement.take(safe_slice).clone(memory_format=torch.contiguous_format)

    return reader


@torch.no_grad()
def allreduce_replicated_grads(model: nn.Module, state: ParallelState) -> None:
    """Sum the partial gradients over model axes (:meth:`Placement.partial_sums`).

    Covers norm weights (and row-parallel biases) under sequence parallel, which see only this
    rank's sequence chunk, and KV shards replicated over ``tp / num_key_value_heads`` ranks. Call
    once per optimizer step, after the last backward of the accumulation and before gradient
    clipping, on every rank. One flat all-reduce per (axis, block size, dtype); parameters without
    a gradient (frozen) are skipped. A no-op when every model axis has degree one.
    """
    layout = state.layout
    buckets: dict[tuple[str, int, torch.dtype], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for _, module, attr, placement in iter_placements(model):
        param = module._parameters[attr]
        assert param is not None  # iter_placements yields set parameters only
        if param.grad is None or id(param) in seen:
            continue
        seen.add(id(param))
        for axis, size in placement.partial_sums(layout):
            buckets.setdefault((axis, size, param.grad.dtype), []).append(param.grad)
    order = layout.names
    for (axis, size, _), grads in sorted(buckets.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1],
                                                                          str(kv[0][2]))):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=state.subgroup(axis, size))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

"""Tensor-parallel layers.

Every layer keeps HF's parameter names (``weight``, ``bias``), so a model's module and parameter
names do not change when its ``nn.Linear``/``nn.Embedding`` modules are swapped for these. Each
layer carries ``placements: dict[str, Placement]`` (one per parameter, :mod:`.placement`) saying
how each parameter lies on the ``tp`` axis; ``full_shape`` is the weight's.

Layers take the TP ``group`` they shard over; with a group of size one they are plain
``nn.Linear``/``nn.Embedding`` maths and issue no collective.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp_,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)
from nxd_finetune.parallel.placement import Partial, Placement, Shard, shard_tensor

TP = "tp"  # the axis these layers split


def _new_param(shape: tuple[int, ...], device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


class _ParallelLinearBase(nn.Module):
    """Shared parts of the column- and row-parallel linears (weight ``[out_local, in_local]``)."""

    in_features: int
    out_features: int
    weight: nn.Parameter
    bias: nn.Parameter | None
    placements: dict[str, Placement]

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.placements["weight"].full_shape

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's init applied to the local shard (meta tensors are left alone)."""
        if self.weight.device.type == "meta":
            return
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    @torch.no_grad()
    def copy_from_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Fill this rank's shard from full (unsharded) tensors."""
        self.weight.copy_(shard_tensor(weight, self.placements["weight"]))
        if self.bias is not None and bias is not None:
            self.bias.copy_(shard_tensor(bias, self.placements["bias"]))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs):
        """A sharded copy of ``linear`` on its device and dtype; on the meta device only shapes."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group=group,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
            **kwargs,
        )
        if linear.weight.device.type != "meta":
            layer.copy_from_full(linear.weight, linear.bias)
        return layer

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"local_weight={tuple(self.weight.shape)}, bias={self.bias is not None}"
        )


class ColumnParallelLinear(_ParallelLinearBase):
    """``y = x W^T + b`` with ``W [out, in]`` split on the output dim over the TP group.

    Input: ``[*, in]`` replicated on the TP ranks, or with ``sequence_parallel`` ``[B, T/tp, in]``
    (this rank's sequence chunk; all-gathered here, gradient reduce-scattered back). Output:
    ``[*, out/tp]`` (this rank's features), or ``[*, out]`` with ``gather_output``.
    ``in_features``/``out_features`` are the full sizes; ``weight`` is ``[out/tp, in]``, ``bias``
    ``[out/tp]``.

    ``replicas`` > 1 (KV heads when tp exceeds their count): the output dim is cut into
    ``tp / replicas`` chunks and ``replicas`` consecutive ranks hold the same one; their weight
    gradients are partial sums (``Shard.replicas``). ``gather_output`` is then refused.
    ``parts`` (a fused projection, see :class:`~.placement.Shard`): each piece of the output is split on
    its own, so the local output is this rank's share of every piece, in order.
    Raises NxdError when the output dim does not divide by the number of chunks.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        replicas: int = 1,
        parts: tuple[int, ...] = (),
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        tp, rank = group_size(group), group_rank(group)
        if parts and (replicas > 1 or gather_output or sum(parts) != out_features):
            raise NxdError(f"fused output parts {parts} need {sum(parts)} == {out_features} outputs, no replicated "
                           "shards and no gathered output")
        if any(size % tp for size in parts):
            raise NxdError(f"fused output parts {parts} are not each divisible by {tp} tensor-parallel shards")
        if replicas < 1 or tp % replicas:
            raise NxdError(f"KV replication {replicas} does not divide the tensor-parallel size {tp}")
        if replicas > 1 and gather_output:
            raise ValueError("gather_output is not supported with replicated shards")
        chunks = tp // replicas
        if out_features % chunks:
            raise NxdError(f"output size {out_features} is not divisible by {chunks} tensor-parallel shards")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.replicas = replicas
        on = ((TP, Shard(0, chunks, rank // replicas, replicas=replicas, parts=tuple(parts))),)
        self.placements = {"weight": Placement((out_features, in_features), on)}
        self.weight = _new_param((out_features // chunks, in_features), device, dtype)
        if bias:
            self.placements["bias"] = Placement((out_features,), on)
            self.bias = _new_param((out_features // chunks,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    # The forward in three steps, so a layer wrapping this one (sharded LoRA) reuses its collectives.

    def parallel_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input every TP rank multiplies: gathered from the sequence shards under sequence
        parallel, else ``x`` (``copy_to_tp``: identity forward, gradient all-reduced backward)."""
        return gather_from_sequence(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)

    def local_output(self, x_in: torch.Tensor) -> torch.Tensor:
        """This rank's output shard ``[*, out/p]`` of the prepared input."""
        return F.linear(x_in, self.weight, self.bias)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The layer's output from the local shard: gathered with ``gather_output``, else as is."""
        return gather_from_tp(y, self.group) if self.gather_output else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.local_output(self.parallel_input(x)))


class RowParallelLinear(_ParallelLinearBase):
    """``y = x W^T + b`` with ``W [out, in]`` split on the input dim over the TP group.

    Input: ``[*, in/tp]`` (``input_is_parallel``, the output of a column-parallel layer) or
    ``[*, in]`` replicated (split here). The partial products are summed over the TP group:
    all-reduce -> ``[*, out]`` replicated, or with ``sequence_parallel`` reduce-scatter on the
    sequence dim -> ``[B, T/tp, out]``. ``bias`` (``[out]``, replicated) is added after the
    reduction, so it is added once; under sequence parallel its gradient is a per-rank partial
    sum (:class:`~.placement.Partial` on tp). ``weight`` is ``[out, in/tp]``.
    Raises NxdError when ``in_features`` does not divide by tp, ValueError for
    ``sequence_parallel`` without ``input_is_parallel``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group,
        input_is_parallel: bool = False,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        tp, rank = group_size(group), group_rank(group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel RowParallelLinear needs input_is_parallel=True")
        if in_features % tp:
            raise NxdError(f"input size {in_features} is not divisible by the tensor-parallel size {tp}")
        self.in_features, self.out_features = in_features, out_features
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.placements = {"weight": Placement((out_features, in_features), ((TP, Shard(1, tp, rank)),))}
        self.weight = _new_param((out_features, in_features // tp), device, dtype)
        if bias:
            self.placements["bias"] = Placement((out_features,), ((TP, Partial()),) if sequence_parallel else ())
            self.bias = _new_param((out_features,), device, dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    # The forward in three steps, so a layer wrapping this one (sharded LoRA) reuses its collectives.

    def parallel_input(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's input slice ``[*, in/tp]``: ``x`` with ``input_is_parallel``, else split here."""
        return x if self.input_is_parallel else scatter_to_tp(x, self.group)

    def local_partial(self, x_l: torch.Tensor) -> torch.Tensor:
        """This rank's partial product ``x_l W_l^T`` (a fresh tensor, for :meth:`reduce`)."""
        return F.linear(x_l, self.weight)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial products: all-reduce, or reduce-scatter on the sequence dim under
        sequence parallel. ``partial`` must be a fresh tensor (summed in place)."""
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(partial, self.group)
        return reduce_from_tp_(partial, self.group)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """The bias, once, after the reduction."""
        return y + self.bias if self.bias is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(self.reduce(self.local_partial(self.parallel_input(x))))


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split in contiguous ranges over the TP group.

    Rank ``r`` holds rows ``[r*V/tp, (r+1)*V/tp)`` (``weight [V/tp, H]``). Input ids ``[B, T]``
    (any shape) replicated on the TP ranks; ids outside this rank's range look up zeros, and the
    per-rank results are summed: all-reduce -> ``[B, T, H]``, or with ``sequence_parallel``
    reduce-scatter -> ``[B, T/tp, H]``. Raises NxdError when the vocabulary does not divide by tp.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group,
        sequence_parallel: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        tp, rank = group_size(group), group_rank(group)
        if num_embeddings % tp:
            raise NxdError(f"vocab_size {num_embeddings} is not divisible by the tensor-parallel size {tp}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.sequence_parallel = group, sequence_parallel
        per_rank = num_embeddings // tp
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.placements = {"weight": Placement((num_embeddings, embedding_dim), ((TP, Shard(0, tp, rank)),))}
        self.weight = _new_param((per_rank, embedding_dim), device, dtype)
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight)

    full_shape = _ParallelLinearBase.full_shape

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group, **kwargs) -> VocabParallelEmbedding:
        """A sharded copy of ``emb`` (only plain embeddings: no padding_idx, max_norm)."""
        if emb.padding_idx is not None or emb.max_norm is not None:
            raise ValueError("VocabParallelEmbedding supports neither padding_idx nor max_norm")
        layer = cls(
            emb.num_embeddings,
            emb.embedding_dim,
            group=group,
            device=emb.weight.device,
            dtype=emb.weight.dtype,
            **kwargs,
        )
        if emb.weight.device.type != "meta":
            with torch.no_grad():
                layer.weight.copy_(shard_tensor(emb.weight, layer.placements["weight"]))
        return layer

    def lookup(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``local`` (ids within its range)."""
        return F.embedding(local, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = self.lookup(local).masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.group)
        return reduce_from_tp_(out, self.group)  # out: masked_fill's own output

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, vocab=[{self.vocab_start}, {self.vocab_end})"

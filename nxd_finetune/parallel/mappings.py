"""Collectives as autograd functions, each with a one-line contract (Megatron ``mappings.py``).

Tensor-parallel region (TP shards a layer's weights; activations are replicated or split on the
last dim):

- ``CopyToTP``:      forward identity;                    backward all-reduce (sum).
- ``ReduceFromTP``:  forward all-reduce (sum);            backward identity.
  ``reduce_from_tp_`` sums into its input instead of a copy, for a fresh output nothing else uses
  (a row-parallel matmul's): one hidden-wide tensor less per call on every rank.
- ``ScatterToTP``:   forward keep this rank's last-dim chunk; backward all-gather on the last dim.
- ``GatherFromTP``:  forward all-gather on the last dim;  backward keep this rank's chunk.

Sequence-parallel region (activations ``[B, T, H]`` split on the sequence dim, ``SEQ_DIM = 1``):

- ``GatherFromSequence``:       forward all-gather;      backward reduce-scatter (sum).
- ``ReduceScatterToSequence``:  forward reduce-scatter (sum); backward all-gather.

Use the lower-case wrappers (``copy_to_tp(x, group)``...): on a group of size one they return the
input unchanged and issue no collective. ``group=None`` means "no process group" and is valid
only in a single process; ranks hold chunks in group-rank order. A dim that does not divide by the
group size raises NxdError naming the sizes (for the sequence dim: sequence length vs tp).

All collectives here (all_reduce, all_gather into one tensor, reduce_scatter into one tensor)
work on gloo in torch 2.13 (checked on CPU); torch 2.13 names the single-tensor ones
``all_gather_single`` / ``reduce_scatter_single`` and deprecates ``*_into_tensor`` /
``*_tensor``, which older torch releases still need, hence the lookup below.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nxd_finetune.errors import NxdError

SEQ_DIM = 1

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; 1 for ``None``, which is only valid without a multi-rank world."""
    if group is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("group=None in a multi-process world: pass the group explicitly (state.group('tp'))")
        return 1
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group`` (0 for ``None``)."""
    return 0 if group_size(group) == 1 else dist.get_rank(group)


def _check_divisible(x: torch.Tensor, dim: int, world: int) -> None:
    if x.shape[dim] % world:
        what = "sequence length" if dim == SEQ_DIM and x.dim() == 3 else f"dim {dim} of size"
        raise NxdError(f"{what} {x.shape[dim]} is not divisible by the tensor-parallel size {world}")


# The raw collectives below run under no_grad on detached tensors: autograd is the job of the
# Function classes, and gloo's single-tensor all-gather fails on inputs that require grad.


@torch.no_grad()
def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None,
                op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum over ``group`` into a new tensor (the input is never modified)."""
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


@torch.no_grad()
def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in group-rank order."""
    world = group_size(group)
    front = x.detach().movedim(dim, 0).contiguous()
    out = front.new_empty((world * front.shape[0], *front.shape[1:]))
    _all_gather_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


@torch.no_grad()
def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ``group``, then keep this rank's chunk along ``dim``."""
    world = group_size(group)
    _check_divisible(x, dim, world)
    front = x.detach().movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // world, *front.shape[1:]))
    _reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication)."""
    world = group_size(group)
    _check_divisible(x, dim, world)
    return x.chunk(world, dim=dim)[group_rank(group)].contiguous()


class CopyToTP(torch.autograd.Function):
    """Forward identity; backward all-reduce (sum) over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce (sum) over the TP group; backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceFromTPInPlace(ReduceFromTP):
    """:class:`ReduceFromTP` summing into its input (marked dirty): no copy; the same backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        dist.all_reduce(x.detach(), group=group)
        return x


class ScatterToTP(torch.autograd.Function):
    """Forward keep this rank's chunk of the last dim; backward all-gather on the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group), None


class GatherFromTP(torch.autograd.Function):
    """Forward all-gather on the last dim; backward keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class GatherFromSequence(torch.autograd.Function):
    """Forward all-gather on the sequence dim; backward reduce-scatter (sum) on it.

    The backward sums because the gathered tensor feeds a TP-sharded layer, whose input gradient
    on each rank is a partial sum over its weight shard.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, SEQ_DIM, ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Forward reduce-scatter (sum) on the sequence dim; backward all-gather on it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else ReduceFromTP.apply(x, group)


def reduce_from_tp_(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """:func:`reduce_from_tp` summing into ``x`` itself: for a fresh tensor the caller does not use
    again and autograd has not saved (a matmul's output). A view or a non-contiguous ``x`` is
    summed into a copy; a saved one makes backward raise autograd's in-place error."""
    if group_size(group) == 1:
        return x
    if x._base is not None or not x.is_contiguous():
        return ReduceFromTP.apply(x, group)
    return ReduceFromTPInPlace.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else ScatterToTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else GatherFromTP.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else ReduceScatterToSequence.apply(x, group)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ``group`` into a new tensor (no autograd)."""
    return x if group_size(group) == 1 else _all_reduce(x, group)


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (no autograd; for export and tests)."""
    return x if group_size(group) == 1 else _all_gather(x, dim, group)

"""Data-parallel gradient reduction: bucketed all-reduce with SUM semantics.

The trainer normalises every micro-batch loss by the number of target tokens of the *whole*
optimizer step over all data-parallel ranks (:func:`allreduce_scalar_sum` gives that count), so
each rank's gradient is already its share of the global token-mean and the ranks' gradients must
be **summed**, not averaged. ``average=True`` divides by the dp size instead, for losses that are
a per-rank mean (the DDP convention).

Both functions are collective over the group: every rank calls them in the same order with
parameters in the same order. A group of size one issues no collective.
:func:`reduce_data_parallel` asks each parameter's placement which data axes to sum over (every
one for a dense weight; an expert weight sharded over an expert axis skips that axis).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from nxd_finetune.parallel.mappings import all_reduce_sum, group_size
from nxd_finetune.parallel.placement import Placement, placement_of
from nxd_finetune.parallel.state import ParallelState

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def dp_sum(t: torch.Tensor, state: ParallelState, maxed: int = 0) -> torch.Tensor:
    """``t`` summed over ``state``'s data-parallel group, as a new tensor (``t`` itself at dp == 1;
    no autograd): the step's counts and logged losses of the trainer and the Lightning modules.
    ``maxed``: the last entries of a 1-d ``t`` taken as the maximum over the group instead (an
    objective's :func:`~nxd_finetune.objective.maxed_entries` metrics)."""
    if state.size("dp") == 1:
        return t
    out = t.detach().clone()
    dist.all_reduce(out, group=state.group("dp"))
    if maxed:
        top = t.detach()[-maxed:].clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=state.group("dp"))
        out[-maxed:] = top
    return out


def allreduce_scalar_sum(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` summed over ``group``, as a new tensor (the input is left alone; no autograd).

    For counts (target tokens of the step: integer tensors are fine on gloo and nccl) and for
    logging sums. Returns ``t`` itself on a group of size one.
    """
    return all_reduce_sum(t, group)


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype/device gradients of at most ``bucket_bytes`` each (a larger
    gradient gets a bucket of its own). The order is the parameters' order, hence the same on every rank."""
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[torch.Tensor], int]] = {}
    done: list[list[torch.Tensor]] = []
    for g in grads:
        key = (g.dtype, g.device)
        bucket, size = open_buckets.get(key, ([], 0))
        nbytes = g.numel() * g.element_size()
        if bucket and size + nbytes > bucket_bytes:
            done.append(bucket)
            bucket, size = [], 0
        bucket.append(g)
        open_buckets[key] = (bucket, size + nbytes)
    done.extend(bucket for bucket, _ in open_buckets.values() if bucket)
    return done


@torch.no_grad()
def allreduce_gradients(
    params: Iterable[torch.Tensor],
    dp_group,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    average: bool = False,
    divide_by: int | None = None,
) -> int:
    """Sum the ``.grad`` of ``params`` over ``dp_group`` in place; returns the number of collectives.

    Gradients are grouped by dtype (and device) into buckets of about ``bucket_bytes``; each
    bucket is flattened into one buffer, all-reduced (SUM) once and copied back. Parameters
    without a gradient (frozen ones) are skipped, so whether a parameter has a gradient must be
    the same on every rank. ``average=True`` divides by the group size after the sum (by
    ``divide_by`` when given: the whole data-parallel degree for a smaller group). Duplicate
    parameters (tied weights) are reduced once. Raises ValueError for sparse gradients.
    """
    world = group_size(dp_group)
    seen: set[int] = set()
    grads = []
    for p in params:
        if p.grad is None or id(p) in seen:
            continue
        seen.add(id(p))
        if p.grad.is_sparse:
            raise ValueError("allreduce_gradients does not support sparse gradients")
        grads.append(p.grad)
    if world == 1:
        return 0
    buckets = _buckets(grads, bucket_bytes)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=dp_group)
        if average:
            flat.div_(divide_by or world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    return len(buckets)


def reduce_groups(params: Iterable[torch.Tensor], state: ParallelState,
                  placements: Mapping[int, Placement]) -> dict[tuple[str, ...], list[torch.Tensor]]:
    """``params`` by the data axes their gradients are summed over
    (:meth:`~.placement.Placement.summed_over`), in order of first appearance."""
    out: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for p in params:
        out.setdefault(placement_of(p, placements).summed_over(state.layout), []).append(p)
    return out


@torch.no_grad()
def reduce_data_parallel(params: Iterable[torch.Tensor], state: ParallelState, placements: Mapping[int, Placement],
                         average: bool = False) -> int:
    """:func:`allreduce_gradients` of every parameter over the data axes its placement says, the
    mean (``average``) over the whole data-parallel degree; returns the number of collectives."""
    divide_by = state.size_over(state.layout.data_axes)
    return sum(allreduce_gradients(ps, state.group_over(axes), average=average, divide_by=divide_by)
               for axes, ps in reduce_groups(params, state, placements).items())

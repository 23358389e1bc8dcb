"""Gradient-norm clipping over every parallel axis, read from the parameters' placements.

The global L2 norm counts every parameter of the unsharded model exactly once. The squares are
summed over the axes :func:`norm_axes` names, and a rank's copy of a parameter is counted there as
:meth:`~.placement.Placement.counted_at` says:

- a model axis (tp): a sharded parameter contributes its local shard; a shard replicated over
  ``replicas`` consecutive ranks (KV heads when tp exceeds their count) only on the first rank of
  each block; a replicated or partial one (norms, biases of row-parallel layers) on coordinate 0
  only. This needs the partial gradients summed first (``allreduce_replicated_grads``);
- a stage axis (pp): stages hold disjoint layers, each counts its own. A weight tied across stages
  (embeddings with ``pp > 1``) has a copy on two stages: pass the second copy in ``not_counted``
  (it is clipped, not counted; ``PipelineRunner.grad_norm_parameters`` lists the counted ones);
- a data axis (dp): after :func:`~nxd_finetune.parallel.data_parallel.allreduce_gradients` every
  rank of the axis holds the same gradient of a parameter not sharded on it, so the axis is summed
  only when some parameter is sharded on it (an expert weight); with ZeRO-1 each rank holds a
  disjoint slice of the reduced gradient, so every data axis is summed (:func:`clip_grad_norm_zero1`).

Placements live on modules, so these functions take the model (or a ``{id(param): Placement}``
map from :func:`~.placement.placement_map`) to know how each parameter lies.
Norms are accumulated in float32 whatever the gradient dtype; the returned norm is a 0-dim
float32 tensor (no ``.item()``, so no host sync). Every rank of the world must call them (collective).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune.parallel.placement import Placement, Shard, placement_map, placement_of
from nxd_finetune.parallel.state import ParallelState

PlacementMap = dict[int, Placement]

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


class GradShards(Protocol):
    """The reduced gradient shards of a ZeRO-1 optimizer (:class:`~.zero1.Zero1Optimizer`)."""

    def local_grad_slices(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, this rank's slice of its reduced gradient)`` pairs."""
        ...

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient shards, clipped in place."""
        ...


def norm_axes(state: ParallelState, placements: Iterable[Placement], zero1: bool = False) -> list[str]:
    """The axes a sum over this rank's parameters (a gradient norm, a parameter count) is
    all-reduced over, in order: the data axes (every one with ``zero1``, else those some parameter
    is sharded on), then the model axes, then the stage axes, innermost first; degree-one axes left
    out. The same on every rank of each of those axes' groups."""
    layout = state.layout
    placed = list(placements)
    data = [a for a in layout.of_kind("data")
            if zero1 or any(isinstance(p.along(a), Shard) for p in placed)]
    axes = data + list(layout.of_kind("model")) + list(layout.of_kind("stage"))
    return [a for a in axes if layout.degree(a) > 1]


def counts_on_rank(placement: Placement, state: ParallelState, axes: Iterable[str], zero1: bool = False) -> bool:
    """Whether this rank's copy of a parameter enters a sum over ``axes`` (:func:`norm_axes`); with
    ``zero1`` its ZeRO-1 slices (over :meth:`~.placement.Placement.summed_over`) all do."""
    layout = state.layout
    partitioned = placement.summed_over(layout) if zero1 else ()
    return placement.counted_at({a: state.coord(a) for a in layout.names}, axes, layout, partitioned)


def _specs(specs: PlacementMap | nn.Module | None, state: ParallelState) -> PlacementMap:
    if isinstance(specs, nn.Module):
        return placement_map(specs)
    if specs is None and any(state.size(a) > 1 for a in state.layout.of_kind("model")):
        raise ValueError("with tp > 1 the norm needs the sharding metadata: pass the model or placement_map(model)")
    return specs or {}


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """Sum of squared elements of ``tensors`` in float32 (a 0-dim tensor)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    parts = [torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32)).square().sum() for ts in by_device.values()]
    out = parts[0]
    for part in parts[1:]:
        out = out + part.to(out.device)
    return out


def _allreduce(x: torch.Tensor, state: ParallelState, axes: list[str]) -> torch.Tensor:
    for axis in axes:
        dist.all_reduce(x, group=state.group(axis))
    return x


@torch.no_grad()
def _scale(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Multiply ``grads`` by ``min(1, max_norm / (total + eps))`` without a host sync."""
    coef = (max_norm / (total + EPS)).clamp(max=1.0)
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), gs in by_key.items():
        torch._foreach_mul_(gs, coef.to(device=device, dtype=dtype))


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.Tensor] | nn.Module, max_norm: float | None, state: ParallelState, *,
                   specs: PlacementMap | nn.Module | None = None,
                   not_counted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Clip ``.grad`` in place to the global L2 norm ``max_norm``; returns the norm before clipping.

    ``params``: the model (its parameters with a gradient are used, and their placements) or an
    iterable of parameters, then with ``specs`` (the model or :func:`~.placement.placement_map`),
    needed when tp > 1 (ValueError otherwise). ``state``: the ``ParallelState``. ``max_norm`` None
    or <= 0: only compute the norm. ``not_counted``: parameters clipped but left out of the norm
    (tied copies). Call after the data-parallel all-reduce, when every data-parallel rank holds the
    same gradient of what is not sharded over it (the module docstring says what is summed).
    """
    if isinstance(params, nn.Module):
        specs = params if specs is None else specs
        params = params.parameters()
    spec_map = _specs(specs, state)
    skip = {id(p) for p in not_counted}
    params = list(dict.fromkeys(params))  # de-duplicated, in order
    axes = norm_axes(state, (placement_of(p, spec_map) for p in params))
    grads, counted = [], []
    for p in params:
        if p.grad is None:
            continue
        grads.append(p.grad)
        if id(p) not in skip and counts_on_rank(placement_of(p, spec_map), state, axes):
            counted.append(p.grad)
    device = grads[0].device if grads else None
    total = _allreduce(_sum_of_squares(counted, device), state, axes).sqrt()
    if max_norm is not None and max_norm > 0 and grads:
        _scale(grads, total, max_norm)
    return total


@torch.no_grad()
def clip_grad_norm_zero1(optimizer: GradShards, max_norm: float | None, state: ParallelState, *,
                         specs: PlacementMap | nn.Module | None = None,
                         not_counted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """The ZeRO-1 variant: the norm over the reduced gradient *shards* of a
    :class:`~nxd_finetune.parallel.zero1.Zero1Optimizer` (each parameter partitioned over the data
    axes it is not sharded on), summed over every data axis, the model axes (each parameter once)
    and the stages; the shards (fp32 master gradients) are clipped in place. Call between
    ``optimizer.reduce_gradients()`` and ``optimizer.step()`` (or use ``optimizer.clip_grad_norm``).
    ``specs``: the model or :func:`~.placement.placement_map` (needed when tp > 1); ``not_counted``
    as for :func:`clip_grad_norm`. Returns the norm.
    """
    spec_map = _specs(specs, state)
    skip = {id(p) for p in not_counted}
    axes = norm_axes(state, (), zero1=True)
    counted = [g for p, g in optimizer.local_grad_slices()
               if id(p) not in skip and counts_on_rank(placement_of(p, spec_map), state, axes, zero1=True)]
    shards = optimizer.master_grads()
    device = shards[0].device if shards else None
    total = _allreduce(_sum_of_squares(counted, device), state, axes).sqrt()
    if max_norm is not None and max_norm > 0:
        _scale(shards, total, max_norm)
    return total

"""Gradient-norm clipping over tensor-, pipeline- and data-parallel groups.

The global L2 norm counts every parameter of the unsharded model exactly once:

- a TP-sharded parameter (``ShardSpec.partition_dim`` set) contributes its local shard, summed
  over the TP group; when a shard is replicated over ``replicas`` consecutive TP ranks (KV heads
  when tp exceeds their count) only the first rank of each block counts it;
- a TP-replicated parameter (``partition_dim`` None, or no ``ShardSpec`` at all: norms, biases of
  row-parallel layers) is counted on TP rank 0 only. This needs the replicated gradients to be
  equal on every TP rank, i.e. ``allreduce_replicated_grads`` has run;
- pipeline stages hold disjoint layers: summed over the PP group. A weight tied across stages
  (embeddings with ``pp > 1``) has a copy on two stages: pass the second copy in ``not_counted``
  (it is clipped, not counted; ``PipelineRunner.grad_norm_parameters`` lists the counted ones);
- data parallel: after :func:`~nxd_finetune.parallel.data_parallel.allreduce_gradients` every dp
  rank holds the same full gradient, so dp is *not* summed (:func:`clip_grad_norm`); with ZeRO-1
  each dp rank holds a disjoint shard of the reduced gradient, so the shards' squares are summed
  over dp as well (:func:`clip_grad_norm_zero1`).

Sharding metadata lives on modules (``shard_specs``), so these functions take the model (or a
``{id(param): ShardSpec}`` map from :func:`shard_spec_map`) to know how each parameter is split.
Norms are accumulated in float32 whatever the gradient dtype; the returned norm is a 0-dim
float32 tensor (no ``.item()``, so no host sync). Every rank of the world must call them (collective).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from nxd_finetune.parallel.layers import ShardSpec, iter_shard_specs
from nxd_finetune.parallel.state import ParallelState

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


class GradShards(Protocol):
    """The reduced gradient shards of a ZeRO-1 optimizer (:class:`~.zero1.Zero1Optimizer`)."""

    def local_grad_slices(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, this rank's slice of its reduced gradient)`` pairs."""
        ...

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient shards, clipped in place."""
        ...


def shard_spec_map(model: nn.Module) -> dict[int, ShardSpec]:
    """``{id(parameter): ShardSpec}`` for the parameters of ``model`` that carry sharding metadata."""
    return {id(module._parameters[attr]): spec for _, module, attr, spec in iter_shard_specs(model)}


def counts_on_rank(spec: ShardSpec | None, tp_rank: int) -> bool:
    """Whether this TP rank's copy of a parameter is the one that enters the global norm."""
    if spec is None or spec.partition_dim is None:
        return tp_rank == 0
    return tp_rank % spec.replicas == 0


def _specs(specs: dict[int, ShardSpec] | nn.Module | None, state: ParallelState) -> dict[int, ShardSpec] | None:
    if isinstance(specs, nn.Module):
        return shard_spec_map(specs)
    if specs is None and state.size("tp") > 1:
        raise ValueError("with tp > 1 the norm needs the sharding metadata: pass the model or shard_spec_map(model)")
    return specs


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


def _allreduce(x: torch.Tensor, groups: list[tuple[ProcessGroup | None, int]]) -> torch.Tensor:
    for group, size in groups:
        if size > 1:
            dist.all_reduce(x, group=group)
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
                   specs: dict[int, ShardSpec] | nn.Module | None = None,
                   not_counted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Clip ``.grad`` in place to the global L2 norm ``max_norm``; returns the norm before clipping.

    ``params``: the model (its parameters with a gradient are used, and its ``shard_specs``) or
    an iterable of parameters, then with ``specs`` (the model or :func:`shard_spec_map`), needed
    when tp > 1 (ValueError otherwise). ``state``: the ``ParallelState``. ``max_norm`` None or
    <= 0: only compute the norm. ``not_counted``: parameters clipped but left out of the norm
    (tied copies). The norm is summed over tp (each parameter once) and pp, not over dp: call
    after the data-parallel all-reduce, when every dp rank holds the same gradient.
    """
    if isinstance(params, nn.Module):
        specs = params if specs is None else specs
        params = params.parameters()
    spec_map = _specs(specs, state) or {}
    skip = {id(p) for p in not_counted}
    grads, counted = [], []
    for p in dict.fromkeys(params):  # de-duplicated, in order
        if p.grad is None:
            continue
        grads.append(p.grad)
        if id(p) not in skip and counts_on_rank(spec_map.get(id(p)), state.coord("tp")):
            counted.append(p.grad)
    device = grads[0].device if grads else None
    total = _allreduce(_sum_of_squares(counted, device), [(state.group("tp"), state.size("tp")),
                                                          (state.group("pp"), state.size("pp"))]).sqrt()
    if max_norm is not None and max_norm > 0 and grads:
        _scale(grads, total, max_norm)
    return total


@torch.no_grad()
def clip_grad_norm_zero1(optimizer: GradShards, max_norm: float | None, state: ParallelState, *,
                         specs: dict[int, ShardSpec] | nn.Module | None = None,
                         not_counted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """The ZeRO-1 variant: the norm over the reduced gradient *shards* of a
    :class:`~nxd_finetune.parallel.zero1.Zero1Optimizer`, summed over dp, tp (each parameter
    once) and pp; the shards (fp32 master gradients) are clipped in place. Call between
    ``optimizer.reduce_gradients()`` and ``optimizer.step()`` (or use ``optimizer.clip_grad_norm``).
    ``specs``: the model or :func:`shard_spec_map` (needed when tp > 1); ``not_counted`` as for
    :func:`clip_grad_norm`. Returns the norm.
    """
    spec_map = _specs(specs, state) or {}
    skip = {id(p) for p in not_counted}
    counted = [g for p, g in optimizer.local_grad_slices()
               if id(p) not in skip and counts_on_rank(spec_map.get(id(p)), state.coord("tp"))]
    shards = optimizer.master_grads()
    device = shards[0].device if shards else None
    groups = [(state.group(axis), state.size(axis)) for axis in ("dp", "tp", "pp")]
    total = _allreduce(_sum_of_squares(counted, device), groups).sqrt()
    if max_norm is not None and max_norm > 0:
        _scale(shards, total, max_norm)
    return total

"""Expert parallel: a mixture-of-experts model's experts split over the ``ep`` axis.

``ep`` ranks are carved out of ``dp`` (:meth:`~.state.Layout.of`): each of them holds
``num_experts / ep`` consecutive experts (``gate_up_proj`` / ``down_proj`` ``Shard(0)`` over ``ep``,
replicated over ``edp``, the ranks holding the same experts) and trains on its own data, as a
data-parallel rank does. The router is replicated (its gradient, like every dense one, is summed
over the whole ``dp``); an expert's gradient is summed over ``edp``. Readers of placements
(reduction, ZeRO-1, clipping, checkpoints, export, LoRA I/O) need nothing else.

A forward (:class:`AllToAllExchange`, dropless, as transformers' block computes): the (token,
expert) pairs sorted by expert are sent to the ranks holding their experts
(``all_to_all_single``, uneven splits, which gloo has too), regrouped there by expert, run through
the held experts' grouped GEMMs, regrouped back and returned with a second all-to-all; the
router weights and the sum over each token's k experts stay on the token's rank. Both all-to-alls
are autograd functions whose backward is the reverse all-to-all, so an expert's gradient there
covers every rank's rows routed to it.

Under tensor parallel (without sequence parallel) the MoE block's input is replicated over tp, so
the router and the experts stay whole on every tp rank (the plans' ``replicate``): each tp rank
runs its own exchange over its own ``ep`` group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.models.moe import Experts, GroupFn
from nxd_finetune.parallel.placement import Placement, Shard
from nxd_finetune.parallel.state import ParallelState, ProcessGroup

EP = "ep"


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows with uneven splits; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, out_splits: list[int],
                in_splits: list[int], group: ProcessGroup | None) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits, group)  # type: ignore[attr-defined]
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits, group = ctx.splits  # type: ignore[attr-defined]
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, group), None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group: ProcessGroup | None) -> torch.Tensor:
    """``x``'s rows, ``in_splits[r]`` of them to rank ``r`` of ``group``, in rank order; returns
    the rows received, ``out_splits[r]`` from rank ``r``. Autograd: the gradient goes back the same way."""
    out = _AllToAll.apply(x, out_splits, in_splits, group)
    assert isinstance(out, torch.Tensor)
    return out


class AllToAllExchange:
    """:class:`~nxd_finetune.models.moe.Exchange` over an ``ep`` group of ``size`` ranks, each
    holding ``num_experts / size`` consecutive experts."""

    def __init__(self, group: ProcessGroup | None, size: int, num_experts: int) -> None:
        self.group, self.size, self.held = group, size, num_experts // size

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, run: GroupFn) -> torch.Tensor:
        per_rank = counts.view(self.size, self.held)  # [destination, held expert]
        received = torch.empty_like(per_rank)  # [source, held expert]: the pairs each rank sends here
        dist.all_to_all_single(received, per_rank.contiguous(), group=self.group)
        send = per_rank.sum(1).tolist()
        recv = received.sum(1).tolist()
        got = all_to_all_rows(rows, recv, send, self.group)  # grouped by source, then expert
        order = regroup_by_expert(received)
        out = run(got[order], received.sum(0))  # grouped by expert, then source
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_rows(out[back], send, recv, self.group)


def regroup_by_expert(blocks: torch.Tensor) -> torch.Tensor:
    """For rows laid out by ``[source, expert]`` blocks of ``blocks[s, e]`` rows, the row indices
    that lay them out by ``[expert, source]`` (each block's rows kept in order)."""
    sizes = blocks.reshape(-1)
    starts = (torch.cumsum(sizes, 0) - sizes).view_as(blocks)
    sizes_t, starts_t = blocks.t().reshape(-1), starts.t().reshape(-1)
    total = int(sizes.sum())
    shift = torch.repeat_interleave(starts_t - (torch.cumsum(sizes_t, 0) - sizes_t), sizes_t, output_size=total)
    return torch.arange(total, device=blocks.device) + shift


def apply_expert_parallel(model: nn.Module, state: ParallelState) -> int:
    """Split every :class:`~nxd_finetune.models.moe.Experts` of ``model`` over ``state``'s ``ep``
    axis: its tensors become this rank's experts (meta tensors stay on meta; real ones are sliced)
    with ``Shard(0)`` placements on ``ep``, and an :class:`AllToAllExchange` runs its forward.
    Before LoRA injection (the expert LoRA factors follow the tensors' placements) and the stage
    cut. Returns the number of experts modules split (0 without an ``ep`` axis, or ep 1). NxdError
    when ``ep`` does not divide the expert count."""
    if EP not in state.layout.names or state.size(EP) == 1:
        return 0
    size, coord = state.size(EP), state.coord(EP)
    blocks = [m for m in model.modules() if isinstance(m, Experts)]
    for experts in blocks:
        e = experts.num_experts
        if e % size:
            raise NxdError(f"parallel.ep={size} does not divide the model's {e} experts")
        placements = {}
        for attr in ("gate_up_proj", "down_proj"):
            param = getattr(experts, attr)
            placement = Placement(tuple(param.shape), ((EP, Shard(0, size, coord)),))
            local = param if param.device.type == "meta" else param.detach()
            sliced = (torch.empty(placement.local_shape, device="meta", dtype=param.dtype)
                      if local.device.type == "meta" else placement.take(local).clone())
            setattr(experts, attr, nn.Parameter(sliced, requires_grad=param.requires_grad))
            placements[attr] = placement
        experts.placements = placements  # type: ignore[assignment]  # a plain attribute, as the TP layers'
        step = e // size
        experts.held = range(coord * step, (coord + 1) * step)
        experts.exchange = AllToAllExchange(state.group(EP), size, e)
    return len(blocks)

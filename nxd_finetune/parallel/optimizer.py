"""The parallel optimizer: the work between ``backward`` and the optimizer's own step.

:class:`ParallelOptimizer` wraps any ``torch.optim.Optimizer`` class. Its ``step``:

1. sums the partial gradients over model axes (``allreduce_replicated_grads``);
2. reduces each gradient over the data axes its placement says (``Placement.summed_over``: dp for
   every parameter today): a bucketed all-reduce, or with ZeRO-1 into the
   :class:`~.zero1.Zero1Optimizer` shards (``grad_reduction``: ``mean`` as DDP, or ``sum`` when the
   losses are already divided by the global token count, as the trainer's are);
3. with ``max_grad_norm``: clips to it over every axis (:mod:`.clip`); the norm before clipping is
   kept in ``grad_norm``. ``not_counted``: parameters clipped but left out of the norm (the last
   pipeline stage's tied ``lm_head`` copy, which stage 0's embedding already counts);
4. the wrapped optimizer's step.

``param_groups``, ``state``, ``state_dict`` ... are the wrapped optimizer's (the ZeRO-1 one with
``zero1``), so LR schedulers and checkpoints work unchanged. Used by the trainer's engine and by
the NxD-style API alike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import ParamsT, StateDict

from nxd_finetune.errors import NxdError
from nxd_finetune.parallel.clip import clip_grad_norm, clip_grad_norm_zero1
from nxd_finetune.parallel.data_parallel import reduce_data_parallel
from nxd_finetune.parallel.placement import placement_map, placement_of
from nxd_finetune.parallel.plan import allreduce_replicated_grads
from nxd_finetune.parallel.state import ParallelState
from nxd_finetune.parallel.zero1 import Hyperparameter, ParamGroup, Zero1Optimizer

GradReduction = Literal["mean", "sum"]


class ParallelOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **defaults)`` (sharded over dp by ZeRO-1 with ``zero1``) with the
    parallel gradient work before its step (see the module docstring).

    ``model``: the module (or ``nn.ModuleList`` of pipeline stages) whose sharded layers and
    TP-replicated parameters the gradients belong to; None only without tensor parallel.
    ``not_counted``: a callable returning the parameters to leave out of the norm, read at the
    first step (a pipeline runner's tied head copy)."""

    def __init__(
        self,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        params: ParamsT,
        *,
        state: ParallelState,
        model: nn.Module | None,
        zero1: bool = False,
        grad_reduction: GradReduction = "mean",
        max_grad_norm: float | None = None,
        not_counted: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]] = (),
        **defaults: Hyperparameter,
    ) -> None:
        # no Optimizer.__init__: everything is delegated to the wrapped optimizer
        if grad_reduction not in ("mean", "sum"):
            raise NxdError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
        if model is None and state.size("tp") > 1:
            raise NxdError("tensor parallel needs the model: build it before the optimizer")
        self.parallel_state = state
        self.model = model
        self.zero1 = zero1
        self.average = grad_reduction == "mean"
        self.max_norm = max_grad_norm
        self._not_counted = not_counted
        self.not_counted: list[torch.Tensor] = list(not_counted) if not callable(not_counted) else []
        self.optimizer: torch.optim.Optimizer
        placements = placement_map(model) if model is not None else {}
        if zero1:
            data = state.layout.data_axes

            def reduce_group(p: torch.Tensor) -> tuple[dist.ProcessGroup | None, int]:
                axes = placement_of(p, placements).summed_over(state.layout)
                return state.group_over(axes), state.size_over(axes)

            # mypy cannot tell the hyperparameters in ``defaults`` from Zero1Optimizer's own keywords
            self.optimizer = Zero1Optimizer(params, optimizer_class, state.group_over(data), average=self.average,
                                            reduce_group=reduce_group, **defaults)  # type: ignore[arg-type]
        else:
            self.optimizer = optimizer_class(params, **defaults)
        self.grad_norm: torch.Tensor | None = None

    # torch's stub declares these as writeable attributes; here they forward to the wrapped optimizer
    @property
    def param_groups(self) -> list[ParamGroup]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> defaultdict[torch.Tensor, StateDict]:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Hyperparameter]:  # type: ignore[override]
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> StateDict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: StateDict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: ParamGroup) -> None:
        if self.zero1:
            raise NxdError("add_param_group is not supported with ZeRO-1: pass every group at construction")
        self.optimizer.add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state, model = self.parallel_state, self.model
        if callable(self._not_counted) and not self.not_counted:
            self.not_counted = list(self._not_counted())
        if model is not None:
            allreduce_replicated_grads(model, state)
        if self.zero1:
            assert isinstance(self.optimizer, Zero1Optimizer)
            self.optimizer.reduce_gradients()
            if self.max_norm is not None:
                self.grad_norm = clip_grad_norm_zero1(self.optimizer, self.max_norm, state, specs=model,
                                                      not_counted=self.not_counted)
        else:
            params = [p for g in self.param_groups for p in g["params"]]
            reduce_data_parallel(params, state, placement_map(model) if model is not None else {}, self.average)
            if self.max_norm is not None:
                self.grad_norm = clip_grad_norm(params, self.max_norm, state, specs=model,
                                                not_counted=self.not_counted)
        self.optimizer.step()
        return loss

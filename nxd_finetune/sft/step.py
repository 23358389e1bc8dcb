"""One training step, the same for ``nxd-finetune run`` and the Lightning module, and the grouping
of the loader's micro-batches into steps (:func:`step_batches`).

:func:`train_step` takes this rank's micro-batches of one optimizer step: it counts the
objective's units (target tokens for SFT) over the micro-batches and every data-parallel rank,
runs the engine's forward and backward (micro-batch losses divided by that count, through the
pipeline schedule at ``pp > 1``), then the optimizer step (the engine's: gradient reductions,
clipping, AdamW, the LR step; or the caller's, e.g. Lightning's through its precision plugin).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from nxd_finetune.data.loader import TrainLoader
from nxd_finetune.objective import Objective, TokenBatch


class Stepper(Protocol):
    """What a step runs on: the :class:`~nxd_finetune.sft.engine.Engine`, or the Lightning model
    function module's own (a user's model under the NxD-style API)."""

    objective: Objective

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor: ...

    def forward_backward(self, micro_batches: Sequence[TokenBatch], n_targets: torch.Tensor,
                         backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor: ...

    def step(self) -> torch.Tensor | None: ...


@dataclasses.dataclass
class StepResult:
    """``loss``: this dp rank's share of the step's mean loss (sum it over dp for the step loss);
    ``counts``: ``[units, input tokens]`` of the step over every dp rank (int64, on the device);
    ``grad_norm``: the global gradient norm before clipping (None without clipping)."""

    loss: torch.Tensor
    counts: torch.Tensor
    grad_norm: torch.Tensor | None


def step_counts(engine: Stepper, micro_batches: Sequence[TokenBatch], n_input: int) -> torch.Tensor:
    """``[objective units, non-padding input tokens]`` of the step, summed over the dp ranks."""
    units = torch.stack([engine.objective.count(b) for b in micro_batches]).sum().to(torch.int64)
    local = torch.stack([units, torch.tensor(int(n_input), dtype=torch.int64, device=units.device)])
    return engine.dp_sum(local)


def train_step(engine: Stepper, micro_batches: Sequence[TokenBatch], n_input: int, *,
               backward: Callable[[torch.Tensor], None] | None = None,
               optimizer_step: Callable[[], torch.Tensor | None] | None = None) -> StepResult:
    """One optimizer step over ``micro_batches`` (already on the engine's device; ``n_input``: their
    non-padding tokens, counted on the host). ``backward`` / ``optimizer_step``: the caller's,
    where it owns them (Lightning); by default the engine's."""
    counts = step_counts(engine, micro_batches, n_input)
    n_units = counts[0].clamp(min=1).to(torch.float32)
    loss = engine.forward_backward(micro_batches, n_units, backward)
    grad_norm = optimizer_step() if optimizer_step is not None else engine.step()
    return StepResult(loss, counts, grad_norm)


StepItem = tuple[list[dict[str, torch.Tensor]], int]
"""One optimizer step's micro-batches and their non-padding input tokens."""


def step_batches(train_loader: TrainLoader, grad_accum: int, packing: bool) -> Iterator[StepItem]:
    """Group the endless micro-batch stream into optimizer steps. Unpacked rows hold one sample
    each and are right-padded, so causal attention alone already keeps tokens off the padding:
    their segment ids are dropped to keep the fast ``is_causal`` attention path."""
    it = iter(train_loader)
    while True:
        step, n_tokens = [], 0
        for _ in range(grad_accum):
            batch = next(it)
            # preference pairs are unpacked and carry no segment ids: every position counts
            n_tokens += int((batch["segment_ids"] > 0).sum()) if "segment_ids" in batch else batch["input_ids"].numel()
            if not packing:
                batch = {k: v for k, v in batch.items() if k != "segment_ids"}
            step.append(batch)
        yield step, n_tokens

"""One training step, the same for ``nxd-finetune run`` and the Lightning module, and the grouping
of the loader's micro-batches into steps (:func:`step_batches`).

:func:`train_step` takes this rank's micro-batches of one optimizer step: it counts the
objective's units (target tokens for SFT) over the micro-batches and every data-parallel rank,
runs the engine's forward and backward (micro-batch losses divided by that count, through the
pipeline schedule at ``pp > 1``), then the optimizer step (the engine's: gradient reductions,
clipping, AdamW, the LR step; or the caller's, e.g. Lightning's through its precision plugin).
:func:`stop_if_diverged` ends a run at the first step whose loss or gradient norm is NaN or
infinite, in one line, before the value reaches a metrics file or a checkpoint.
:func:`backward_micro_batches` is the micro-batch loop of a whole model (the engine's at pp == 1,
the Lightning model-function module's), :class:`StepLog` the step's bookkeeping (counters, the
logged record, the history) of ``run``'s loop and of both Lightning modules.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from nxd_finetune.checkpoint.run_state import TrainState
from nxd_finetune.data.loader import TrainLoader
from nxd_finetune.data.pairs import pair_tokens
from nxd_finetune.errors import NxdError
from nxd_finetune.objective import Objective, TokenBatch, add_stats
from nxd_finetune.objectives import objective_record, section_of

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe


class Stepper(Protocol):
    """What a step runs on: the :class:`~nxd_finetune.sft.engine.Engine`, or the Lightning model
    function module's own (a user's model under the NxD-style API). The objective is handed to
    each call."""

    def dp_sum(self, t: torch.Tensor, maxed: int = 0) -> torch.Tensor: ...

    def forward_backward(self, micro_batches: Sequence[TokenBatch], n_targets: torch.Tensor, objective: Objective,
                         backward: Callable[[torch.Tensor], None] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def step(self) -> torch.Tensor | None: ...


@dataclasses.dataclass
class StepResult:
    """``loss``: this dp rank's share of the step's mean loss (sum it over dp for the step loss);
    ``counts``: ``[units, input tokens]`` of the step over every dp rank (int64, on the device);
    ``grad_norm``: the global gradient norm before clipping (None without clipping); ``stats``: the
    objective's metric sums over this dp rank's micro-batches (None when it has none; sum them over
    steps and dp, then ``objective.train_record``)."""

    loss: torch.Tensor
    counts: torch.Tensor
    grad_norm: torch.Tensor | None
    stats: torch.Tensor | None = None


def step_counts(engine: Stepper, objective: Objective, micro_batches: Sequence[TokenBatch],
                n_input: int) -> torch.Tensor:
    """``[objective units, non-padding input tokens]`` of the step, summed over the dp ranks."""
    units = torch.stack([objective.count(b) for b in micro_batches]).sum().to(torch.int64)
    local = torch.stack([units, torch.tensor(int(n_input), dtype=torch.int64, device=units.device)])
    return engine.dp_sum(local)


def train_step(engine: Stepper, micro_batches: Sequence[TokenBatch], n_input: int, *, objective: Objective,
               backward: Callable[[torch.Tensor], None] | None = None,
               optimizer_step: Callable[[], torch.Tensor | None] | None = None) -> StepResult:
    """One optimizer step of ``objective`` over ``micro_batches`` (already on the engine's device;
    ``n_input``: their non-padding tokens, counted on the host). ``backward`` / ``optimizer_step``:
    the caller's, where it owns them (Lightning); by default the engine's."""
    counts = step_counts(engine, objective, micro_batches, n_input)
    n_units = counts[0].clamp(min=1).to(torch.float32)
    loss, stats = engine.forward_backward(micro_batches, n_units, objective, backward)
    grad_norm = optimizer_step() if optimizer_step is not None else engine.step()
    return StepResult(loss, counts, grad_norm, stats)


def backward_micro_batches(micro_batches: Sequence[TokenBatch], n_targets: torch.Tensor,
                           loss: Callable[[TokenBatch], tuple[torch.Tensor, torch.Tensor | None]],
                           backward: Callable[[torch.Tensor], None] = torch.Tensor.backward, maxed: int = 0
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each micro-batch's objective loss (``loss(batch)``: its summed loss over the step's units and
    its metric sums, :meth:`Objective.loss`) divided by ``n_targets``, backpropagated with
    ``backward`` (gradients accumulate); returns their detached sum, on ``n_targets``' device, and
    the metric sums added up (None when the objective has none; the last ``maxed`` by max)."""
    total = torch.zeros((), device=n_targets.device)
    stats: torch.Tensor | None = None
    for batch in micro_batches:
        loss_sum, mb_stats = loss(batch)
        mb_loss = loss_sum / n_targets
        backward(mb_loss)
        total += mb_loss.detach()
        stats = add_stats(stats, mb_stats, maxed)
        del loss_sum, mb_loss  # their graph's nodes would stay through the next forward
    return total, stats


class StepLog:
    """The bookkeeping of optimizer steps, one for ``run``'s loop and the Lightning modules:
    :meth:`count` adds a step's counts to ``state`` (:class:`TrainState`, which checkpoints carry);
    :meth:`record` makes a logging step's record and appends it, with its step, to ``history``.
    ``tokens_per_s``: the input tokens counted since the last record (or :meth:`restart`) over the
    time since then."""

    def __init__(self, state: TrainState, history: list[dict[str, float]]) -> None:
        self.state, self.history = state, history
        self.restart()

    def restart(self) -> None:
        """Start the throughput window now (training starts)."""
        self._start, self._tokens = time.perf_counter(), 0

    def count(self, counts: Sequence[float]) -> None:
        """Add a step's ``[objective units, input tokens]`` over every dp rank (host numbers,
        :attr:`StepResult.counts`) to the counters."""
        n_targets, n_input = (int(c) for c in counts)
        self.state.input_tokens += n_input
        self.state.tokens += n_targets
        self._tokens += n_input

    def record(self, step: int, loss: float, lr: float, grad_norm: float | None,
               objective: Mapping[str, float] | None = None, **more: float) -> dict[str, float]:
        """Step ``step``'s record: ``train_loss``, ``lr``, ``tokens_per_s``, ``tokens`` (the target
        tokens so far), ``more`` (``run``: ``peak_host_mb``), ``grad_norm`` (when clipping), then
        the objective's own metrics (preference: rewards/...); appended to the history."""
        now = time.perf_counter()
        rec: dict[str, float] = {"train_loss": loss, "lr": lr,
                                 "tokens_per_s": self._tokens / max(now - self._start, 1e-9),
                                 "tokens": self.state.tokens, **more}
        if grad_norm is not None:
            rec["grad_norm"] = grad_norm
        rec.update(objective or {})
        self._start, self._tokens = now, 0
        self.history.append({"step": step, **rec})
        return rec


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
            # preference pairs carry no segment ids: their rows' lengths, padding not counted
            segments = batch.get("segment_ids")
            n_tokens += int((segments > 0).sum()) if segments is not None else pair_tokens(batch["labels"])
            if not packing:
                batch = {k: v for k, v in batch.items() if k != "segment_ids"}
            step.append(batch)
        yield step, n_tokens


_WHAT = {"loss": "the training loss", "grad_norm": "the gradient norm"}


def divergence_hint(recipe: Recipe) -> str:
    """What to change when a run's numbers stop being finite (the end of :func:`stop_if_diverged`'s line)."""
    t = recipe.training
    change = [f"lower training.lr (now {t.lr:g})"]
    record = objective_record(recipe.objective)
    setting = record.diverged(section_of(recipe, record))  # the objective's own scale, e.g. preference.beta
    if setting is not None:
        change.append(setting)
    clip = "" if t.grad_clip else ", or set training.grad_clip"
    return f"training diverged: {' or '.join(change)}{clip}; nothing of this step was logged or checkpointed"


def stop_if_diverged(step: int, values: Mapping[str, object], hint: str) -> None:
    """Raise NxdError (one line: ``step`` (0: before training), the first value of ``values``
    (host numbers: the step's loss and gradient norm, or an eval record) that is NaN or infinite,
    then ``hint``); return when every number is finite."""
    for name, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            where = f"step {step}" if step else "before training"
            raise NxdError(f"{where}: {_WHAT.get(name, name)} is {value}; {hint}")

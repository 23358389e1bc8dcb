"""Reference log-probs for preference tuning, computed in one pass before training.

DPO compares the policy's log-probs with a frozen reference model's. No second model is held:
before the first step, every micro-batch the run will train on (and every eval batch) goes through
the engine once in eval mode with the reference weights, and each row's summed completion log-prob
is kept in a :class:`ReferenceTable` keyed by the row's tokens. The step stream then hands each
micro-batch its ``ref_logps`` (the batch contract of :mod:`nxd_finetune.preference`).

The reference weights (:func:`nxd_finetune.recipe.reference_of`): ``base`` is the model with the
LoRA adapter path off (or, for full fine-tuning, the initial model); ``init_from`` is the adapter
the run starts from (``lora.init_from``), that is the model as it stands before the first step.
The pass runs through :meth:`Engine.eval_stats`, so it is vocab-parallel, chunked and pipelined as
the layout is: the engine's objective is swapped for :class:`RowLogps` for its duration.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from nxd_finetune.loss import IGNORE_INDEX, Scores
from nxd_finetune.objective import NoTrainStats, Objective, TokenBatch
from nxd_finetune.preference import sequence_logps
from nxd_finetune.sft.engine import Engine

StepBatches = tuple[list[dict[str, torch.Tensor]], int]


@contextlib.contextmanager
def adapter_off(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every LoRA layer of ``modules`` contributes nothing (its scaling set to 0) for the block:
    the base model's outputs, exactly, without a copy of any weight."""
    saved: list[tuple[nn.Module, float]] = []
    for root in modules:
        for m in root.modules():
            if hasattr(m, "lora_A") and isinstance(getattr(m, "scaling", None), float):
                saved.append((m, getattr(m, "scaling")))  # noqa: B009
                setattr(m, "scaling", 0.0)  # noqa: B010 (a LoRA layer's plain float attribute)
    try:
        yield
    finally:
        for m, scaling in saved:
            setattr(m, "scaling", scaling)  # noqa: B010


@dataclasses.dataclass
class RowLogps(NoTrainStats):
    """An objective whose eval statistics are the micro-batch's per-row summed log-probs
    (``[rows]``): what the reference pass reads through the engine on every layout."""

    rows: int
    inner: Objective
    name: str = "reference"

    @property
    def eval_width(self) -> int:
        return self.rows

    def target(self, batch: TokenBatch) -> torch.Tensor:
        return self.inner.target(batch)

    def labels(self, target: torch.Tensor) -> torch.Tensor:
        return self.inner.labels(target)

    def count(self, batch: TokenBatch) -> torch.Tensor:
        return self.inner.count(batch)

    def loss_sum(self, scores: Scores, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the reference pass does not train")

    def eval_stats(self, scores: Scores, target: torch.Tensor) -> torch.Tensor:
        return sequence_logps(scores, self.rows).float()

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]:
        return {}


def row_key(input_ids: torch.Tensor, labels: torch.Tensor) -> bytes:
    """One row's identity: its tokens up to its last target, and which of them are targets (the
    right padding after it, which differs from batch to batch, is left out)."""
    targets = (labels != IGNORE_INDEX).nonzero()
    end = int(targets[-1]) + 1 if targets.numel() else 0
    ids = input_ids[:end].to(torch.int64).cpu()
    mask = (labels[:end] != IGNORE_INDEX).cpu()
    return ids.numpy().tobytes() + b"|" + mask.numpy().tobytes()


class ReferenceTable:
    """Reference log-prob of every row seen by :meth:`compute`, by :func:`row_key`."""

    def __init__(self, reference: str) -> None:
        self.reference = reference
        self.logps: dict[bytes, float] = {}

    def __len__(self) -> int:
        return len(self.logps)

    @torch.no_grad()
    def compute(self, engine: Engine, batches: Iterable[TokenBatch]) -> None:
        """One eval-mode pass over ``batches`` with the reference weights. Collective like
        :meth:`Engine.eval_stats` (every rank of a tp / pp group passes the same batches)."""
        inner, runner = engine.objective, engine.runner
        was_training = engine.modules[0].training
        engine.train(False)
        off = adapter_off(engine.modules) if self.reference == "base" else contextlib.nullcontext()
        try:
            with off:
                for batch in batches:
                    moved = {k: v.to(engine.device) for k, v in batch.items()}
                    engine.objective = RowLogps(moved["input_ids"].shape[0], inner)
                    if runner is not None:
                        runner.objective = engine.objective
                    logps = engine.eval_stats(moved).cpu()
                    for i in range(logps.shape[0]):
                        self.logps[row_key(batch["input_ids"][i], batch["labels"][i])] = float(logps[i])
        finally:
            engine.objective = inner
            if runner is not None:
                runner.objective = inner
            engine.train(was_training)

    def attach(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``batch`` with ``ref_logps`` (float32 ``[rows]``) from the table."""
        values = []
        for i in range(batch["input_ids"].shape[0]):
            key = row_key(batch["input_ids"][i], batch["labels"][i])
            if key not in self.logps:
                raise KeyError("a preference row has no reference log-prob (it was not in the reference pass)")
            values.append(self.logps[key])
        return {**batch, "ref_logps": torch.tensor(values, dtype=torch.float32)}

    def attach_all(self, batches: Iterable[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        for batch in batches:
            yield self.attach(batch)

    def steps(self, steps: Iterator[StepBatches]) -> Iterator[StepBatches]:
        """The step stream with every micro-batch's ``ref_logps`` attached."""
        for micro_batches, n_input in steps:
            yield [self.attach(b) for b in micro_batches], n_input

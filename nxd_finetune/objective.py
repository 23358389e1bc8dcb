"""The objective: what the training step computes on one micro-batch, in one place for every path.

The step (``sft/step.py``), the engine's whole-model path (``sft/engine.py``) and the pipeline's
last stage (``parallel/pipeline.py``) all ask the run's :class:`Objective` for the micro-batch's
loss and eval statistics; none of them knows which objective it is. The model output reaches the
objective as :class:`~nxd_finetune.loss.Scores` (vocab-parallel and chunked as the layout needs,
never a ``[tokens, vocab]`` tensor the objective must handle).

An objective defines:

- ``target(batch)``: the tensor (batch dimension first) that travels with a micro-batch to the
  pipeline's last stage, and ``labels(target)``: its ``[B, T]`` token labels (-100: no loss);
- ``count(batch)``: the micro-batch's normalisation units (int64 scalar); the step sums them over
  its micro-batches and the data-parallel ranks, and each micro-batch's ``loss_sum`` is divided by
  that total, so the step's gradient is the mean over the global batch however it is split;
- ``loss_sum(scores, target)``: the micro-batch's loss, summed over its units;
- ``eval_stats(scores, target)``: a fixed-length vector summed over eval batches and dp ranks, and
  ``eval_record(stats)``: the logged eval record from that sum;
- ``take_train_stats()``: the metric sums (``[train_width]``) ``loss_sum`` accumulated over the
  training micro-batches since the last call (None when the objective logs no metrics of its own),
  ``put_train_stats(stats)`` to replace them (the pipeline hands the last stage's to every rank),
  and ``train_record(stats)``: the step's metrics from their sum over dp ranks, logged beside
  ``train_loss``.

:class:`CrossEntropy` (supervised fine-tuning: token-mean cross entropy of the target tokens) is
the first objective; the preference objectives (:mod:`nxd_finetune.preference`: DPO, IPO, hinge,
SimPO, ORPO, with their own batch fields and metrics) are other classes with these methods; the
loop, the pipeline schedule, the checkpoint and the exporter stay as they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from pydantic import BaseModel

from nxd_finetune.loss import IGNORE_INDEX, Scores, shift_labels

TokenBatch = Mapping[str, torch.Tensor]
"""A micro-batch: ``input_ids``, ``labels`` (``[B, T]``; -100 where no loss) and optional
``position_ids`` / ``segment_ids`` (packed rows); an objective may require more fields."""


class Objective(Protocol):
    """What the step computes on a micro-batch (see the module docstring)."""

    name: str

    @property
    def eval_width(self) -> int:
        """Length of the ``eval_stats`` vector."""
        ...

    def target(self, batch: TokenBatch) -> torch.Tensor: ...

    def labels(self, target: torch.Tensor) -> torch.Tensor: ...

    def count(self, batch: TokenBatch) -> torch.Tensor: ...

    def loss_sum(self, scores: Scores, target: torch.Tensor) -> torch.Tensor: ...

    def eval_stats(self, scores: Scores, target: torch.Tensor) -> torch.Tensor: ...

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]: ...

    @property
    def train_width(self) -> int: ...

    def take_train_stats(self) -> torch.Tensor | None: ...

    def put_train_stats(self, stats: torch.Tensor | None) -> None: ...

    def train_record(self, stats: Sequence[float]) -> dict[str, float]: ...

    @property
    def progress_metric(self) -> str | None:
        """The :meth:`train_record` key the progress bar shows beside the loss (None: none)."""
        ...


class NoTrainStats:
    """An objective whose one training metric is the step loss (the loop's ``train_loss``)."""

    train_width = 0
    progress_metric: str | None = None

    def take_train_stats(self) -> torch.Tensor | None:
        return None

    def put_train_stats(self, stats: torch.Tensor | None) -> None:
        pass

    def train_record(self, stats: Sequence[float]) -> dict[str, float]:
        return {}


class CrossEntropy(NoTrainStats):
    """Supervised fine-tuning: cross entropy of the target tokens, token-mean over the step."""

    name = "sft"
    eval_width = 3

    def target(self, batch: TokenBatch) -> torch.Tensor:
        return batch["labels"]

    def labels(self, target: torch.Tensor) -> torch.Tensor:
        return target

    def count(self, batch: TokenBatch) -> torch.Tensor:
        return (shift_labels(batch["labels"]) != IGNORE_INDEX).sum().to(torch.int64)

    def loss_sum(self, scores: Scores, target: torch.Tensor) -> torch.Tensor:
        return scores.ce_sum()

    def eval_stats(self, scores: Scores, target: torch.Tensor) -> torch.Tensor:
        """``[loss sum, correct next-token predictions, targets]``."""
        return scores.eval_stats()

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]:
        loss_sum, correct, n = stats
        if n == 0:
            return {}
        loss = loss_sum / n
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_accuracy": correct / n}



SFT = CrossEntropy()


Section = BaseModel | None
"""An objective's recipe section as the recipe holds it (None: absent, the defaults apply)."""


def no_reference(section: Section, lora_init_from: str | None) -> str | None:
    return None


def no_problem(section: Section, lora_init_from: str | None, full: bool) -> str | None:
    return None


def no_setting(section: Section) -> str | None:
    return None


def dpo_pairs(section: Section) -> str:
    return "dpo"


@dataclasses.dataclass(frozen=True)
class ObjectiveRecord:
    """One objective as a recipe names it (``objective: <name>``), registered in
    :mod:`nxd_finetune.objectives`; everything outside the objective's own module reads these.

    ``build(section)``: the objective from its recipe section (``section``: the name of the
    recipe's section it reads, None: none); ``data_format``: the ``data.format`` it trains on
    (None: the supervised formats, no other objective's); ``reference(section, lora_init_from)``:
    the reference model its loss is measured against (``base``, ``init_from``; None: none, no
    reference pass); ``check(section, lora_init_from, full)``: its own cross-section rule (one
    line, else None); ``metadata(section)``: what an adapter records of it besides its name and
    reference (None: nothing is recorded, SFT); ``pair_tokenization(section)``: whose TRL
    trainer its pairs are tokenized as (``dpo``, ``orpo``); ``diverged(section)``: the setting a
    user lowers when training diverges (None: only the learning rate)."""

    name: str
    build: Callable[[Section], Objective]
    section: str | None = None
    data_format: str | None = None
    reference: Callable[[Section, str | None], str | None] = no_reference
    check: Callable[[Section, str | None, bool], str | None] = no_problem
    metadata: Callable[[Section], dict[str, str]] | None = None
    pair_tokenization: Callable[[Section], str] = dpo_pairs
    diverged: Callable[[Section], str | None] = no_setting


SFT_RECORD = ObjectiveRecord("sft", build=lambda section: SFT)

"""The objective: what the training step computes on one micro-batch, in one place for every path.

The step (``sft/step.py``), the engine's whole-model path (``sft/engine.py``) and the pipeline's
last stage (``parallel/pipeline.py``) all ask the :class:`Objective` they are handed, per call,
for the micro-batch's loss and eval statistics; none of them stores it or knows which objective it
is. The model output reaches the objective as :class:`~nxd_finetune.loss.Scores` (vocab-parallel
and chunked as the layout needs, never a ``[tokens, vocab]`` tensor the objective must handle;
``Scores.token_nll`` gives the per-token log-probs). An objective is stateless: its metrics come
back with each call and the caller (the engine, the pipeline runner, the loop, Lightning) sums them.

An objective defines:

- ``side(batch)``: its side data of a micro-batch, a :data:`SideData` dict of tensors with the
  batch dimension first (``[B]`` per row, ``[B, T]`` per token) that the pipeline carries to its
  last stage, and ``labels(side)``: the ``[B, T]`` token labels the scores are taken against
  (-100: no loss);
- ``count(batch)``: the micro-batch's normalisation units (int64 scalar); the step sums them over
  its micro-batches and the data-parallel ranks, and each micro-batch's loss sum is divided by
  that total, so the step's gradient is the mean over the global batch however it is split;
- ``loss(scores, side)``: ``(loss_sum, stats)``: the micro-batch's loss, summed over its units,
  and its metric sums (``[train_width]``; None when the objective logs no metrics of its own),
  which the caller sums over micro-batches, steps and dp ranks (:func:`add_stats`; the last
  ``train_max`` entries are maxima instead, combined by max), then ``train_record(stats)``: the
  metrics logged beside ``train_loss``;
- ``eval_stats(scores, side)``: a fixed-length vector summed over eval batches and dp ranks, and
  ``eval_record(stats)``: the logged eval record from that sum.

:class:`CrossEntropy` (supervised fine-tuning: token-mean cross entropy of the target tokens) is
the first objective; the preference objectives (:mod:`nxd_finetune.preference`: DPO, IPO, hinge,
SimPO, ORPO, with their own batch fields and metrics) are other classes with these methods. Each
has an :class:`ObjectiveRecord` in the registry (:mod:`nxd_finetune.objectives`); the loop, the
pipeline schedule, the checkpoint and the exporter stay as they are.
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


SideData = dict[str, torch.Tensor]
"""An objective's side data of a micro-batch (:meth:`Objective.side`): tensors, batch dimension first."""


class Objective(Protocol):
    """What the step computes on a micro-batch (see the module docstring)."""

    name: str

    @property
    def eval_width(self) -> int:
        """Length of the ``eval_stats`` vector."""
        ...

    def side(self, batch: TokenBatch) -> SideData: ...

    def labels(self, side: SideData) -> torch.Tensor: ...

    def count(self, batch: TokenBatch) -> torch.Tensor: ...

    def loss(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def eval_stats(self, scores: Scores, side: SideData) -> torch.Tensor: ...

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]: ...

    @property
    def train_width(self) -> int:
        """Length of the metric sums :meth:`loss` returns (0: it returns None)."""
        ...

    def train_record(self, stats: Sequence[float]) -> dict[str, float]: ...

    @property
    def progress_metric(self) -> str | None:
        """The :meth:`train_record` key the progress bar shows beside the loss (None: none)."""
        ...


def maxed_entries(objective: Objective) -> int:
    """How many of ``objective``'s metric sums' last entries are maxima (combined by max, not
    summed; a minimum is the maximum of its negation; -inf: no value): its optional ``train_max``
    attribute, 0 where it has none (an objective written before the attribute existed)."""
    return int(getattr(objective, "train_max", 0))


def add_stats(total: torch.Tensor | None, stats: torch.Tensor | None, maxed: int = 0) -> torch.Tensor | None:
    """Metric sums (:meth:`Objective.loss`'s second value) added up, the last ``maxed`` entries
    (:func:`maxed_entries`) combined by max; None stays out."""
    if stats is None:
        return total
    if total is None:
        return stats
    out = total + stats
    if maxed:
        out[-maxed:] = torch.maximum(total[-maxed:], stats[-maxed:])
    return out


class NoTrainStats:
    """An objective whose one training metric is the step loss (the loop's ``train_loss``)."""

    train_width = 0
    train_max = 0
    progress_metric: str | None = None

    def train_record(self, stats: Sequence[float]) -> dict[str, float]:
        return {}


class CrossEntropy(NoTrainStats):
    """Supervised fine-tuning: cross entropy of the target tokens, token-mean over the step."""

    name = "sft"
    eval_width = 3

    def side(self, batch: TokenBatch) -> SideData:
        return {"labels": batch["labels"]}

    def labels(self, side: SideData) -> torch.Tensor:
        return side["labels"]

    def count(self, batch: TokenBatch) -> torch.Tensor:
        return (shift_labels(batch["labels"]) != IGNORE_INDEX).sum().to(torch.int64)

    def loss(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor | None]:
        return scores.ce_sum(), None

    def eval_stats(self, scores: Scores, side: SideData) -> torch.Tensor:
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
    line, else None); ``metadata(section, lora_init_from)``: what an adapter records of it besides its name and
    reference (None: nothing is recorded, SFT); ``pair_tokenization(section)``: whose TRL
    trainer its pairs are tokenized as (``dpo``, ``orpo``); ``diverged(section)``: the setting a
    user lowers when training diverges (None: only the learning rate); ``source``: the
    ``module:function`` making a rank's batch source from its ``RankRun`` (GRPO's generates; None:
    the train loader's)."""

    name: str
    build: Callable[[Section], Objective]
    section: str | None = None
    data_format: str | None = None
    reference: Callable[[Section, str | None], str | None] = no_reference
    check: Callable[[Section, str | None, bool], str | None] = no_problem
    metadata: Callable[[Section, str | None], dict[str, str]] | None = None
    pair_tokenization: Callable[[Section], str] = dpo_pairs
    diverged: Callable[[Section], str | None] = no_setting
    source: str | None = None


SFT_RECORD = ObjectiveRecord("sft", build=lambda section: SFT)

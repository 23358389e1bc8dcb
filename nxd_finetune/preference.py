"""Preference objectives: DPO (``sigmoid``, ``ipo``, ``hinge``), SimPO and ORPO, as TRL computes them.

They plug into the objective seam (:mod:`nxd_finetune.objective`): the loop, the pipeline schedule,
the checkpoint and the exporter stay as they are.

The batch contract. A preference micro-batch of ``P`` pairs is a dict with

- ``input_ids`` ``[2P, T]`` long and ``labels`` ``[2P, T]`` long (-100 on prompt tokens and
  padding; completion tokens keep their ids, HF-style aligned with ``input_ids`` and shifted by the
  loss as usual). Rows ``0..P-1`` are the chosen sequences, rows ``P..2P-1`` the rejected ones of
  the same pairs in the same order (TRL's ``concatenated_forward`` order); right-padded, one
  sequence per row (no ``segment_ids``);
- ``ref_logps`` float32 ``[2P]``: the reference model's summed completion log-prob of each row,
  present once the reference log-probs were computed (:mod:`nxd_finetune.sft.reference`); the
  objectives without a reference (SimPO, ORPO) do not read it.

``training.micro_batch_size`` counts pairs. :meth:`count` is the number of pairs, so a step's loss
is the mean over the global batch's pairs (TRL's ``per_sequence_loss.mean()``); ``loss_sum`` sums
over the micro-batch's pairs. A sequence's log-prob is the sum of its completion tokens' log-probs,
read from :meth:`~nxd_finetune.loss.Scores.token_nll` (vocab-parallel and chunked: never a
``[tokens, vocab]`` tensor). The side data that travels to a pipeline's last stage
(:meth:`side`) is ``{"labels", "ref_logps"}`` (``ref_logps`` only with a reference); ORPO's is the
labels it scores (by default the chosen rows' prompt tokens too, for its NLL term) and each row's
completion start, ``{"labels", "start"}``.

Metrics carry TRL's names (``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``,
``rewards/accuracies``, ``logps/chosen``, ``logps/rejected``; ORPO adds ``nll_loss``,
``log_odds_ratio``, ``log_odds_chosen``): sums over pairs, returned by :meth:`loss` with each
micro-batch's loss (the caller sums them) and by :meth:`eval_stats`, divided by the pairs in the
records.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from nxd_finetune.errors import NxdError
from nxd_finetune.loss import IGNORE_INDEX, Scores, shift_labels
from nxd_finetune.objective import ObjectiveRecord, Section, SideData, TokenBatch

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "simpo")
_PAIR_STATS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
_ORPO_STATS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")
ORPO_NLL = ("prompt_and_completion", "completion")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, stable near 0 and far below it (Maechler's branch at
    ``-log 2``: ``log(-expm1(x))`` above, ``log1p(-exp(x))`` below). ``x`` is clamped just below 0
    so a log-prob that rounds to 0 gives a finite value and gradient."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def sequence_logps(scores: Scores, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-prob of each row's targets (``[B]``, fp32) from a micro-batch's scores against
    ``labels`` ``[B, T]``."""
    nll, position = scores.token_nll()
    return -torch.zeros(labels.shape[0], dtype=nll.dtype, device=nll.device).index_add(
        0, position // labels.shape[1], nll)


def completion_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Targets (completion tokens) of each row, ``[B]`` float32."""
    return (shift_labels(labels) != IGNORE_INDEX).sum(1).to(torch.float32)


def real_pairs(labels: torch.Tensor) -> torch.Tensor:
    """``[P]`` bool: the pairs of a ``[2P, T]`` micro-batch that have targets; the data layer's
    all-padding pairs (which even out eval batches over dp ranks) count nowhere."""
    has = (shift_labels(labels) != IGNORE_INDEX).any(1)
    p = labels.shape[0] // 2
    return has[:p] & has[p:]


@dataclasses.dataclass
class _PairObjective:
    """The parts DPO and ORPO share: the batch contract, the pair count and the metric plumbing."""

    beta: float = 0.1
    name: str = "dpo"
    progress_metric = "rewards/accuracies"  # shown on the progress bar (a class attribute, not a field)

    @property
    def stat_names(self) -> tuple[str, ...]:
        return _PAIR_STATS

    @property
    def eval_width(self) -> int:
        return 1 + len(self.stat_names)

    train_width = eval_width
    train_max = 0

    needs_reference: bool = dataclasses.field(default=False, init=False)

    def side(self, batch: TokenBatch) -> SideData:
        if not self.needs_reference:
            return {"labels": batch["labels"]}
        if "ref_logps" not in batch:
            raise NxdError(f"a {self.name} micro-batch without ref_logps: the reference log-probs were not "
                           "computed (nxd_finetune.sft.ref_source / sft.reference.attach_reference)")
        return {"labels": batch["labels"], "ref_logps": batch["ref_logps"]}

    def labels(self, side: SideData) -> torch.Tensor:
        return side["labels"]

    def count(self, batch: TokenBatch) -> torch.Tensor:
        return real_pairs(batch["labels"]).sum().to(torch.int64)

    def loss(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss summed over its pairs and its metric sums (``[train_width]``:
        pairs, then :attr:`stat_names`); sum those over micro-batches and dp ranks, then
        :meth:`train_record`."""
        return self._pairs(scores, side)

    def eval_stats(self, scores: Scores, side: SideData) -> torch.Tensor:
        return self._pairs(scores, side)[1]

    def train_record(self, stats: Sequence[float]) -> dict[str, float]:
        return self._record(stats, "")

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]:
        return self._record(stats, "eval_")

    def _record(self, stats: Sequence[float], prefix: str) -> dict[str, float]:
        pairs, *sums = stats
        if pairs == 0:
            return {}
        rec = {name: s / pairs for name, s in zip(self.stat_names, sums, strict=True)}
        rec["rewards/margins"] = rec["rewards/chosen"] - rec["rewards/rejected"]
        if prefix == "":  # the loop logs the step loss itself as train_loss
            rec.pop("loss")
        return {f"{prefix}{k}": v for k, v in rec.items()}

    def _pairs(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def _stats(real: torch.Tensor, loss_sum: torch.Tensor, rewards_c: torch.Tensor, rewards_r: torch.Tensor,
               logps_c: torch.Tensor, logps_r: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
        """``[real pairs, loss sum, then sums over the real pairs]`` (``more``: already summed)."""
        def total(x: torch.Tensor) -> torch.Tensor:
            return torch.where(real, x.float(), 0.0).sum()

        wins = (rewards_c > rewards_r).float()
        parts = [real.float().sum(), loss_sum, total(rewards_c), total(rewards_r), total(wins),
                 total(logps_c), total(logps_r), *more]
        return torch.stack([p.detach().float() for p in parts])


@dataclasses.dataclass
class DirectPreference(_PairObjective):
    """DPO with TRL's ``loss_type`` ``sigmoid`` (``label_smoothing``: the conservative cDPO form),
    ``ipo`` (length-normalised log-ratios, as TRL), ``hinge``; and ``simpo`` (no reference:
    length-normalised log-probs, target margin ``simpo_gamma``; TRL's CPO trainer with
    ``loss_type="simpo"``, ``cpo_alpha=0``)."""

    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        self.needs_reference = self.loss_type != "simpo"

    def _pairs(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor]:
        labels = side["labels"]
        p = labels.shape[0] // 2
        logps = sequence_logps(scores, labels)
        beta, eps = self.beta, self.label_smoothing
        if self.loss_type == "simpo":
            logps = logps / completion_tokens(labels).clamp(min=1.0)
            logits = logps[:p] - logps[p:] - self.simpo_gamma / beta
            losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
            rewards = beta * logps.detach()
        else:
            ratios = logps - side["ref_logps"].to(logps.dtype)
            delta = ratios[:p] - ratios[p:]
            if self.loss_type == "sigmoid":
                losses = -F.logsigmoid(beta * delta) * (1 - eps) - F.logsigmoid(-beta * delta) * eps
            elif self.loss_type == "hinge":
                losses = torch.relu(1 - beta * delta)
            elif self.loss_type == "ipo":
                avg = ratios / completion_tokens(labels).clamp(min=1.0)
                losses = (avg[:p] - avg[p:] - 1 / (2 * beta)) ** 2
            else:
                raise ValueError(f"unknown preference loss_type {self.loss_type!r} (one of {', '.join(LOSS_TYPES)})")
            rewards = beta * ratios.detach()
        real = real_pairs(labels)
        loss = torch.where(real, losses, 0.0).sum()
        return loss, self._stats(real, loss, rewards[:p], rewards[p:], logps[:p], logps[p:])


@dataclasses.dataclass
class OddsRatioPreference(_PairObjective):
    """ORPO as TRL's ``ORPOTrainer``: an NLL term on the chosen sequences minus ``beta`` times the
    mean log-sigmoid of the log odds ratio of the length-normalised completion log-probs, with a
    stable ``log(1 - exp(x))`` (:func:`log1mexp`). No reference model.

    The NLL term is the token mean over the micro-batch's chosen rows (TRL's ``CrossEntropyLoss``
    over the chosen half of the batch) of the tokens ``nll`` names: ``prompt_and_completion``
    (TRL: every token of the chosen sequence after its first, prompt included) or ``completion``
    (the chosen completion only, the paper's ``-log P(y_w | x)``). For the first, :meth:`side`
    scores the chosen rows' prompt tokens as well and keeps each row's completion start, so the
    log-probs of the odds ratio stay the completions' (one forward, the same scores)."""

    name: str = "orpo"
    nll: str = "prompt_and_completion"

    def __post_init__(self) -> None:
        if self.nll not in ORPO_NLL:
            raise ValueError(f"unknown ORPO nll tokens {self.nll!r} (one of {', '.join(ORPO_NLL)})")

    @property
    def stat_names(self) -> tuple[str, ...]:
        return _PAIR_STATS + _ORPO_STATS

    def side(self, batch: TokenBatch) -> SideData:
        """``labels``: the scored labels (with ``prompt_and_completion`` the chosen rows'
        ``input_ids`` up to their last completion token, the rejected rows' completion labels);
        ``start``: each row's completion start (``T`` for a row without one)."""
        labels = batch["labels"]
        has = labels != IGNORE_INDEX
        t = labels.shape[1]
        start = torch.where(has.any(1), has.int().argmax(1), t)
        if self.nll == "prompt_and_completion":
            p = labels.shape[0] // 2
            upto_last = has[:p].flip(1).cumsum(1).flip(1) > 0
            labels = torch.cat([torch.where(upto_last, batch["input_ids"][:p], IGNORE_INDEX), labels[p:]])
        return {"labels": labels, "start": start}

    def _pairs(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor]:
        scored, start = side["labels"], side["start"]
        n, t = scored.shape
        p = n // 2
        labels = scored.masked_fill(torch.arange(t, device=scored.device) < start.unsqueeze(1), IGNORE_INDEX)
        nll, position = scores.token_nll()
        row = position // t
        in_completion = position % t + 1 >= start[row]  # the target of position t is the token at t + 1
        summed = -torch.zeros(n, dtype=nll.dtype, device=nll.device).index_add(
            0, row, torch.where(in_completion, nll, 0.0))
        tokens = completion_tokens(labels)
        logps = summed / tokens.clamp(min=1.0)
        chosen_targets = (shift_labels(scored[:p]) != IGNORE_INDEX).sum().to(nll.dtype)
        nll_mean = torch.where(row < p, nll, 0.0).sum() / chosen_targets.clamp(min=1.0)
        c, r = logps[:p], logps[p:]
        log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
        real = real_pairs(labels)
        n_real = real.float().sum()
        ratio = torch.where(real, F.logsigmoid(log_odds), 0.0)
        loss = n_real * nll_mean - self.beta * ratio.sum()
        rewards = self.beta * logps.detach()
        stats = self._stats(real, loss, rewards[:p], rewards[p:], c, r, n_real * nll_mean, ratio.sum(),
                            torch.where(real, log_odds, 0.0).sum())
        return loss, stats


# ---------------------------------------------------------------------- the recipe's side

Reference = Literal["base", "init_from"]
# beta multiplies summed log-prob differences and IPO / SimPO divide by it (1 / (2 beta), gamma / beta):
# within these bounds every objective's loss, rewards and gradients stay far inside float32's range
# (usual values: beta 0.01 to 10, simpo_gamma 0.5 to 2); beyond them the loss is NaN or inf from step 1
BETA_RANGE = (1e-4, 1e4)
SIMPO_GAMMA_MAX = 1e4


class PreferenceSection(BaseModel):
    """Preference tuning (``objective: dpo`` or ``orpo``).

    ``beta``: DPO's KL weight (IPO: its tau; SimPO and ORPO: their reward scale / odds-ratio weight).
    ``loss_type`` (dpo only): ``sigmoid`` (DPO; ``label_smoothing`` > 0: conservative DPO),
    ``ipo``, ``hinge``, or ``simpo`` (no reference; ``simpo_gamma``: the target reward margin).
    ``orpo_nll`` (orpo only): the tokens of ORPO's NLL term on the chosen sequences,
    ``prompt_and_completion`` (TRL's ``ORPOTrainer``) or ``completion`` (the chosen completion only).
    ``max_prompt_length`` / ``truncation_mode``: how the data layer shortens a pair over
    ``data.max_seq_len`` (prompt first to ``max_prompt_length``, then ``keep_start`` /
    ``keep_end`` of the sequence). ``reference`` (dpo with a reference): ``base`` (the weights with
    the adapter off, or the initial full model) or ``init_from`` (the adapter the run starts from,
    the default when ``lora.init_from`` is set). A pair's reference log-probs are computed at the
    step that first uses it (full fine-tuning: in one pass before training) and stored with the
    tokenized pairs (``precompute_ref_log_probs``; no second model in memory). ``beta`` lies within
    :data:`BETA_RANGE` and ``simpo_gamma`` within [0, :data:`SIMPO_GAMMA_MAX`] (beyond: a loss
    that overflows)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    beta: float = 0.1
    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo"] = "sigmoid"
    label_smoothing: float = Field(default=0.0, ge=0.0, lt=0.5)
    simpo_gamma: float = 0.5
    orpo_nll: Literal["prompt_and_completion", "completion"] = "prompt_and_completion"
    max_prompt_length: int | None = Field(default=None, ge=1)
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    precompute_ref_log_probs: bool = True
    reference: Reference | None = None

    @model_validator(mode="after")
    def _check(self) -> PreferenceSection:
        low, high = BETA_RANGE
        if not low <= self.beta <= high:
            raise ValueError(f"preference.beta={self.beta:g} is outside [{low:g}, {high:g}]: beyond it the "
                             "preference loss overflows (NaN or inf from the first step); usual values: 0.01 to 10")
        if not 0 <= self.simpo_gamma <= SIMPO_GAMMA_MAX:
            raise ValueError(f"preference.simpo_gamma={self.simpo_gamma:g} is outside [0, {SIMPO_GAMMA_MAX:g}] "
                             "(a margin of at least 0; larger ones overflow the SimPO loss); usual values: 0.5 to 2")
        if not self.precompute_ref_log_probs:
            raise ValueError("preference.precompute_ref_log_probs=false is not supported: reference log-probs are "
                             "computed once per pair, when a step first uses it, and stored (no second model in "
                             "memory)")
        if self.label_smoothing and self.loss_type in ("ipo", "hinge"):
            raise ValueError(f"preference.label_smoothing={self.label_smoothing} has no effect with "
                             f"loss_type={self.loss_type} (only sigmoid and simpo use it)")
        if self.loss_type == "simpo" and self.reference is not None:
            raise ValueError(f"preference.reference={self.reference} but loss_type=simpo uses no reference model")
        return self


def settings(section: Section) -> PreferenceSection:
    """The recipe's ``preference`` section (its defaults when absent)."""
    if section is not None and not isinstance(section, PreferenceSection):
        raise TypeError(f"a preference objective reads a PreferenceSection, got {type(section).__name__}")
    return section or PreferenceSection()


def dpo_objective(section: Section) -> DirectPreference:
    """``objective: dpo`` with its ``preference`` settings (``loss_type``: DPO, IPO, hinge, SimPO)."""
    p = settings(section)
    return DirectPreference(beta=p.beta, loss_type=p.loss_type, label_smoothing=p.label_smoothing,
                            simpo_gamma=p.simpo_gamma)


def orpo_objective(section: Section) -> OddsRatioPreference:
    """``objective: orpo`` (``orpo_nll``: the tokens of its NLL term)."""
    p = settings(section)
    return OddsRatioPreference(beta=p.beta, nll=p.orpo_nll)


def dpo_reference(section: Section, lora_init_from: str | None) -> str | None:
    """DPO's reference: ``preference.reference``, else ``init_from`` with ``lora.init_from``, else
    ``base``; none for SimPO."""
    p = settings(section)
    if p.loss_type == "simpo":
        return None
    if p.reference is not None:
        return p.reference
    return "init_from" if lora_init_from else "base"


def _check_reference(p: PreferenceSection, lora_init_from: str | None, full: bool) -> str | None:
    if p.reference == "init_from" and not lora_init_from:
        return "preference.reference=init_from needs lora.init_from (the adapter the run starts from)"
    if p.reference == "init_from" and full:
        return "preference.reference=init_from needs a lora section (full fine-tuning has no adapter)"
    return None


def check_dpo(section: Section, lora_init_from: str | None, full: bool) -> str | None:
    p = settings(section)
    if p.orpo_nll != "prompt_and_completion":  # the default: written back out
        return f"preference.orpo_nll={p.orpo_nll} is an ORPO setting; objective=dpo has no use for it"
    return _check_reference(p, lora_init_from, full)


def check_orpo(section: Section, lora_init_from: str | None, full: bool) -> str | None:
    p = settings(section)
    if p.reference is not None:
        return f"preference.reference={p.reference} but objective=orpo uses no reference model"
    if p.loss_type != "sigmoid":  # the default: a recipe written back out keeps it
        return f"preference.loss_type={p.loss_type} is a DPO setting; objective=orpo has its own loss"
    if p.label_smoothing:
        return f"preference.label_smoothing={p.label_smoothing} is a DPO setting; objective=orpo has no use for it"
    return _check_reference(p, lora_init_from, full)


def beta_setting(section: Section) -> str:
    return f"preference.beta (now {settings(section).beta:g})"


def orpo_pairs(section: Section) -> str:
    return "orpo"


def dpo_pairs_of(section: Section) -> str:
    """SimPO's pairs are tokenized as TRL's CPOTrainer does (ORPOTrainer's rule); DPO's as DPOTrainer's."""
    return "orpo" if settings(section).loss_type == "simpo" else "dpo"


DPO = ObjectiveRecord("dpo", build=dpo_objective, section="preference", data_format="preference",
                      reference=dpo_reference, check=check_dpo,
                      metadata=lambda section, init_from: {"nxd_loss_type": settings(section).loss_type},
                      pair_tokenization=dpo_pairs_of, diverged=beta_setting)
ORPO = ObjectiveRecord("orpo", build=orpo_objective, section="preference", data_format="preference",
                       check=check_orpo, metadata=lambda section, init_from: {}, pair_tokenization=orpo_pairs,
                       diverged=beta_setting)

"""GRPO's objective (``objective: grpo``): TRL 1.x ``GRPOTrainer``'s loss on sampled completions,
stateless as every objective (:mod:`nxd_finetune.objective`).

The batch contract (made by :mod:`nxd_finetune.rl.source`). A micro-batch of ``B`` completions is

- ``input_ids`` ``[B, T]``: each row its prompt's tokens, then its completion's, right-padded (a
  rotary model scores a row the same wherever it starts, so this equals TRL's left-padded prompts);
- ``labels`` ``[B, T]``: the completion tokens the loss counts (TRL's ``completion_mask``, with
  ``mask_truncated_completions`` applied), -100 elsewhere;
- ``advantages`` ``[B]`` float32: each completion's group-normalised advantage;
- ``old_logps`` ``[B, T]`` float32 (``num_iterations`` > 1): the log-prob of each target under the
  model that sampled it, at the position that predicts it (that of ``shift_labels``); without it
  the ratio is against the detached current log-probs (TRL's rule at ``num_iterations`` 1);
- ``ref_logps`` ``[B, T]`` float32 (``beta`` > 0): the reference's log-probs, laid out the same;
- ``prompt_lengths`` / ``n_tokens`` ``[B]``: each row's prompt tokens and tokens in all; with them
  the engine runs a prompt that rows share (a group's) once, its completions on the prompt's
  keys and values (:mod:`nxd_finetune.models.shared_prefix`; the same numbers within float rounding).

Per token: ``ratio = exp(logp - old)``, the clipped surrogate ``-min(ratio A, clip(ratio, 1 -
epsilon, 1 + epsilon_high) A)``, plus ``beta`` times TRL's KL estimator ``exp(ref - logp) - (ref -
logp) - 1`` (times ``ratio`` with ``use_bias_correction_kl``, TRL's default); log-probs of the
logits divided by the sampling temperature, as TRL scores them.

The normalisation of ``loss_type``, as sums the step divides by its units (:meth:`count`, summed
over micro-batches and dp ranks), which is TRL's loss under gradient accumulation and DDP:
``grpo``: each sequence's token mean, over the step's sequences; ``dr_grpo``: the token sum over
sequences x ``max_completion_length``; ``dapo``: the token sum over the step's (global) loss
tokens; ``bnpo``: each micro-batch's token mean, over the step's micro-batches (TRL's: the mean of
its micro-batches' token means).

Metrics (TRL's names): ``kl`` (``beta`` > 0), ``entropy`` (of the policy's distribution, of the
logits over the temperature, at each loss token), ``clip_ratio/low_mean``,
``clip_ratio/high_mean``, ``clip_ratio/region_mean``: token means over the logging window's loss
tokens; ``clip_ratio/low_min`` / ``clip_ratio/high_max``: the least low-clipped / most
high-clipped sequence's fraction of its loss tokens, over the window's sequences (sequences
without loss tokens left out). Each is TRL's where a step is one micro-batch on one process (TRL
averages its micro-batches' values otherwise); every layout gives the one-process value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from nxd_finetune.errors import NxdError
from nxd_finetune.loss import IGNORE_INDEX, Scores, shift_labels
from nxd_finetune.objective import NoTrainStats, ObjectiveRecord, Section, SideData, TokenBatch
from nxd_finetune.rl.section import LOSS_TYPES, RLSection

_STATS = ("tokens", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
_MAXED = ("clip_ratio/low_min", "clip_ratio/high_max")  # maxima (low_min: of its negation); -inf: no sequence


def token_values(scores: Scores, labels: torch.Tensor, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp [N], position [N], valid [N])``: each scored target's log-prob (of the logits over
    ``temperature``), its flat predicting position in ``[B, T]`` and whether it is a real target
    (the scores may carry ignored padding targets anywhere)."""
    nll, position = scores.token_nll(temperature)
    valid = shift_labels(labels).reshape(-1)[position] != IGNORE_INDEX
    return -nll, position, valid


@dataclasses.dataclass
class GroupRelative:
    """GRPO / Dr. GRPO / DAPO / BNPO as TRL 1.x's ``GRPOTrainer._compute_loss`` (module docstring)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    max_completion_length: int = 512
    bias_correction_kl: bool = True
    name: str = "grpo"
    progress_metric = "reward"  # the batch source's metric, shown on the progress bar when logged
    eval_width = 1
    train_width = len(_STATS) + len(_MAXED)
    train_max = len(_MAXED)

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown GRPO loss_type {self.loss_type!r} (one of {', '.join(LOSS_TYPES)})")

    def side(self, batch: TokenBatch) -> SideData:
        if "advantages" not in batch:
            raise NxdError("a grpo micro-batch without advantages: it was not made by the GRPO batch source "
                           "(nxd_finetune.rl.source)")
        if self.beta and "ref_logps" not in batch:
            raise NxdError(f"a grpo micro-batch without ref_logps while rl.beta={self.beta:g}: the reference "
                           "log-probs were not computed")
        return {k: batch[k] for k in ("labels", "advantages", "old_logps", "ref_logps") if k in batch}

    def labels(self, side: SideData) -> torch.Tensor:
        return side["labels"]

    def count(self, batch: TokenBatch) -> torch.Tensor:
        labels = batch["labels"]
        if self.loss_type == "dapo":
            return (shift_labels(labels) != IGNORE_INDEX).sum().to(torch.int64)
        if self.loss_type == "bnpo":
            return torch.ones((), dtype=torch.int64, device=labels.device)
        return torch.tensor(labels.shape[0], dtype=torch.int64, device=labels.device)

    def loss(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor]:
        labels = side["labels"]
        logp, position, valid = token_values(scores, labels, self.temperature)
        row = position // labels.shape[1]
        old = side["old_logps"].reshape(-1)[position].to(logp.dtype) if "old_logps" in side else logp.detach()
        ratio = torch.exp(logp - old)
        adv = side["advantages"].to(logp.dtype)[row]
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        kl = torch.zeros_like(logp)
        if self.beta:
            delta = side["ref_logps"].reshape(-1)[position].to(logp.dtype) - logp
            kl = torch.exp(delta) - delta - 1
            if self.bias_correction_kl:
                kl = kl * ratio
            per_token = per_token + self.beta * kl
        w = valid.to(logp.dtype)
        per_token = per_token * w
        tokens = w.sum()
        if self.loss_type == "grpo":
            lengths = (shift_labels(labels) != IGNORE_INDEX).sum(1).clamp(min=1).to(logp.dtype)
            sums = torch.zeros(labels.shape[0], dtype=logp.dtype, device=logp.device).index_add(0, row, per_token)
            loss = (sums / lengths).sum()
        elif self.loss_type == "bnpo":
            loss = per_token.sum() / tokens.clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            loss = per_token.sum() / self.max_completion_length
        else:
            loss = per_token.sum()
        low = (ratio < 1 - self.epsilon) & (adv < 0)
        high = (ratio > 1 + self.epsilon_high) & (adv > 0)
        entropy = scores.token_entropy(self.temperature).to(logp.dtype)
        sums = torch.stack([tokens, (kl * w).sum(), (entropy * w).sum(), (low * w).sum(), (high * w).sum(),
                            ((low | high) * w).sum()]).detach().float()
        return loss, torch.cat([sums, _sequence_extremes(row, w, low, high, labels.shape[0])])

    def eval_stats(self, scores: Scores, side: SideData) -> torch.Tensor:
        raise NxdError("objective=grpo has no eval over a loader's batches (its eval samples completions)")

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]:
        return {}

    def train_record(self, stats: Sequence[float]) -> dict[str, float]:
        tokens, *sums = stats[:len(_STATS)]
        if tokens == 0:
            return {}
        rec = {name: s / tokens for name, s in zip(_STATS[1:], sums, strict=True)}
        if not self.beta:
            rec.pop("kl")
        low_min, high_max = stats[len(_STATS):]
        if high_max > -math.inf:
            rec.update({"clip_ratio/low_min": -low_min, "clip_ratio/high_max": high_max})
        return rec


def _sequence_extremes(row: torch.Tensor, w: torch.Tensor, low: torch.Tensor, high: torch.Tensor,
                       rows: int) -> torch.Tensor:
    """``[-min, max]`` over the micro-batch's sequences with loss tokens of each one's fraction of
    low- / high-clipped loss tokens (TRL's ``nanmin`` / ``nanmax`` of its ``masked_seq_mean``);
    ``[-inf, -inf]`` without such a sequence."""
    per_row = torch.zeros(3, rows, dtype=w.dtype, device=w.device)
    per_row = per_row.index_add(1, row, torch.stack([w, low * w, high * w]))
    counted = per_row[0] > 0
    if not counted.any():
        return torch.full((2,), -math.inf, dtype=torch.float32, device=w.device)
    frac = per_row[1:, counted] / per_row[0, counted]
    return torch.stack([-frac[0].min(), frac[1].max()]).detach().float()


@dataclasses.dataclass
class TokenLogps(NoTrainStats):
    """An objective whose eval statistics are a ``[rows, T]`` micro-batch's per-target log-probs
    (flat ``[rows * T]``, at the predicting position; 0 off the targets), of the logits over
    ``temperature``: the old-policy and reference passes through the engine's eval call (every
    layout)."""

    rows: int
    width: int
    temperature: float = 1.0
    name: str = "grpo-logps"

    @property
    def eval_width(self) -> int:
        return self.rows * self.width

    def side(self, batch: TokenBatch) -> SideData:
        return {"labels": batch["labels"]}

    def labels(self, side: SideData) -> torch.Tensor:
        return side["labels"]

    def count(self, batch: TokenBatch) -> torch.Tensor:
        return torch.tensor(batch["labels"].shape[0], dtype=torch.int64)

    def loss(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise RuntimeError("the log-prob pass does not train")

    def eval_stats(self, scores: Scores, side: SideData) -> torch.Tensor:
        logp, position, valid = token_values(scores, side["labels"], self.temperature)
        out = torch.zeros(self.rows * self.width, dtype=torch.float32, device=logp.device)
        return out.index_add(0, position, torch.where(valid, logp.float(), 0.0))

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]:
        return {}


# ---------------------------------------------------------------------- the recipe's side


def rl_settings(section: Section) -> RLSection:
    if not isinstance(section, RLSection):
        raise NxdError("objective=grpo needs an rl section (at least rl.reward_funcs)")
    return section


def grpo_objective(section: Section) -> GroupRelative:
    """``objective: grpo`` with its ``rl`` settings."""
    rl = rl_settings(section)
    return GroupRelative(loss_type=rl.loss_type, beta=rl.beta, epsilon=rl.epsilon, epsilon_high=rl.clip_high,
                         temperature=rl.temperature, max_completion_length=rl.max_completion_length,
                         bias_correction_kl=rl.use_bias_correction_kl)


def check_grpo(section: Section, lora_init_from: str | None, full: bool) -> str | None:
    if section is None:
        return "objective=grpo needs an rl section (at least rl.reward_funcs)"
    rl = rl_settings(section)
    if rl.beta and full:
        return (f"rl.beta={rl.beta:g} needs a lora section: the KL reference is the base model with the adapter "
                "off (full fine-tuning would need a second model); set rl.beta: 0")
    if rl.reference == "init_from" and not lora_init_from:
        return "rl.reference=init_from needs lora.init_from (the adapter the run starts from)"
    return None


def grpo_reference(section: Section, lora_init_from: str | None) -> str | None:
    """The KL term's reference (``rl.beta`` > 0, else None): ``rl.reference``, else ``init_from``
    with ``lora.init_from`` (TRL's for a ``PeftModel`` with an adapter), else ``base``."""
    rl = rl_settings(section)
    if not rl.beta:
        return None
    return rl.reference or ("init_from" if lora_init_from else "base")


def grpo_metadata(section: Section, lora_init_from: str | None) -> dict[str, str]:
    rl = rl_settings(section)
    kind = grpo_reference(section, lora_init_from)
    label = {} if kind is None else {"nxd_reference": f"init_from:{lora_init_from}" if kind == "init_from" else kind}
    return {"nxd_loss_type": rl.loss_type, **label}


def beta_setting(section: Section) -> str:
    return f"rl.beta (now {rl_settings(section).beta:g}) or rl.epsilon (now {rl_settings(section).epsilon:g})"


GRPO = ObjectiveRecord("grpo", build=grpo_objective, section="rl", data_format="prompt", check=check_grpo,
                       metadata=grpo_metadata, diverged=beta_setting, source="nxd_finetune.rl.source:grpo_source")

"""The recipe's preference-tuning keys: ``objective`` (``sft``, ``dpo``, ``orpo``) and the
``preference`` section, with TRL's names (``beta``, ``loss_type``, ``label_smoothing``,
``simpo_gamma``, ``max_prompt_length``, ``truncation_mode``, ``precompute_ref_log_probs``; and
``orpo_nll``, which TRL has no setting for), and the rules across sections
(:func:`check_objective`), each failure one line."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Objective = Literal["sft", "dpo", "orpo"]
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
    the default when ``lora.init_from`` is set). Reference log-probs are computed in one pass
    before training (``precompute_ref_log_probs``; no second model in memory). ``beta`` lies within
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
                             "computed in one pass before training (no second model in memory)")
        if self.label_smoothing and self.loss_type in ("ipo", "hinge"):
            raise ValueError(f"preference.label_smoothing={self.label_smoothing} has no effect with "
                             f"loss_type={self.loss_type} (only sigmoid and simpo use it)")
        if self.loss_type == "simpo" and self.reference is not None:
            raise ValueError(f"preference.reference={self.reference} but loss_type=simpo uses no reference model")
        return self


def check_objective(objective: str, preference: PreferenceSection | None, data_format: str,
                    lora_init_from: str | None, full: bool) -> str | None:
    """The one-line error of an invalid objective / preference / data combination, else None.
    ``full``: the run trains the whole model (no ``lora`` section)."""
    if objective == "sft":
        if preference is not None:
            return "preference is set but objective=sft (set objective: dpo or orpo)"
        if data_format == "preference":
            return "data.format=preference needs objective: dpo or orpo (objective=sft)"
        return None
    if data_format != "preference":
        return f"objective={objective} needs data.format=preference (got {data_format})"
    p = preference or PreferenceSection()
    if objective == "dpo" and p.orpo_nll != "prompt_and_completion":  # the default: written back out
        return f"preference.orpo_nll={p.orpo_nll} is an ORPO setting; objective=dpo has no use for it"
    if objective == "orpo":
        if p.reference is not None:
            return f"preference.reference={p.reference} but objective=orpo uses no reference model"
        if p.loss_type != "sigmoid":  # the default: a recipe written back out keeps it
            return f"preference.loss_type={p.loss_type} is a DPO setting; objective=orpo has its own loss"
        if p.label_smoothing:
            return f"preference.label_smoothing={p.label_smoothing} is a DPO setting; objective=orpo has no use for it"
    if p.reference == "init_from" and not lora_init_from:
        return "preference.reference=init_from needs lora.init_from (the adapter the run starts from)"
    if p.reference == "init_from" and full:
        return "preference.reference=init_from needs a lora section (full fine-tuning has no adapter)"
    return None


def reference_of(objective: str, preference: PreferenceSection | None, lora_init_from: str | None) -> str | None:
    """Which reference a run uses: ``base``, ``init_from``, or None (no reference: sft, orpo, simpo)."""
    p = preference or PreferenceSection()
    if objective != "dpo" or p.loss_type == "simpo":
        return None
    if p.reference is not None:
        return p.reference
    return "init_from" if lora_init_from else "base"

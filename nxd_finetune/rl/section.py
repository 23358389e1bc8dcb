"""The recipe's ``rl:`` section (GRPO; the ``Recipe``'s ``rl`` field, living with the RL code as the
``preference`` section lives with its objectives), in TRL 1.x's ``GRPOConfig`` names and defaults, and the
built-in reward functions' entries. :func:`rl_section` validates a mapping as that section alone,
every failure one line (:class:`~nxd_finetune.errors.RecipeError`) naming the ``rl.`` key, as the
recipe's own sections do.

``reward_funcs`` entries: ``module:function`` (a function of TRL's signature, imported when the run
starts), or a built-in that needs no code (:data:`nxd_finetune.rl.rewards.BUILTINS`):
``{type: exact_match, column: answer}`` (or just ``exact_match``), ``{type: regex, pattern: ...}``,
``{type: length, cache: 64}`` (or just ``length``; ``max_length`` defaults to
``max_completion_length``). ``reward_weights``: one per function (default: 1 each)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nxd_finetune.errors import RecipeError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ExactMatchReward(_Strict):
    """1.0 where the completion's text equals the row's ``column`` (both stripped)."""

    type: Literal["exact_match"] = "exact_match"
    column: str = Field(default="answer", min_length=1)


class RegexReward(_Strict):
    """1.0 where ``pattern`` matches anywhere in the completion's text (``re.DOTALL``)."""

    type: Literal["regex"] = "regex"
    pattern: str = Field(min_length=1)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"pattern {pattern!r} does not compile: {e}") from None
        return pattern


class LengthReward(_Strict):
    """DAPO's soft overlong punishment: 0 up to ``max_length - cache`` tokens, down to -1 at
    ``max_length`` (default: ``rl.max_completion_length``)."""

    type: Literal["length"] = "length"
    max_length: int | None = Field(default=None, ge=1)
    cache: int = Field(default=64, ge=1)


BuiltinReward = Annotated[ExactMatchReward | RegexReward | LengthReward, Field(discriminator="type")]
RewardEntry = str | BuiltinReward


BUILTINS: dict[str, type[ExactMatchReward | RegexReward | LengthReward]] = {
    "exact_match": ExactMatchReward, "regex": RegexReward, "length": LengthReward}


def _builtin(index: int, entry: object) -> ExactMatchReward | RegexReward | LengthReward:
    """A built-in reward entry (a mapping with ``type``, or the bare name) as its model."""
    data = {"type": entry} if isinstance(entry, str) else dict(entry)  # type: ignore[call-overload]
    from nxd_finetune.recipe.messages import describe_errors  # the recipe package imports this module

    where = f"rl.reward_funcs[{index}]"
    model = BUILTINS.get(str(data.get("type")))
    if model is None:
        raise ValueError(f"{where}: type {data.get('type')!r} is not a built-in reward ({', '.join(BUILTINS)}); "
                         "a function of your own is a 'module:function' string")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        _, message = describe_errors(e, data, model)
        raise ValueError(f"{where} ({data['type']}): {message}") from None


class RLSection(_Strict):
    """GRPO (TRL's ``GRPOConfig`` names; defaults as TRL 1.x's). ``num_generations``: completions
    per prompt (a group; at least 2: advantages compare within it). ``max_prompt_length``: prompts
    longer keep their last tokens (None: none cut). ``temperature`` > 0, ``top_p`` in (0, 1],
    ``top_k`` (0: off): the sampling. ``beta``: the KL term's weight (0: no reference pass).
    ``epsilon`` / ``epsilon_high`` (default: ``epsilon``): the clip range's lower and upper widths.
    ``loss_type``: :data:`LOSS_TYPES`. ``scale_rewards``: ``group``, ``batch`` or ``none`` (true /
    false: group / none). ``num_iterations``: optimizer steps per generated batch.
    ``mask_truncated_completions``: completions with no stop token leave the loss.
    ``use_bias_correction_kl``: the KL term times the importance ratio (TRL 1.x's default: its
    gradient then differs from the plain estimator's even where the ratio is 1).
    ``multi_objective_aggregation``: ``sum_then_normalize`` or ``normalize_then_sum``.
    ``reference`` (``beta`` > 0): the KL term's reference, ``init_from`` (the adapter the run starts
    from, ``lora.init_from``: TRL's frozen ``ref`` copy of a ``PeftModel``'s adapter; the default
    with ``lora.init_from``) or ``base`` (the adapter off: the base model; the default without it,
    where the fresh adapter starts at the base). Neither holds a second model."""

    reward_funcs: list[RewardEntry] = Field(min_length=1)
    reward_weights: list[float] | None = None
    num_generations: int = Field(default=8, ge=2)
    max_prompt_length: int | None = Field(default=None, ge=1)
    max_completion_length: int = Field(default=512, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    beta: float = Field(default=0.0, ge=0)
    epsilon: float = Field(default=0.2, gt=0)
    epsilon_high: float | None = Field(default=None, gt=0)
    loss_type: str = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = Field(default=1, ge=1)
    mask_truncated_completions: bool = False
    use_bias_correction_kl: bool = True
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    reference: Literal["base", "init_from"] | None = None

    @field_validator("reward_funcs", mode="before")
    @classmethod
    def _builtins(cls, value: object) -> object:
        """Built-in entries parsed here, each failure one line naming the entry; ``exact_match`` /
        ``length`` alone: the built-in with its defaults."""
        if not isinstance(value, list):
            return value
        return [_builtin(i, v) if isinstance(v, dict) or v in ("exact_match", "length") else v
                for i, v in enumerate(value)]

    @field_validator("reward_funcs")
    @classmethod
    def _import_paths(cls, value: list[RewardEntry]) -> list[RewardEntry]:
        for i, entry in enumerate(value):
            if isinstance(entry, str) and not _IMPORT_PATH.match(entry):
                hint = " (a regex is {type: regex, pattern: ...})" if entry == "regex" else ""
                raise ValueError(f"rl.reward_funcs[{i}]={entry!r} is not 'module:function' nor a built-in "
                                 f"(exact_match, regex, length){hint}")
        return value

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_bool(cls, value: object) -> object:
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("loss_type")
    @classmethod
    def _loss_type(cls, value: str) -> str:
        if value not in LOSS_TYPES:
            raise ValueError(f"rl.loss_type={value!r} is not supported; use one of {', '.join(LOSS_TYPES)}")
        return value

    @model_validator(mode="after")
    def _check(self) -> RLSection:
        weights, funcs = self.reward_weights, self.reward_funcs
        if weights is not None and len(weights) != len(funcs):
            raise ValueError(f"rl.reward_weights has {len(weights)} weights for {len(funcs)} reward_funcs "
                             "(one per function)")
        for i, entry in enumerate(funcs):
            if isinstance(entry, LengthReward) and entry.cache >= (entry.max_length or self.max_completion_length):
                raise ValueError(f"rl.reward_funcs[{i}]: length cache={entry.cache} must be below its max_length "
                                 f"({entry.max_length or self.max_completion_length})")
        return self

    @property
    def clip_high(self) -> float:
        """``epsilon_high``, or ``epsilon`` when unset (TRL's rule)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class _Root(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rl: RLSection


def rl_section(data: object, source: str = "recipe") -> RLSection:
    """``data`` validated as the ``rl:`` section; RecipeError (one line, ``source: ...``) otherwise."""
    from nxd_finetune.recipe.messages import describe_errors

    try:
        return _Root.model_validate({"rl": data}).rl
    except ValidationError as e:
        _, message = describe_errors(e, {"rl": data}, _Root)
        raise RecipeError(f"{source}: {message}") from None

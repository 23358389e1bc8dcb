"""Rewards for GRPO: functions named by import path or built in, their scores per completion, and
the group-normalised advantages, all as TRL 1.x computes them.

A reward function has TRL's signature: ``f(prompts, completions, completion_ids, trainer_state,
**columns) -> list[float | None]``, called with keyword arguments only. ``prompts`` and
``completions`` are strings, or message lists for a conversational dataset (a completion is then
``[{"role": "assistant", "content": text}]``); ``completion_ids`` each completion's tokens (its
stop token included); the dataset's other columns come by name, one value per completion. A
function takes ``**kwargs`` for what it does not read. ``None`` means "not scored" (NaN in the
scores; a completion no function scored gets advantage 0).

A function is named ``module:function`` (``module.sub:name``) or is a built-in that needs no code
(:data:`BUILTINS`): ``exact_match`` (1.0 when the completion's text, stripped, equals a column's
value, stripped), ``regex`` (1.0 when a pattern matches anywhere in the text, ``re.DOTALL``) and
``length`` (DAPO's soft overlong punishment, as ``trl.rewards.get_soft_overlong_punishment``).

A function that raises, returns another count than one per completion, or a value that is not a
number or None is one line naming it (:class:`~nxd_finetune.errors.NxdError`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Mapping, Sequence

import torch

from nxd_finetune.errors import NxdError
from nxd_finetune.rl.section import ExactMatchReward, RegexReward, RLSection

Message = Mapping[str, str]
Text = str | Sequence[Message]
RewardFunc = Callable[..., Sequence[float | None]]
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
BUILTINS = ("exact_match", "regex", "length")


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What reward functions get as ``trainer_state`` (TRL passes its ``TrainerState``; these are
    the fields of it that shape rewards over training)."""

    global_step: int
    max_steps: int


@dataclasses.dataclass(frozen=True)
class Reward:
    """A named reward function and its weight."""

    name: str
    func: RewardFunc
    weight: float = 1.0


def text_of(completion: Text) -> str:
    """A completion's text: the string, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


def exact_match(column: str) -> RewardFunc:
    """1.0 where the completion's text (stripped) equals the row's ``column`` value (stripped), else 0.0."""
    def exact_match(completions: Sequence[Text], **kwargs: Sequence[object]) -> list[float | None]:
        if column not in kwargs:
            raise KeyError(f"the data has no column {column!r} (columns: {', '.join(sorted(kwargs)) or 'none'})")
        return [float(text_of(c).strip() == str(v).strip()) for c, v in zip(completions, kwargs[column], strict=True)]
    return exact_match


def regex(pattern: str) -> RewardFunc:
    """1.0 where ``pattern`` matches anywhere in the completion's text (``re.DOTALL``), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def regex(completions: Sequence[Text], **kwargs: object) -> list[float | None]:
        return [float(compiled.search(text_of(c)) is not None) for c in completions]
    return regex


def length(max_length: int, cache: int) -> RewardFunc:
    """DAPO's soft overlong punishment (TRL's ``get_soft_overlong_punishment``): 0 up to
    ``max_length - cache`` tokens, then falling linearly to -1 at ``max_length``, -1 past it."""
    def length(completion_ids: Sequence[Sequence[int]], **kwargs: object) -> list[float | None]:
        out: list[float | None] = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= max_length - cache else (max_length - cache - n) / cache if n <= max_length
                       else -1.0)
        return out
    return length


def import_reward(path: str) -> RewardFunc:
    """The callable ``module:function`` names; NxdError (one line) when it cannot be had."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise NxdError(f"reward function {path!r} is not 'module:function' (or a built-in: {', '.join(BUILTINS)})")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 -- any import failure is the user's module's
        raise NxdError(f"reward function {path!r}: cannot import {module_name!r}: {_one_line(err)}") from err
    func = getattr(module, attribute, None)
    if not callable(func):
        raise NxdError(f"reward function {path!r}: {module_name!r} has no callable {attribute!r}")
    return func  # type: ignore[no-any-return]


def _one_line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


def score(rewards: Sequence[Reward], prompts: Sequence[Text], completions: Sequence[Text],
          completion_ids: Sequence[Sequence[int]], columns: Mapping[str, Sequence[object]],
          state: TrainerState) -> torch.Tensor:
    """Scores ``[N, F]`` (fp32; NaN where a function returned None) of the ``N`` completions by each
    of the ``F`` functions, called as TRL calls them. ``columns``: the dataset's other columns, one
    value per completion (a prompt's row repeated over its group)."""
    n = len(prompts)
    out = torch.zeros(n, len(rewards), dtype=torch.float32)
    for i, reward in enumerate(rewards):
        try:
            values = list(reward.func(prompts=prompts, completions=completions, completion_ids=completion_ids,
                                      trainer_state=state, **columns))
        except Exception as err:  # noqa: BLE001 -- the user's function: any failure is one line naming it
            raise NxdError(f"reward function {reward.name!r} raised {_one_line(err)}") from err
        if len(values) != n:
            raise NxdError(f"reward function {reward.name!r} returned {len(values)} rewards for {n} completions "
                           "(one per completion, or None)")
        for j, value in enumerate(values):
            if value is None:
                out[j, i] = math.nan
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[j, i] = float(value)
            else:
                raise NxdError(f"reward function {reward.name!r} returned {type(value).__name__} {value!r} for "
                               f"completion {j} (a number or None)")
    return out


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The standard deviation over the non-NaN values, with Bessel's correction (NaN under two values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(count, math.nan, dtype=x.dtype))
    std = torch.sqrt(variance * correction)
    return std if keepdim else std.squeeze() if dim is None else std.squeeze(dim)


@dataclasses.dataclass(frozen=True)
class Advantages:
    """``rewards [N]`` (the weighted sum; NaN where no function scored), ``advantages [N]`` and
    ``std_zero [N]`` (the std the advantage was scaled by is 0: TRL's ``frac_reward_zero_std``)."""

    rewards: torch.Tensor
    advantages: torch.Tensor
    std_zero: torch.Tensor


def advantages(scores: torch.Tensor, weights: torch.Tensor, num_generations: int, scale_rewards: str = "group",
               aggregation: str = "sum_then_normalize") -> Advantages:
    """Group-normalised advantages of ``scores [N, F]`` (groups of ``num_generations`` consecutive
    rows), as TRL 1.x's ``GRPOTrainer``: ``sum_then_normalize`` weights and sums the functions
    (NaN-skipping), subtracts the group mean and divides by the group's (``group``) or the batch's
    (``batch``) std + 1e-4, or not (``none``); ``normalize_then_sum`` normalises each function in
    its group first, then the weighted sum over the batch. Unscored completions get 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise NxdError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    if aggregation not in AGGREGATIONS:
        raise NxdError(f"multi_objective_aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    unscored = torch.isnan(scores).all(dim=1)
    w = weights.to(scores.dtype)[None]
    if aggregation == "sum_then_normalize":
        rewards = (scores * w).nansum(dim=1)
        rewards[unscored] = math.nan
        mean = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        elif num_generations > 1:
            std = nanstd(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
        else:
            std = torch.zeros_like(rewards)
        adv = rewards - mean
        if scale_rewards != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = scores.view(-1, num_generations, scores.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
        rewards = (((grouped - mean_k) / (std_k + 1e-4)).view(-1, scores.shape[1]) * w).nansum(dim=1)
        rewards[unscored] = math.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    std_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages((scores * w).nansum(dim=1).masked_fill(unscored, math.nan), torch.nan_to_num(adv, nan=0.0),
                      std_zero)


def build_rewards(section: RLSection) -> list[Reward]:
    """The section's ``reward_funcs`` as :class:`Reward` s with their ``reward_weights`` (1 each by
    default), named as TRL names them (a function's ``__name__``; a built-in's type); importing a
    ``module:function`` that fails is one line."""
    weights = section.reward_weights or [1.0] * len(section.reward_funcs)
    rewards = []
    for entry, weight in zip(section.reward_funcs, weights, strict=True):
        if isinstance(entry, str):
            func = import_reward(entry)
            rewards.append(Reward(getattr(func, "__name__", entry), func, weight))
        elif isinstance(entry, ExactMatchReward):
            rewards.append(Reward(entry.type, exact_match(entry.column), weight))
        elif isinstance(entry, RegexReward):
            rewards.append(Reward(entry.type, regex(entry.pattern), weight))
        else:
            rewards.append(Reward(entry.type, length(entry.max_length or section.max_completion_length, entry.cache),
                                  weight))
    return rewards

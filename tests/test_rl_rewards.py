"""GRPO rewards (``rl/rewards.py``) against TRL 1.x: scores through TRL's own
``GRPOTrainer._calculate_rewards`` on the same functions and inputs, advantages against TRL's
formula on TRL's ``nanstd``, the length built-in against ``trl.rewards``, and one line for every
broken reward function."""

from __future__ import annotations

import math
import types

import pytest
import torch
from trl.rewards import get_soft_overlong_punishment
from trl.trainer.utils import nanstd as trl_nanstd

from nxd_finetune.errors import NxdError
from nxd_finetune.rl.rewards import (
    Reward,
    TrainerState,
    advantages,
    exact_match,
    import_reward,
    length,
    regex,
    score,
)
from tests.rl_helpers import grpo_trainer

GRPOTrainer = grpo_trainer()

PROMPTS = ["1+1=", "2+2=", "3+3="]
ANSWERS = ["2", "4", "6"]
COMPLETIONS = [" 2", "<a>2</a>", "3", " 4 ", "4x", "", "6", "<a>6</a>", "7 7"]


def half_scored(completions, step_bonus: list[float], trainer_state, **kwargs) -> list[float | None]:
    """Scores even rows (length plus a column and the step), None for odd ones."""
    return [None if i % 2 else len(str(c)) + b + trainer_state.global_step
            for i, (c, b) in enumerate(zip(completions, step_bonus, strict=True))]


def raises(**kwargs):
    raise ValueError("bad\ninput")


def too_few(completions, **kwargs):
    return [1.0]


def not_a_number(completions, **kwargs):
    return ["high"] * len(completions)


def _batch(conversational: bool = False):
    g = 3
    prompts = [p for p in PROMPTS for _ in range(g)]
    answers = [a for a in ANSWERS for _ in range(g)]
    completions = list(COMPLETIONS)
    if conversational:
        prompts = [[{"role": "user", "content": p}] for p in prompts]
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    ids = [[7] * (3 * i) for i in range(len(completions))]
    columns = {"answer": answers, "step_bonus": [0.5 * i for i in range(len(completions))]}
    return prompts, completions, ids, columns


def _rewards() -> list[Reward]:
    return [Reward("exact_match", exact_match("answer"), 1.0), Reward("regex", regex(r"<a>\d+</a>"), 0.5),
            Reward("length", length(20, 8), 2.0),
            Reward("tests.test_rl_rewards:half_scored", import_reward("tests.test_rl_rewards:half_scored"), -0.25)]


@pytest.mark.parametrize("conversational", [False, True])
def test_scores_equal_trls_calculate_rewards(conversational):
    prompts, completions, ids, columns = _batch(conversational)
    rewards = _rewards()
    state = TrainerState(global_step=3, max_steps=10)
    ours = score(rewards, prompts, completions, ids, columns, state)
    trainer = types.SimpleNamespace(  # the attributes TRL's method reads, with the same functions
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        reward_funcs=[r.func for r in rewards], reward_processing_classes=[None] * len(rewards),
        reward_func_names=[r.name for r in rewards], state=state, environments=None,
        _log_completion_extra=lambda *a, **k: None, _log_metric=lambda *a, **k: None,
        args=types.SimpleNamespace(report_to=[]))
    inputs = [{"prompt": p, "answer": a, "step_bonus": b}
              for p, a, b in zip(prompts, columns["answer"], columns["step_bonus"], strict=True)]
    theirs = GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, ids)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    assert ours[:, 0].tolist() == [1, 0, 0, 1, 0, 0, 1, 0, 0]  # exact match, stripped
    assert ours[:, 1].tolist() == [0, 1, 0, 0, 0, 0, 0, 1, 0]


def _trl_advantages(scores, weights, g, scale, aggregation):
    """TRL 1.x ``GRPOTrainer._generate_and_score_completions``' advantage lines, on TRL's nanstd."""
    unscorable = torch.isnan(scores).all(dim=1)
    if aggregation == "sum_then_normalize":
        rewards = (scores * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        if scale in ("group", "none"):
            std = trl_nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        else:
            std = trl_nanstd(rewards).expand_as(rewards)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = scores.view(-1, g, scores.shape[1])
        mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
        std_k = trl_nanstd(grouped, dim=1, keepdim=True)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, scores.shape[1])
        rewards = (reward_k * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = trl_nanstd(rewards).expand_as(rewards)
        adv = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls(scale, aggregation):
    g = 4
    scores = torch.randn(5 * g, 3, generator=torch.Generator().manual_seed(0))
    scores[0:g, 0] = 1.0  # one function constant in a group
    scores[g:2 * g] = 2.0  # a group with no spread at all
    scores[2 * g + 1, 1] = math.nan  # one function did not score a row
    scores[3 * g + 2] = math.nan  # no function scored this row
    weights = torch.tensor([1.0, 0.5, -2.0])
    got = advantages(scores, weights, g, scale, aggregation)
    adv, std_zero = _trl_advantages(scores, weights, g, scale, aggregation)
    assert torch.allclose(got.advantages, adv, atol=1e-6, rtol=0)
    assert torch.equal(got.std_zero, std_zero)
    assert got.advantages[3 * g + 2] == 0.0
    assert torch.isnan(got.rewards[3 * g + 2]) and not torch.isnan(got.rewards[:3 * g + 2]).any()


def test_length_equals_trls_soft_overlong_punishment():
    ids = [[1] * n for n in range(0, 40)]
    assert length(30, 10)(completion_ids=ids) == get_soft_overlong_punishment(30, 10)(completion_ids=ids)


@pytest.mark.parametrize(("func", "message"), [
    (raises, "reward function 'raises' raised ValueError: bad input"),
    (too_few, "reward function 'too_few' returned 1 rewards for 9 completions"),
    (not_a_number, "reward function 'not_a_number' returned str 'high' for completion 0"),
    (exact_match("solution"), "reward function 'exact_match' raised KeyError: \"the data has no column 'solution'"),
])
def test_a_broken_reward_is_one_line_naming_it(func, message):
    prompts, completions, ids, columns = _batch()
    with pytest.raises(NxdError) as err:
        score([Reward(func.__name__, func)], prompts, completions, ids, columns, TrainerState(0, 1))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(("path", "message"), [
    ("no_colon", "is not 'module:function'"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz': ModuleNotFoundError"),
    ("tests.test_rl_rewards:missing", "has no callable 'missing'"),
    ("tests.test_rl_rewards:PROMPTS", "has no callable 'PROMPTS'"),
])
def test_a_bad_reward_path_is_one_line(path, message):
    with pytest.raises(NxdError, match=message) as err:
        import_reward(path)
    assert "\n" not in str(err.value)

"""GRPO's generation metrics under TRL 1.x ``GRPOTrainer``'s names, over a whole generation batch
(every dp rank's completions): the rewards per function and weighted, the advantage groups whose
rewards did not vary, and the completions' lengths."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nxd_finetune.rl.rewards import Advantages, Reward, nanstd


def _value(x: torch.Tensor) -> float:
    v = float(x)
    return v if math.isfinite(v) else math.nan


def generation_metrics(rewards: Sequence[Reward], scores: torch.Tensor, adv: Advantages, lengths: torch.Tensor,
                       truncated: torch.Tensor) -> dict[str, float]:
    """``scores [N, F]`` (NaN: not scored), ``adv`` (:func:`~nxd_finetune.rl.rewards.advantages`
    of them), ``lengths [N]`` (each completion's tokens, its stop token included) and ``truncated
    [N]`` (no stop token) as TRL logs them."""
    out: dict[str, float] = {}
    for i, reward in enumerate(rewards):
        out[f"rewards/{reward.name}/mean"] = _value(torch.nanmean(scores[:, i]))
        out[f"rewards/{reward.name}/std"] = _value(nanstd(scores[:, i]))
    out["reward"] = _value(torch.nanmean(adv.rewards))
    out["reward_std"] = _value(nanstd(adv.rewards))
    out["frac_reward_zero_std"] = float(adv.std_zero.float().mean())
    lengths = lengths.float()
    out["completions/mean_length"] = float(lengths.mean())
    out["completions/min_length"] = float(lengths.min())
    out["completions/max_length"] = float(lengths.max())
    out["completions/clipped_ratio"] = float(truncated.float().mean())
    ended = lengths[~truncated]
    if ended.numel() == 0:
        ended = torch.zeros(1)
    out["completions/mean_terminated_length"] = float(ended.mean())
    out["completions/min_terminated_length"] = float(ended.min())
    out["completions/max_terminated_length"] = float(ended.max())
    return out

"""GRPO's per-token metrics against TRL 1.x ``GRPOTrainer._compute_loss``'s own formulas (its
``entropy_from_logits``, ``nanmin`` / ``nanmax`` over each sequence's masked mean, the masked token
means), on one micro-batch; and a step split into micro-batches (or ranks, or a logging window of
steps) combined as the loop combines them gives the whole batch's values."""

from __future__ import annotations

import pytest
import torch

from nxd_finetune.loss import IGNORE_INDEX, LogitScores, shift_labels
from nxd_finetune.objective import add_stats
from nxd_finetune.rl.objective import GroupRelative

pytest.importorskip("trl")
from trl.trainer.utils import entropy_from_logits, nanmax, nanmin  # noqa: E402

B, T, V, TEMP, EPS, EPS_HIGH = 6, 9, 50, 0.8, 0.2, 0.28


def micro_batch(seed: int, advantages: torch.Tensor, shift: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits ``[B, T, V]`` and the side data: each row 2-3 prompt tokens then its completion (row
    4 without loss tokens: TRL's NaN sequence), old log-probs the current ones minus ``shift`` plus
    noise (ratios on both sides of the clip range)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :2 + seed % 2] = IGNORE_INDEX
    labels[4] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX  # a shorter completion
    logp = torch.log_softmax(logits / TEMP, -1).gather(-1, shift_labels(labels).clamp(min=0)[..., None])[..., 0]
    old = logp - shift + 0.6 * torch.randn(B, T, generator=g)
    return logits, {"labels": labels, "advantages": advantages, "old_logps": old}


def trl_metrics(logits: torch.Tensor, side: dict[str, torch.Tensor]) -> dict[str, float]:
    """TRL's ``_compute_loss`` metrics (``grpo_trainer.py``: ``global_masked_mean``,
    ``masked_seq_mean``, ``nanmin`` / ``nanmax``) on the same tensors."""
    targets = shift_labels(side["labels"])
    mask = (targets != IGNORE_INDEX).float()
    logp = torch.log_softmax(logits / TEMP, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    coef_1 = torch.exp(logp - side["old_logps"])
    adv = side["advantages"][:, None]
    low = ((coef_1 < 1 - EPS) & (adv < 0)).float()
    high = ((coef_1 > 1 + EPS_HIGH) & (adv > 0)).float()

    def token_mean(x: torch.Tensor) -> float:
        return float((x * mask).sum() / mask.sum())

    def seq_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum(-1) / mask.sum(-1)

    return {"entropy": token_mean(entropy_from_logits(logits / TEMP)), "clip_ratio/low_mean": token_mean(low),
            "clip_ratio/high_mean": token_mean(high), "clip_ratio/region_mean": token_mean(torch.maximum(low, high)),
            "clip_ratio/low_min": float(nanmin(seq_mean(low))), "clip_ratio/high_max": float(nanmax(seq_mean(high)))}


def ours(objective: GroupRelative, logits: torch.Tensor, side: dict[str, torch.Tensor],
         rows: slice = slice(None)) -> torch.Tensor:
    part = {k: v[rows] for k, v in side.items()}
    _, stats = objective.loss(LogitScores(logits[rows], shift_labels(part["labels"])), part)
    return stats


MIXED = torch.tensor([1.2, -0.7, 0.4, -1.1, 0.9, -0.3])
NEGATIVE = torch.tensor([-1.2, -0.7, -0.4, -1.1, -0.9, -0.3])


@pytest.mark.parametrize(("advantages", "shift"), [(MIXED, 0.2), (NEGATIVE, -1.0)], ids=["mixed", "all-negative"])
def test_entropy_and_clip_ratios_are_trls(advantages, shift):
    objective = GroupRelative(loss_type="grpo", epsilon=EPS, epsilon_high=EPS_HIGH, temperature=TEMP)
    logits, side = micro_batch(0, advantages, shift)
    want = trl_metrics(logits, side)
    got = objective.train_record(ours(objective, logits, side).tolist())
    assert set(want) <= set(got)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
    # the case is not trivial: some sequence clipped on the side the advantages allow
    assert (want["clip_ratio/high_max"] if shift > 0 else want["clip_ratio/low_min"]) > 0


def test_micro_batches_ranks_and_steps_combine_to_the_whole():
    """Two micro-batches (or dp ranks) of a step, and two steps of a logging window, combined as
    the loop combines them (:func:`add_stats` with ``train_max``): the metrics of all their tokens
    and the extreme sequence over all of them."""
    objective = GroupRelative(loss_type="dapo", epsilon=EPS, epsilon_high=EPS_HIGH, temperature=TEMP)
    (l1, s1), (l2, s2) = micro_batch(1, MIXED, -0.3), micro_batch(2, -MIXED, 0.4)
    whole = {k: torch.cat([s1[k], s2[k]]) for k in s1}
    want = trl_metrics(torch.cat([l1, l2]), whole)
    combined = None
    for logits, side in ((l1, s1), (l2, s2)):
        for rows in (slice(0, 2), slice(2, None)):
            combined = add_stats(combined, ours(objective, logits, side, rows), objective.train_max)
    assert combined is not None
    got = objective.train_record(combined.tolist())
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key
    assert got["clip_ratio/high_max"] > 0
    # a micro-batch without a loss token logs no extremes (TRL: NaN, dropped)
    empty = {**s1, "labels": torch.full_like(s1["labels"], IGNORE_INDEX)}
    assert objective.train_record(ours(objective, l1, empty).tolist()) == {}
    alone = add_stats(ours(objective, l1, empty), ours(objective, l1, s1, slice(0, 2)), objective.train_max)
    assert alone is not None and objective.train_record(alone.tolist()) == objective.train_record(
        ours(objective, l1, s1, slice(0, 2)).tolist())

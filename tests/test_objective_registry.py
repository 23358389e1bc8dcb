"""A new objective is one module plus its registration (``nxd_finetune/objectives.py``).

The objective here is defined in this test and registered in ``OBJECTIVES`` for its duration only:
a token-weighted cross entropy whose side data (:meth:`Objective.side`) holds a per-token weight
``[B, T]`` and a per-row scale ``[B]`` besides the labels, read through the per-token log-probs
(``Scores.token_nll``). Named in a recipe (``objective: weighted``), it trains through
``trainer.run`` unchanged: the recipe accepts it, the run builds it from its record, the step
returns its metrics, and on pp2 (1F1B, and with the output layer chunked in the loss) its side
data reaches the last stage, giving the single-process run's loss, metrics and eval record."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from nxd_finetune.errors import RecipeError
from nxd_finetune.loss import IGNORE_INDEX, Scores, shift_labels
from nxd_finetune.objective import ObjectiveRecord, Section, SideData, TokenBatch
from nxd_finetune.objectives import OBJECTIVES, objective_of
from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.sft import trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
STEPS = 4
BASE = ["data.max_seq_len=64", f"training.max_steps={STEPS}", "training.micro_batch_size=2",
        "training.grad_accum=2", "training.warmup_steps=0", "training.eps=1e-6", "logging.progress=false",
        "logging.every_n_steps=1", "eval.every_n_steps=null", "eval.max_batches=2",
        "checkpoint.every_n_steps=null", "objective=weighted"]

pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path


class WeightedTokens:
    """Cross entropy of each target token times its weight and its row's scale, summed; the metric
    ``weighted_nll`` is that sum over the sum of the weights."""

    name = "weighted"
    eval_width = 2
    train_width = 2
    progress_metric = "weighted_nll"

    def side(self, batch: TokenBatch) -> SideData:
        ids = batch["input_ids"]
        weights, scale = 1.0 + (ids % 3).float() / 2, 1.0 + (ids[:, 0] % 2).float()  # [B, T] and [B]
        return {"labels": batch["labels"], "weights": weights, "scale": scale}

    def labels(self, side: SideData) -> torch.Tensor:
        return side["labels"]

    def count(self, batch: TokenBatch) -> torch.Tensor:
        return (shift_labels(batch["labels"]) != IGNORE_INDEX).sum().to(torch.int64)

    def loss(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor]:
        nll, position = scores.token_nll()  # each target's -log p, at its flat position in [B * T]
        weight = side["weights"].reshape(-1)[position] * side["scale"][position // side["labels"].shape[1]]
        loss = (nll * weight).sum()
        return loss, torch.stack([loss.detach(), weight.sum()]).float()

    def eval_stats(self, scores: Scores, side: SideData) -> torch.Tensor:
        return self.loss(scores, side)[1]

    def train_record(self, stats: Sequence[float]) -> dict[str, float]:
        total, weights = stats
        return {"weighted_nll": total / weights} if weights else {}

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]:
        return {f"eval_{k}": v for k, v in self.train_record(stats).items()}


def build(section: Section) -> WeightedTokens:
    return WeightedTokens()


RECORD = ObjectiveRecord("weighted", build=build)  # its registration: OBJECTIVES["weighted"] = RECORD


def _run_layouts(recipe_dicts: list[dict]) -> list[dict | None]:
    torch.set_num_threads(1)
    OBJECTIVES["weighted"] = RECORD  # the workers' registry (forked: already there)
    return [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]


def test_a_registered_objective_trains_on_pp2_as_in_one_process(tmp_path, monkeypatch):
    with pytest.raises(RecipeError, match="objective: expected one of sft, dpo, orpo, grpo, got 'weighted'"):
        load_recipe(QUICKSTART, [*BASE, f"output.dir={tmp_path / 'refused'}"])
    monkeypatch.setitem(OBJECTIVES, "weighted", RECORD)
    single = load_recipe(QUICKSTART, [*BASE, f"output.dir={tmp_path / 'single'}"])
    assert isinstance(objective_of(single), WeightedTokens)
    ref = trainer.run(single)
    assert ref is not None
    want = [h for h in ref["history"] if "train_loss" in h]
    assert len(want) == STEPS and all(math.isfinite(h["weighted_nll"]) for h in want)
    assert len({round(h["train_loss"], 4) for h in want}) > 2  # it trained
    assert ref["eval_after"]["eval_weighted_nll"] > 0

    layouts = {"pp2-1f1b": ["parallel.pp=2"], "pp2-chunked": ["parallel.pp=2", "training.loss_chunk_tokens=16"]}
    dicts = [load_recipe(QUICKSTART, [*BASE, f"output.dir={tmp_path / name}", "parallel.nproc=2", *more]).to_dict()
             for name, more in layouts.items()]
    results = launch(_run_layouts, 2, dicts, start_method="fork")[0]
    for name, got in zip(layouts, results, strict=True):
        assert got is not None
        hist = [h for h in got["history"] if "train_loss" in h]
        for step, (a, b) in enumerate(zip(hist, want, strict=True), 1):
            for k in ("train_loss", "weighted_nll"):
                assert a[k] == pytest.approx(b[k], rel=1e-5), (name, step, k, a[k], b[k])
        assert got["eval_after"]["eval_weighted_nll"] == pytest.approx(ref["eval_after"]["eval_weighted_nll"],
                                                                       rel=1e-5), name

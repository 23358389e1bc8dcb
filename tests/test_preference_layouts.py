"""DPO on the parallel layouts (real gloo groups): tp2, dp2 + ZeRO-1 and pp2 (1F1B, the preference
target through the pipeline's last stage) reproduce the single-process run's loss and reward
curve, each through ``trainer.run_rank`` (the reference pass included: under dp each rank computes
its share of the reference log-probs, gathered)."""

from __future__ import annotations

import pytest
import torch

from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.sft import trainer
from tests.preference_helpers import dpo_recipe, dpo_setup

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path

STEPS = 6
# every layout sees 2 pairs per optimizer step (micro x accum x dp)
LAYOUTS = {
    "tp2": ({"tp": 2}, {"micro_batch_size": 1, "grad_accum": 2}),
    "dp2-zero1": ({"zero1": True}, {"micro_batch_size": 1, "grad_accum": 1}),
    "pp2-1f1b": ({"pp": 2}, {"micro_batch_size": 1, "grad_accum": 2}),
}
KEYS = ("train_loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
        "logps/chosen", "logps/rejected")


def _run_layouts(recipe_dicts: list[dict]) -> list[dict | None]:
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]


def test_dpo_layouts_match_single_process(make_tiny_hf, tmp_path):
    setup = dpo_setup(make_tiny_hf, tmp_path, 2 * STEPS, seed=5)
    common = {"max_steps": STEPS, "lr": 5e-3, "eps": 1e-6}
    ref = trainer.run(recipe_from_dict(dpo_recipe(setup, tmp_path / "single", 0.1,
                                                  {**common, "micro_batch_size": 2, "grad_accum": 1})))
    assert ref is not None
    dicts = [dpo_recipe(setup, tmp_path / name, 0.1, {**common, **training}, parallel={"nproc": 2, **par})
             for name, (par, training) in LAYOUTS.items()]
    results = launch(_run_layouts, 2, dicts, start_method="fork")
    want = [h for h in ref["history"] if "train_loss" in h]
    assert len(want) == STEPS and len({round(h["train_loss"], 4) for h in want}) > 2
    for name, got in zip(LAYOUTS, results[0], strict=True):
        hist = [h for h in got["history"] if "train_loss" in h]
        for step, (a, b) in enumerate(zip(hist, want, strict=True), 1):
            for k in KEYS:
                assert a[k] == pytest.approx(b[k], abs=1e-5), (name, step, k, a[k], b[k])

"""A GRPO run end to end through ``run`` (``objective: grpo``): completions sampled on the training
model with the built-in rewards, TRL's metric names in ``metrics.jsonl``, the adapter loading in
peft with its objective recorded; stopped between the two steps of one generation
(``num_iterations: 2``) and resumed, it equals the uninterrupted run: the same completions
(sampling seeded per step), losses and adapter bytes."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.sft.trainer import run
from tests.rl_helpers import grpo_recipe

pytestmark = pytest.mark.slow  # end-to-end runs

STEPS = 5


def records(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_run_logs_trls_metrics_and_resumes_the_same(make_tiny_hf, tmp_path):
    _, model_dir = make_tiny_hf("llama")
    whole = tmp_path / "whole"
    summary = run(recipe_from_dict(grpo_recipe(tmp_path, model_dir, whole, STEPS)))
    assert summary is not None and summary["steps"] == STEPS and summary["objective"] == "grpo"
    logged = records(whole)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    for r in logged:
        assert {"train_loss", "kl", "clip_ratio/region_mean", "clip_ratio/low_mean", "grad_norm"} <= set(r)
        generated = r["step"] % 2 == 1  # every num_iterations-th step samples; the next reuses it
        for key in ("reward", "reward_std", "rewards/exact_match/mean", "rewards/regex/std",
                    "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std"):
            assert (key in r) == generated, (r["step"], key)
    assert 1 <= logged[0]["completions/mean_length"] <= 4
    # the adapter loads in peft, with its objective recorded
    final = whole / "final"
    with safe_open(str(final / "adapter_model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["nxd_objective"], meta["nxd_loss_type"], meta["nxd_reference"]) == ("grpo", "grpo", "base")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        base = hf(ids).logits
        tuned = peft.PeftModel.from_pretrained(hf, final).eval()(ids).logits
    assert (tuned - base).abs().max() > 1e-4

    # stopped after step 3 (a generation step: its reuse at step 4 comes from the checkpoint), resumed
    parts = tmp_path / "parts"
    run(recipe_from_dict(grpo_recipe(tmp_path, model_dir, parts, 3)))
    run(recipe_from_dict(grpo_recipe(tmp_path, model_dir, parts, STEPS)))
    resumed = records(parts)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(resumed, logged, strict=True):
        for key in ("train_loss", "kl", "grad_norm", "reward", "completions/mean_length"):
            assert (key in a) == (key in b) and a.get(key) == pytest.approx(b.get(key), abs=1e-6), (a["step"], key)
    assert (parts / "final" / "adapter_model.safetensors").read_bytes() == \
        (final / "adapter_model.safetensors").read_bytes()

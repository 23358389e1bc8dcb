"""A GRPO run end to end through ``run`` (``objective: grpo``): completions sampled on the training
model with the built-in rewards, TRL's metric names in ``metrics.jsonl``, the adapter loading in
peft with its objective recorded; stopped between the two steps of one generation
(``num_iterations: 2``) and resumed, it equals the uninterrupted run: the same completions
(sampling seeded per step), losses and adapter bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import yaml
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
        assert {"train_loss", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/low_min",
                "clip_ratio/high_max", "grad_norm"} <= set(r)
        generated = r["step"] % 2 == 1  # every num_iterations-th step samples; the next reuses it
        for key in ("reward", "reward_std", "rewards/exact_match/mean", "rewards/regex/std",
                    "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std",
                    "time/generation_s", "time/generation_tokens_per_s"):
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


def test_grpo_recipe_validates_and_runs_through_the_cli(make_tiny_hf, tmp_path):
    """``nxd-finetune validate`` and ``nxd-finetune run`` on a GRPO recipe file; a broken reward
    function is one line."""
    _, model_dir = make_tiny_hf("llama")
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(grpo_recipe(tmp_path, model_dir, tmp_path / "out", 2)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nxd_finetune", *args], env=env, capture_output=True, text=True,
                              timeout=600)

    checked = cli("validate", str(path))
    assert checked.returncode == 0 and "recipe is valid" in checked.stdout, checked.stdout + checked.stderr
    ran = cli("run", str(path))
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    assert [r["step"] for r in records(tmp_path / "out")] == [1, 2] and "reward" in records(tmp_path / "out")[0]
    broken = cli("run", str(path), "rl.reward_funcs=[tests.rl_helpers:no_such_reward]", "rl.reward_weights=null",
                 f"output.dir={tmp_path / 'b'}")
    lines = [line for line in broken.stderr.splitlines() if line.strip()]
    assert broken.returncode != 0 and "Traceback" not in broken.stderr
    assert "reward function 'tests.rl_helpers:no_such_reward': 'tests.rl_helpers' has no callable" in lines[-1]
    held_out = cli("run", str(path), "data.eval_fraction=0.2", f"output.dir={tmp_path / 'e'}")
    lines = [line for line in held_out.stderr.splitlines() if line.strip()]
    assert held_out.returncode != 0 and "Traceback" not in held_out.stderr
    assert "objective=grpo has no eval over data.eval / data.eval_fraction yet" in lines[-1]


def test_the_lightning_module_trains_grpo_as_run_does(make_tiny_hf, tmp_path):
    """``NxdLightningModule`` on a GRPO recipe takes the objective's batch source: the same curve
    as ``run``, the generation metrics in its history."""
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from nxd_finetune.lightning import NxdLightningModule, NxdStrategy

    _, model_dir = make_tiny_hf("llama")
    rl = {"reward_funcs": ["tests.rl_helpers:token_reward"], "reward_weights": None}
    ref = run(recipe_from_dict(grpo_recipe(tmp_path, model_dir, tmp_path / "run", 4, **rl)))
    module = NxdLightningModule(recipe_from_dict(grpo_recipe(tmp_path, model_dir, tmp_path / "light", 4, **rl)))
    pl.Trainer(devices=1, accelerator="cpu", strategy=NxdStrategy(), max_steps=4, logger=False,
               default_root_dir=tmp_path, enable_model_summary=False, enable_progress_bar=False, limit_val_batches=0,
               num_sanity_val_steps=0).fit(module)
    assert ref is not None
    got = [h for h in module.history if "train_loss" in h]
    assert len(got) == len(ref["history"]) == 4
    for a, b in zip(got, ref["history"], strict=True):
        for key in ("train_loss", "kl", "entropy", "clip_ratio/high_max", "reward", "rewards/token_reward/mean"):
            assert (key in a) == (key in b) and a.get(key) == pytest.approx(b.get(key), abs=1e-6), (a["step"], key)

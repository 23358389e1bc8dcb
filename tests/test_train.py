"""The training loop end to end: determinism, gradient-accumulation equivalence, learning, saving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nxd_finetune.recipe import load_recipe
from nxd_finetune.sft import trainer
from nxd_finetune.sft.schedule import lr_factor

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
# short and small: a few steps of the quickstart on 64-token rows
FAST = ["data.max_seq_len=64", "training.max_steps=4", "training.micro_batch_size=4", "training.warmup_steps=1",
        "logging.progress=false", "logging.every_n_steps=1", "eval.max_batches=2"]


@pytest.fixture(scope="module")
def cache(quickstart_cache):
    return quickstart_cache


def run(tmp_path, *overrides):
    recipe = load_recipe(QUICKSTART, [*FAST, f"output.dir={tmp_path}", *overrides])
    return trainer.run(recipe)


def losses(out_dir):
    lines = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in lines if "train_loss" in r]


def test_same_seed_same_loss_curve_bit_for_bit(cache, tmp_path):
    run(tmp_path / "a")
    run(tmp_path / "b")
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == 4 and a == b
    run(tmp_path / "c", "training.seed=7")
    assert losses(tmp_path / "c") != a


def test_grad_accumulation_matches_larger_micro_batch(cache, tmp_path):
    # 4 rows x 2 accumulation steps == 8 rows x 1: losses are token-weighted over the whole step
    run(tmp_path / "big", "training.micro_batch_size=8", "training.grad_accum=1", "training.max_steps=3")
    run(tmp_path / "acc", "training.micro_batch_size=4", "training.grad_accum=2", "training.max_steps=3")
    big, acc = losses(tmp_path / "big"), losses(tmp_path / "acc")
    assert torch.allclose(torch.tensor(big), torch.tensor(acc), rtol=1e-5), (big, acc)


def test_full_sft_saves_hf_checkpoint(cache, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = run(tmp_path, "lora=null", "training.max_steps=2", "training.lr=1e-3")
    assert summary["trainable_parameters"] == summary["parameters"]
    final = tmp_path / "final"
    hf = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert (final / "model.safetensors").exists() and tok.eos_token is not None
    # the saved weights are the trained ones: they differ from the untouched base
    from nxd_finetune.quickstart import ensure_tiny_model

    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    w, w0 = hf.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(w, w0)


def test_lr_schedule_shapes():
    assert [round(lr_factor(s, 10, 2, "constant"), 3) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, 10, 2, "cosine") == pytest.approx(1.0)
    assert lr_factor(10, 10, 2, "cosine", min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(6, 10, 2, "linear") == pytest.approx(0.5)


def test_cli_quickstart_end_to_end(cache, tmp_path):
    """`nxd-finetune run` on the quickstart, shortened: exit 0, metrics, summary, a PEFT adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    env = {**os.environ, "NXD_FINETUNE_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "nxd_finetune", "run", str(QUICKSTART), *FAST, f"output.dir={out}",
         "eval.every_n_steps=2"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 2, 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["trainable_parameters"] < summary["parameters"]
    peaks = [r["peak_host_mb"] for r in records if "train_loss" in r]  # the run's high-water mark so far
    assert 0 < peaks[0] and peaks == sorted(peaks) and peaks[-1] <= summary["memory"][0]["peak_host_mb"], peaks
    adapter = out / "final"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    from nxd_finetune.quickstart import ensure_tiny_model

    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    ids = torch.randint(0, base.config.vocab_size, (1, 16))
    with torch.no_grad():
        plain = base(ids).logits
        tuned = PeftModel.from_pretrained(base, adapter)(ids).logits
    assert (tuned - plain).abs().max() > 1e-4  # training moved the adapter off its zero init

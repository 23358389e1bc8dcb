"""End-to-end parity of the trainer's parallel layouts with the single-process run (real gloo groups).

Every layout trains the quickstart's tiny Llama (hidden 256, 4 layers, 8 query / 4 KV heads) for 10
optimizer steps on the same global batch (4 packed rows of 64 tokens per step), fp32, through
``trainer.run_rank``, the function every worker of ``nxd-finetune run`` executes. The reference is
the plain single-process ``trainer.run``. Checked for each layout, LoRA and full SFT:

- the logged loss curve equals the reference within 1e-5 relative, the gradient norms within 1e-4;
- the final artefact equals the reference's: the PEFT adapter files (same keys and shapes, values
  to 2e-5) or the HF checkpoint of full SFT; the tp/pp adapters are gathered by the export;
- eval statistics over the whole eval set equal the reference's.

Activation checkpointing is checked through the trainer too: single-process (the recomputation
counted) and under tp=2 with sequence parallel. ``nxd-finetune run --nproc 2`` itself runs once from
the command line, publishing to a local registry.

The 2-process layouts share one launch of forked workers (a layout after another in the same
processes, each building its own groups); the 4-process ones another. AdamW's ``eps`` is raised to
1e-6 so that elements whose gradient is at rounding level do not turn float summation-order noise
into visible weight differences (with 1e-8, a different micro-batch split of the *same*
single-process run moves a few weights by ~1e-6 after 10 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.sft import trainer

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
BASE = ["data.max_seq_len=64", "training.max_steps=10", "training.micro_batch_size=2", "training.warmup_steps=2",
        "training.eps=1e-6", "logging.progress=false", "logging.every_n_steps=1", "eval.every_n_steps=null",
        "checkpoint.every_n_steps=null"]
# name -> overrides; every layout sees 4 rows per optimizer step (micro 2 x accum x dp)
LAYOUTS_2 = {
    "tp2": ["parallel.tp=2", "training.grad_accum=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "training.grad_accum=2"],
    "tp2-sp-ckpt": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.activation_checkpointing=full",
                    "training.grad_accum=2"],
    "pp2-1f1b": ["parallel.pp=2", "training.grad_accum=2"],
    # the first step of a schedule records the graph (shape inference), later ones recompute
    "pp2-ckpt": ["parallel.pp=2", "parallel.activation_checkpointing=full", "training.grad_accum=2"],
    "pp2-interleaved": ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.pp_schedule=interleaved_1f1b",
                        "training.grad_accum=2"],
    # the last stage runs the output layer and the loss 16 target positions at a time
    "pp2-chunked-loss": ["parallel.pp=2", "training.grad_accum=2", "training.loss_chunk_tokens=16"],
    "dp2": ["training.grad_accum=1"],
    "dp2-zero1": ["parallel.zero1=true", "training.grad_accum=1"],
}
LAYOUTS_4 = {
    "tp2-pp2": ["parallel.tp=2", "parallel.pp=2", "training.grad_accum=2"],
    "tp2-dp2-zero1": ["parallel.tp=2", "parallel.zero1=true", "training.grad_accum=1"],
}
MODES = {"lora": [], "sft": ["lora=null", "training.lr=5e-4"]}


pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path


def recipe(out: Path, nproc: int, *overrides: str):
    return load_recipe(QUICKSTART, [*BASE, f"parallel.nproc={nproc}", f"output.dir={out}", *overrides])


def _run_layouts(recipe_dicts: list[dict]) -> list[dict | None]:
    """Worker: every recipe in turn, in this process of the launched world."""
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]


def _curve(summary: dict) -> list[float]:
    return [h["train_loss"] for h in summary["history"]]


def _final_tensors(summary: dict) -> dict[str, torch.Tensor]:
    final = Path(summary["output"])
    name = "adapter_model.safetensors" if (final / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(final / name)


def _check_same(name: str, got: dict, ref: dict) -> None:
    a, b = torch.tensor(_curve(got), dtype=torch.float64), torch.tensor(_curve(ref), dtype=torch.float64)
    assert a.shape == b.shape == (10,), name
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (name, a.tolist(), b.tolist())
    # the gradient norm too: AdamW hides a gradient scaled by a constant (a dp mean for a sum), this does not
    ga, gb = ([h["grad_norm"] for h in s["history"]] for s in (got, ref))
    assert torch.allclose(torch.tensor(ga), torch.tensor(gb), rtol=1e-4, atol=0), (name, ga, gb)
    assert [h["tokens"] for h in got["history"]] == [h["tokens"] for h in ref["history"]], name
    ev_got, ev_ref = got["eval_after"], ref["eval_after"]
    assert ev_got["eval_loss"] == pytest.approx(ev_ref["eval_loss"], rel=1e-5), name
    assert ev_got["eval_accuracy"] == pytest.approx(ev_ref["eval_accuracy"], abs=1e-9), name
    assert got["trainable_parameters"] == ref["trainable_parameters"], name
    assert got["parameters"] == ref["parameters"], name
    tg, tr = _final_tensors(got), _final_tensors(ref)
    assert tg.keys() == tr.keys(), (name, sorted(set(tg) ^ set(tr))[:4])
    for k in tr:
        assert tg[k].shape == tr[k].shape, (name, k)
        diff = (tg[k].float() - tr[k].float()).abs().max().item()
        assert diff <= 2e-5, (name, k, diff)


@pytest.fixture(scope="module")
def references(quickstart_cache, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    return {mode: trainer.run(recipe(out / mode, 1, "training.grad_accum=2", *extra)) for mode, extra in MODES.items()}


def _run_and_check(references, tmp_path, layouts: dict, nproc: int) -> list:
    """Every (mode, layout) in one launch of ``nproc`` forked workers, each checked against the reference."""
    dicts, names = [], []
    for mode, extra in MODES.items():
        for name, layout in layouts.items():
            names.append(f"{mode}/{name}")
            dicts.append(recipe(tmp_path / mode / name, nproc, *layout, *extra).to_dict())
    results = launch(_run_layouts, nproc, dicts, start_method="fork")
    for name, got in zip(names, results[0], strict=True):
        assert got["parallel"]["nproc"] == nproc, name
        _check_same(name, got, references[name.split("/")[0]])
    return results


def test_two_process_layouts_match_single_process(references, tmp_path):
    results = _run_and_check(references, tmp_path, LAYOUTS_2, 2)
    assert all(r is None for r in results[1])  # only global rank 0 reports
    # the tp=2 adapter is a plain PEFT adapter of the unsharded model
    from peft import LoraConfig as PeftLoraConfig

    cfg = PeftLoraConfig.from_pretrained(tmp_path / "lora" / "tp2" / "final")
    assert cfg.r == 16 and sorted(cfg.target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                           "up_proj", "v_proj"]


def test_four_process_layouts_match_single_process(references, tmp_path):
    _run_and_check(references, tmp_path, LAYOUTS_4, 4)


@pytest.mark.parametrize("mode, overrides, module", [
    ("lora", ["parallel.activation_checkpointing=full"], "DecoderLayer"),
    ("sft", ["parallel.activation_checkpointing=selective", "parallel.checkpoint_modules=[MLP]"], "MLP"),
])
def test_activation_checkpointing_recomputes_and_keeps_the_run(references, tmp_path, monkeypatch, mode, overrides,
                                                               module):
    """Through the trainer: the checkpointed modules run twice per training micro-batch (forward
    without recording the autograd graph, then recomputed with it in backward) and the run is the
    reference's (loss curve, eval, final files)."""
    from nxd_finetune.models import llama

    cls, calls = getattr(llama, module), []
    forward = cls.forward

    def counted(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", counted)
    got = trainer.run(recipe(tmp_path / "ckpt", 1, "training.grad_accum=2", *MODES[mode], *overrides))
    _check_same(f"{mode}/checkpointing", got, references[mode])
    layers = 4  # the quickstart model's decoder layers, one MLP each
    # grad mode only in the recompute (the forward, like eval, runs without it): once per layer
    # and micro-batch, 10 steps x 2 micro-batches
    assert calls.count(True) == 10 * 2 * layers


def test_cli_run_nproc2_tp2_publishes_the_reference_adapter(references, quickstart_cache, tmp_path):
    """The user's path end to end: ``nxd-finetune run --nproc 2 parallel.tp=2`` in a fresh process
    (elastic launcher, spawned workers) writes the reference's adapter and publishes it to a local
    registry with the layout in the manifest; an impossible layout is one line and exit 2."""
    import json
    import os
    import subprocess
    import sys

    from nxd_finetune.registry import pull

    env = {**os.environ, "NXD_FINETUNE_CACHE": str(quickstart_cache), "TMPDIR": str(tmp_path),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out, reg = tmp_path / "cli", tmp_path / "reg"
    cmd = [sys.executable, "-m", "nxd_finetune", "run", str(QUICKSTART), "--nproc", "2", *BASE,
           "parallel.tp=2", "training.grad_accum=2", f"output.dir={out}",
           f"output.registry={reg}/bot"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((out / "summary.json").read_text())
    _check_same("cli/tp2", got, references["lora"])
    assert got["registry_version"] == 1
    pulled = tmp_path / "pulled"
    pull(f"{reg}/bot:1", pulled)
    manifest = json.loads((pulled / "manifest.json").read_text())
    assert manifest["parallel"]["tp"] == 2 and manifest["parallel"]["nproc"] == 2
    assert manifest["metrics"]["final_loss"] == pytest.approx(_curve(references["lora"])[-1], rel=1e-5)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (pulled / name).read_bytes() == (out / "final" / name).read_bytes(), name

    bad = subprocess.run([sys.executable, "-m", "nxd_finetune", "run", str(QUICKSTART), "--nproc", "3",
                          "parallel.tp=2", f"output.dir={tmp_path / 'bad'}"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "not divisible by tp*pp" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()

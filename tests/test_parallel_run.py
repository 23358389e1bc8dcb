"""End-to-end parity of the trainer's parallel layouts with the single-process run (real gloo groups).

Every layout trains the quickstart's tiny Llama (hidden 256, 4 layers, 8 query / 4 KV heads) for 10
optimizer steps on the same global batch (4 packed rows of 64 tokens per step), fp32, through
``trainer.run_rank``, the function every worker of ``nxd-finetune run`` executes. The reference is
the plain single-process ``trainer.run``. Checked for each layout, LoRA and full SFT:

- the logged loss curve equals the reference within 1e-5 relative;
- the final artefact equals the reference's: the PEFT adapter files (same keys and shapes, values
  to 2e-5) or the HF checkpoint of full SFT; the tp/pp adapters are gathered by the export;
- eval statistics over the whole eval set equal the reference's.

The 2-process layouts share one launch of forked workers (a layout after another in the same
processes, each building its own groups); the 4-process ones another. AdamW's ``eps`` is raised to
1e-6 so that elements whose gradient is at rounding level do not turn float summation-order noise
into visible weight differences (with 1e-8, a different micro-batch split of the *same*
single-process run moves a few weights by ~1e-6 after 10 steps).
"""

from __future__ import annotations

import tempfile
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
    "pp2-1f1b": ["parallel.pp=2", "training.grad_accum=2"],
    "pp2-interleaved": ["parallel.pp=2", "parallel.virtual_stages=2", "parallel.pp_schedule=interleaved_1f1b",
                        "training.grad_accum=2"],
    "dp2": ["training.grad_accum=1"],
    "dp2-zero1": ["parallel.zero1=true", "training.grad_accum=1"],
}
LAYOUTS_4 = {
    "tp2-pp2": ["parallel.tp=2", "parallel.pp=2", "training.grad_accum=2"],
    "tp2-dp2-zero1": ["parallel.tp=2", "parallel.zero1=true", "training.grad_accum=1"],
}
MODES = {"lora": [], "sft": ["lora=null", "training.lr=5e-4"]}


@pytest.fixture(autouse=True)
def _tmpdir_under_tmp_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


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
    assert got["parallel"]["nproc"] > 1
    a, b = torch.tensor(_curve(got), dtype=torch.float64), torch.tensor(_curve(ref), dtype=torch.float64)
    assert a.shape == b.shape == (10,), name
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (name, a.tolist(), b.tolist())
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

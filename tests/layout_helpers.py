"""The trainer on several layouts against one process: the workers' runs and the comparisons of
their summaries (tests/test_families_parallel.py, tests/test_moe_expert_parallel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.sft import trainer


def run_layouts(recipe_dicts: list[dict]) -> list[dict | None]:
    """Worker: ``trainer.run_rank`` of each recipe in turn; the summaries (rank 0's, None elsewhere)."""
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]


def final_tensors(summary: dict) -> dict[str, torch.Tensor]:
    """The run's final adapter, else its final full checkpoint."""
    final = Path(summary["output"])
    name = "adapter_model.safetensors" if (final / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(final / name)


def assert_same_files(name: str, got: dict, ref: dict) -> None:
    """The two runs' final tensors: the same keys, values within 2e-5."""
    tg, tr = final_tensors(got), final_tensors(ref)
    assert tg.keys() == tr.keys(), (name, sorted(set(tg) ^ set(tr))[:4])
    for k in tr:
        assert (tg[k] - tr[k]).abs().max().item() <= 2e-5, (name, k)


def assert_same_curves(name: str, got: dict, ref: dict, steps: int) -> None:
    """``steps`` losses within 1e-5 and gradient norms within 1e-4 (relative), the same parameter counts."""
    curve = [torch.tensor([h[k] for h in s["history"]], dtype=torch.float64) for s in (got, ref)
             for k in ("train_loss", "grad_norm")]
    assert curve[0].shape == (steps,), name
    assert torch.allclose(curve[0], curve[2], rtol=1e-5, atol=0), (name, curve[0].tolist(), curve[2].tolist())
    assert torch.allclose(curve[1], curve[3], rtol=1e-4, atol=0), (name, curve[1].tolist(), curve[3].tolist())
    assert (got["parameters"], got["trainable_parameters"]) == (ref["parameters"], ref["trainable_parameters"])


def assert_same_finish(name: str, got: dict, ref: dict) -> None:
    """A run resumed from a step-2 checkpoint: steps 3 and 4 and the final files equal the reference's."""
    steps = {h["step"]: h for h in got["history"]}
    ref_steps = {h["step"]: h for h in ref["history"]}
    for step in (3, 4):
        assert steps[step]["train_loss"] == pytest.approx(ref_steps[step]["train_loss"], rel=1e-5), (name, step)
        assert steps[step]["grad_norm"] == pytest.approx(ref_steps[step]["grad_norm"], rel=1e-4), (name, step)
    assert_same_files(name, got, ref)

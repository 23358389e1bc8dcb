"""A DPO run computes a pair's reference log-probs at the step that first uses it, not every pair
of the data set before its first step (issue 46 item 5).

Counted with a forward hook on the model's embedding (every forward of the model passes it once):
the forwards without autograd (the reference passes) before the first training forward hold only
the first step's pairs, and a run of k steps over N pairs computes k x batch pairs. The values
are stored as they are computed (``ref-<key>/parts/``): a later run over the same data cache
with more steps computes only the pairs the first one did not reach, none in its second epoch,
and then holds the split whole (``ref_logps.safetensors``, no parts left), its first steps'
curve the first run's. The eval pairs are computed at the first eval, after training here. A
damaged part is named in one warning line and computed again. With the base model as the
reference (the adapter off), the step-by-step values give tp2, dp2 + ZeRO-1 and pp2 the
one-process curve.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from nxd_finetune.data.ref_store import PARTS_DIR, REF_FILE
from nxd_finetune.errors import NxdWarning
from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.sft import trainer
from nxd_finetune.sft.summary import RunSummary
from tests.preference_helpers import dpo_recipe, dpo_setup

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path
PAIRS, PER_STEP = 8, 2
EVAL = 5  # dpo_setup's held-out pairs


class Forwards:
    """Rows of every forward of a model (its embedding's input), with or without autograd."""

    def __init__(self) -> None:
        self.events: list[tuple[bool, int]] = []

    def __call__(self, module: nn.Module, args: tuple[object, ...]) -> None:
        if isinstance(module, nn.Embedding) and args and isinstance(args[0], torch.Tensor):
            self.events.append((torch.is_grad_enabled(), int(args[0].shape[0])))

    def reference_rows(self) -> int:
        return sum(rows for grad, rows in self.events if not grad)

    def reference_rows_before_training(self) -> int:
        first = next(i for i, (grad, _) in enumerate(self.events) if grad)
        return sum(rows for grad, rows in self.events[:first] if not grad)


def counted(recipe: dict) -> tuple[Forwards, RunSummary]:
    forwards = Forwards()
    handle = nn.modules.module.register_module_forward_pre_hook(forwards)
    try:
        summary = trainer.run(recipe_from_dict(recipe))
    finally:
        handle.remove()
    assert summary is not None
    return forwards, summary


def test_reference_log_probs_are_computed_at_the_step_that_uses_them(make_tiny_hf, tmp_path):
    setup = {**dpo_setup(make_tiny_hf, tmp_path, PAIRS, seed=12), "train_eval": True}

    def recipe(name: str, steps: int) -> dict:
        return dpo_recipe(setup, tmp_path / name, 0.1, {"micro_batch_size": 1, "grad_accum": PER_STEP,
                                                         "max_steps": steps, "lr": 5e-3})

    # 2 steps over 8 pairs: the first step's 2 pairs before it, 4 pairs in all, then the 5 eval
    # pairs' reference (and the eval after training itself, 5 pairs, also without autograd)
    forwards, short = counted(recipe("short", 2))
    assert forwards.reference_rows_before_training() == 2 * PER_STEP
    assert forwards.reference_rows() == 2 * (2 * PER_STEP + 5) + 2 * EVAL
    cache = tmp_path / "cache"
    (store,) = {p.parent for p in cache.rglob(REF_FILE)}
    assert sorted(load_file(str(store / REF_FILE))) == ["eval"]  # the only split complete
    assert len(list((store / PARTS_DIR).glob("train-*.safetensors"))) == 2  # one part per step

    # 6 steps (1.5 epochs) over the same cache: only the 4 pairs not reached before, none in epoch 2
    forwards, longer = counted(recipe("longer", 6))
    assert forwards.reference_rows() == 2 * (PAIRS - 2 * PER_STEP) + 2 * EVAL
    assert sorted(load_file(str(store / REF_FILE))) == ["eval", "train"]
    assert not (store / PARTS_DIR).exists()
    curve = [(h["train_loss"], h["rewards/margins"]) for h in short["history"] if "train_loss" in h]
    assert [(h["train_loss"], h["rewards/margins"]) for h in longer["history"] if "train_loss" in h][:2] == curve
    assert json.loads((store / "reference.json").read_text())["reference"]["reference"] == "init_from"


def test_every_stored_value_equals_the_one_pass_before_training(make_tiny_hf, tmp_path):
    """The values computed step by step are the ones one pass over every pair gives (the
    ``nxd-finetune eval`` path, :func:`attach_reference`), within float rounding of other batch
    shapes."""
    from nxd_finetune.sft.reference import attach_reference
    from nxd_finetune.sft.setup import setup_rank

    setup = dpo_setup(make_tiny_hf, tmp_path, PAIRS, seed=13)
    rec = dpo_recipe(setup, tmp_path / "run", 0.1, {"micro_batch_size": 1, "grad_accum": PER_STEP,
                                                     "max_steps": PAIRS // PER_STEP, "lr": 5e-3})
    counted(rec)
    (path,) = (tmp_path / "cache").rglob(REF_FILE)
    stepwise = load_file(str(path))["train"]
    rr = setup_rank(recipe_from_dict({**rec, "data": {**rec["data"], "cache_dir": str(tmp_path / "other")}}),
                    write_recipe=False)
    attach_reference(rr.recipe, rr.engine, rr.data, rr.model_dir)
    whole = rr.data.pairs["train"].pairs.ref_logps
    assert whole is not None and torch.allclose(stepwise, whole, atol=1e-5, rtol=0)


def test_a_damaged_part_is_named_and_computed_again(make_tiny_hf, tmp_path):
    setup = dpo_setup(make_tiny_hf, tmp_path, PAIRS, seed=14)

    def recipe(name: str, cache: str) -> dict:
        rec = dpo_recipe(setup, tmp_path / name, 0.1, {"micro_batch_size": 1, "grad_accum": PER_STEP,
                                                        "max_steps": 2, "lr": 5e-3})
        return {**rec, "data": {**rec["data"], "cache_dir": str(tmp_path / cache)}}

    _, first = counted(recipe("first", "cache"))
    shutil.copytree(tmp_path / "cache", tmp_path / "copy")
    part = sorted((tmp_path / "copy").rglob(f"{PARTS_DIR}/train-*.safetensors"))[0]
    damaged = bytearray(part.read_bytes())
    damaged[-1] ^= 0xFF
    part.write_bytes(bytes(damaged))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        forwards, again = counted(recipe("again", "copy"))
    lines = [str(w.message) for w in caught if issubclass(w.category, NxdWarning) and str(part) in str(w.message)]
    assert len(lines) == 1 and "does not match the digest in its name" in lines[0] and "recomputing" in lines[0]
    assert forwards.reference_rows() == 2 * PER_STEP  # the damaged part's step only
    assert [h["train_loss"] for h in again["history"]] == [h["train_loss"] for h in first["history"]]
    assert part.read_bytes() == sorted((tmp_path / "cache").rglob(f"{PARTS_DIR}/train-*.safetensors"))[0].read_bytes()


LAYOUTS = {"tp2": ({"tp": 2}, {"micro_batch_size": 1, "grad_accum": 2}),
           "dp2-zero1": ({"zero1": True}, {"micro_batch_size": 1, "grad_accum": 1}),
           "pp2": ({"pp": 2}, {"micro_batch_size": 1, "grad_accum": 2})}
KEYS = ("train_loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")


def _run_layouts(recipe_dicts: list[dict]) -> list[RunSummary | None]:
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]


def test_base_reference_step_by_step_on_layouts_matches_one_process(make_tiny_hf, tmp_path):
    setup = {**dpo_setup(make_tiny_hf, tmp_path, 12, seed=15), "train_eval": True}
    common = {"max_steps": 6, "lr": 5e-3, "eps": 1e-6}
    base = {"preference": {"beta": 0.1, "reference": "base"}}
    one = trainer.run(recipe_from_dict(dpo_recipe(setup, tmp_path / "single", 0.1,
                                                  {**common, "micro_batch_size": 2, "grad_accum": 1}, **base)))
    dicts = [dpo_recipe(setup, tmp_path / name, 0.1, {**common, **training}, parallel={"nproc": 2, **par}, **base)
             for name, (par, training) in LAYOUTS.items()]
    results = launch(_run_layouts, 2, dicts, start_method="fork")[0]
    assert one is not None and one["reference"] == "base"
    want = [h for h in one["history"] if "train_loss" in h]
    assert len(want) == 6
    for name, got in zip(LAYOUTS, results, strict=True):
        assert got is not None and got["reference"] == "base"
        hist = [h for h in got["history"] if "train_loss" in h]
        for step, (a, b) in enumerate(zip(hist, want, strict=True), 1):
            for k in KEYS:
                assert a[k] == pytest.approx(b[k], abs=1e-5), (name, step, k)
        for k, v in one["eval_after"].items():
            assert got["eval_after"][k] == pytest.approx(v, abs=1e-5), (name, k)

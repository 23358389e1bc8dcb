"""DPO and ORPO on the parallel layouts (real gloo groups): tp2 (+ sequence parallel), dp2 + ZeRO-1
and pp2 (1F1B, interleaved, chunked output layer; the preference target through the pipeline's last
stage) reproduce the single-process run's loss and reward
curve, each through ``trainer.run_rank`` (the reference pass included: under dp each rank computes
its share of the reference log-probs, gathered)."""

from __future__ import annotations

import pytest
import torch

from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.sft import trainer
from tests.preference_helpers import KEYS, STEPS, assert_same_curve, dpo_recipe, dpo_setup

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path

# every layout sees 2 pairs per optimizer step (micro x accum x dp)
LAYOUTS = {
    "tp2": ({"tp": 2}, {"micro_batch_size": 1, "grad_accum": 2}),
    "dp2-zero1": ({"zero1": True}, {"micro_batch_size": 1, "grad_accum": 1}),
    "pp2-1f1b": ({"pp": 2}, {"micro_batch_size": 1, "grad_accum": 2}),
    # every position's logits (sequence parallel): the rows come from the [B, T] targets
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {"micro_batch_size": 1, "grad_accum": 2}),
    "pp2-interleaved": ({"pp": 2, "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"},
                        {"micro_batch_size": 1, "grad_accum": 2}),
    # the last stage's output layer and the log-probs 8 target positions at a time
    "pp2-chunked": ({"pp": 2}, {"micro_batch_size": 1, "grad_accum": 2, "loss_chunk_tokens": 8}),
}


def _run_layouts(recipe_dicts: list[dict]) -> list[dict | None]:
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]


def test_dpo_layouts_match_single_process(make_tiny_hf, tmp_path):
    """LoRA from a starting adapter (the reference) and full fine-tuning (the initial model)."""
    setup = dpo_setup(make_tiny_hf, tmp_path, 2 * STEPS, seed=5, num_hidden_layers=4)  # 4 stages interleaved
    common = {"max_steps": STEPS, "lr": 5e-3, "eps": 1e-6}
    modes = {"lora": {}, "full": {"lora": None}}
    # eval after training: the same pairs' preference metrics on every layout
    setup = {**setup, "train_eval": True}
    refs = {mode: trainer.run(recipe_from_dict(dpo_recipe(setup, tmp_path / mode / "single", 0.1,
                                                          {**common, "micro_batch_size": 2, "grad_accum": 1},
                                                          **more)))
            for mode, more in modes.items()}
    names = [(mode, name) for mode in modes for name in LAYOUTS]
    dicts = [dpo_recipe(setup, tmp_path / mode / name, 0.1, {**common, **LAYOUTS[name][1]},
                        parallel={"nproc": 2, **LAYOUTS[name][0]}, **modes[mode]) for mode, name in names]
    results = launch(_run_layouts, 2, dicts, start_method="fork")
    for (mode, name), got in zip(names, results[0], strict=True):
        ref = refs[mode]
        assert ref is not None and got["reference"] == ref["reference"] == ("init_from" if mode == "lora" else "base")
        assert_same_curve(f"{mode}/{name}", got, ref)
        assert ref["eval_after"]["eval_rewards/accuracies"] is not None
        for k, v in ref["eval_after"].items():
            assert got["eval_after"][k] == pytest.approx(v, abs=1e-5), (mode, name, k)


def test_dpo_tp2_pp2_matches_single_process(make_tiny_hf, tmp_path):
    """Four processes, tp2 x pp2 (LoRA): the single-process DPO curve."""
    setup = dpo_setup(make_tiny_hf, tmp_path, 2 * STEPS, seed=8, num_hidden_layers=4)
    common = {"max_steps": STEPS, "lr": 5e-3, "eps": 1e-6}
    ref = trainer.run(recipe_from_dict(dpo_recipe(setup, tmp_path / "single", 0.1,
                                                  {**common, "micro_batch_size": 2, "grad_accum": 1})))
    rec = dpo_recipe(setup, tmp_path / "tp2-pp2", 0.1, {**common, "micro_batch_size": 1, "grad_accum": 2},
                     parallel={"nproc": 4, "tp": 2, "pp": 2})
    got = launch(_run_layouts, 4, [rec], start_method="fork")[0][0]
    assert ref is not None and got["parallel"]["nproc"] == 4
    assert_same_curve("tp2-pp2", got, ref)


ORPO_KEYS = (*KEYS, "nll_loss", "log_odds_ratio", "log_odds_chosen")


def test_orpo_layouts_match_single_process(make_tiny_hf, tmp_path):
    """ORPO (its NLL over the chosen prompts and completions, TRL's default) on tp2, tp2 + sequence
    parallel, dp2 + ZeRO-1, pp2 and pp2 with a chunked output layer, and one process with a chunked
    output layer: the one-process curve and eval metrics. Every layout runs one pair per micro-batch
    as the reference does (ORPO's NLL is a token mean over a micro-batch's chosen rows, as TRL's)."""
    setup = {**dpo_setup(make_tiny_hf, tmp_path, 2 * STEPS, seed=9), "train_eval": True}
    common = {"max_steps": STEPS, "lr": 5e-3, "eps": 1e-6}
    orpo = {"objective": "orpo", "preference": {"beta": 0.1}}

    def recipe(name: str, training: dict, **more: object) -> dict:
        return dpo_recipe(setup, tmp_path / name, 0.1, {**common, **training}, **orpo, **more)

    ref = trainer.run(recipe_from_dict(recipe("single", {"micro_batch_size": 1, "grad_accum": 2})))
    assert ref is not None and ref["reference"] is None
    chunked = trainer.run(recipe_from_dict(recipe("single-chunked", {"micro_batch_size": 1, "grad_accum": 2,
                                                                     "loss_chunk_tokens": 8})))
    names = ["tp2", "tp2-sp", "dp2-zero1", "pp2-1f1b", "pp2-chunked"]
    dicts = [recipe(name, LAYOUTS[name][1], parallel={"nproc": 2, **LAYOUTS[name][0]}) for name in names]
    results = launch(_run_layouts, 2, dicts, start_method="fork")[0]
    for name, got in [("single-chunked", chunked), *zip(names, results, strict=True)]:
        assert got is not None
        assert_same_curve(name, got, ref, ORPO_KEYS, dpo=False)
        assert ref["eval_after"]["eval_nll_loss"] is not None
        for k, v in ref["eval_after"].items():
            assert got["eval_after"][k] == pytest.approx(v, abs=1e-5), (name, k)

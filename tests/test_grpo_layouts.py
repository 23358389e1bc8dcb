"""GRPO on the parallel layouts (real gloo groups, through ``trainer.run_rank``): given the same
completions (the source's ``generate`` hook, keyed by step, prompt and place in its group), tp2,
dp2 + ZeRO-1, pp2 and tp2 x pp2 reproduce the one-process run's loss, KL, entropy, clip ratios (means,
the least / most clipped sequence) and reward metrics within 1e-5, with LoRA (``beta`` > 0: the
reference pass with the adapter off, or with the adapter the run started from swapped in, and
``num_iterations`` 2: the old log-probs, both through the engine's eval call, pipelined under pp)
and full fine-tuning; under dp the rewards are gathered and the advantages computed over the whole
generation batch."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.rl.source import grpo_source
from nxd_finetune.sft import trainer
from tests.rl_helpers import FIXED_GENERATIONS, fixed, grpo_recipe, start_adapter

pytestmark = [pytest.mark.usefixtures("workers_tmpdir"), pytest.mark.slow]  # gloo worlds writing under tmp_path

STEPS, GENERATIONS = 4, FIXED_GENERATIONS
KEYS = ("train_loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean",
        "clip_ratio/high_mean", "clip_ratio/low_min", "clip_ratio/high_max", "reward", "reward_std",
        "rewards/exact_match/mean", "rewards/regex/std", "completions/mean_length", "frac_reward_zero_std")
MODES = {"lora": ({}, {"beta": 0.04, "num_iterations": 2, "epsilon": 0.05}),
         "lora-init_from": ({}, {"beta": 0.04, "num_iterations": 2, "epsilon": 0.05}),  # KL to the start adapter
         "full": ({"lora": None}, {"beta": 0.0, "num_iterations": 2, "loss_type": "dapo",
                                   "mask_truncated_completions": True})}
LAYOUTS = {"tp2": ({"tp": 2}, {"micro_batch_size": 4, "grad_accum": 2}),
           "dp2-zero1": ({"zero1": True}, {"micro_batch_size": 4, "grad_accum": 1}),
           "pp2": ({"pp": 2}, {"micro_batch_size": 4, "grad_accum": 2})}


SOURCE = functools.partial(grpo_source, generate=fixed)


def recipe(root: Any, model_dir: Any, name: str, mode: str, training: dict[str, Any],
           parallel: dict[str, Any] | None = None) -> dict[str, Any]:
    more, rl = MODES[mode]
    d = grpo_recipe(root, model_dir, root / mode / name, STEPS, {"lr": 5e-3, **training}, **rl)
    if mode == "lora-init_from":  # a trained adapter to start from (B != 0)
        if not (root / "start").exists():
            start_adapter(model_dir, root / "start", trained=True)
        d["lora"]["init_from"] = str(root / "start")
    return {**d, **more, **({"parallel": {"nproc": 2, **parallel}} if parallel else {})}


def _run_layouts(recipe_dicts: list[dict[str, Any]]) -> list[Any]:
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d), SOURCE) for d in recipe_dicts]


def test_grpo_layouts_match_single_process(make_tiny_hf, tmp_path):
    _, model_dir = make_tiny_hf("llama")
    refs = {mode: trainer.run(recipe_from_dict(recipe(tmp_path, model_dir, "single", mode,
                                                      {"micro_batch_size": 4, "grad_accum": 2})), SOURCE)
            for mode in MODES}
    names = [(mode, name) for mode in MODES for name in LAYOUTS]
    dicts = [recipe(tmp_path, model_dir, name, mode, LAYOUTS[name][1], LAYOUTS[name][0]) for mode, name in names]
    results = launch(_run_layouts, 2, dicts, start_method="fork")
    for (mode, name), got in zip(names, results[0], strict=True):
        ref = refs[mode]
        assert ref is not None and got is not None
        want = ref["history"]
        assert len(want) == STEPS and len({round(h["train_loss"], 5) for h in want}) > 1
        for step, (a, b) in enumerate(zip(got["history"], want, strict=True), 1):
            for k in KEYS:
                assert (k in a) == (k in b), (mode, name, step, k)
                if k in b:
                    assert a[k] == pytest.approx(b[k], abs=1e-5), (mode, name, step, k, a[k], b[k])


def test_grpo_tp2_pp2_matches_single_process(make_tiny_hf, tmp_path):
    """Four processes, tp2 x pp2 (LoRA, beta > 0, num_iterations 2): the one-process curve."""
    _, model_dir = make_tiny_hf("llama")
    ref = trainer.run(recipe_from_dict(recipe(tmp_path, model_dir, "single", "lora",
                                              {"micro_batch_size": 4, "grad_accum": 2})), SOURCE)
    d = recipe(tmp_path, model_dir, "tp2-pp2", "lora", {"micro_batch_size": 4, "grad_accum": 2}, {"tp": 2, "pp": 2})
    d["parallel"]["nproc"] = 4
    got = launch(_run_layouts, 4, [d], start_method="fork")[0][0]
    assert ref is not None and got["parallel"]["nproc"] == 4
    for step, (a, b) in enumerate(zip(got["history"], ref["history"], strict=True), 1):
        for k in KEYS:
            assert (k in a) == (k in b) and a.get(k) == pytest.approx(b.get(k), abs=1e-5), (step, k)


def test_sampled_completions_and_curves_are_the_same_on_tp2_and_dp2(make_tiny_hf, tmp_path):
    """The built-in sampler on the training model (KV cache; tp: the vocabulary shards gathered),
    each row seeded by its place in the step's generation batch: tp2 and dp2 sample the one-process
    run's completions (the same rewards and lengths) and train the same curve."""
    _, model_dir = make_tiny_hf("llama")
    rewards = {"reward_funcs": ["tests.rl_helpers:token_reward", {"type": "regex", "pattern": "w1"}]}

    def sampled(name: str, training: dict[str, Any], parallel: dict[str, Any] | None = None) -> dict[str, Any]:
        d = grpo_recipe(tmp_path, model_dir, tmp_path / name, STEPS, {"lr": 5e-3, **training}, num_iterations=1,
                        temperature=0.9, top_p=0.95, **rewards)
        return {**d, **({"parallel": {"nproc": 2, **parallel}} if parallel else {})}

    ref = trainer.run(recipe_from_dict(sampled("single", {"micro_batch_size": 4, "grad_accum": 2})))
    names = ["tp2", "dp2-zero1"]
    got = launch(_run_sampled, 2, [sampled(n, LAYOUTS[n][1], LAYOUTS[n][0]) for n in names], start_method="fork")
    assert ref is not None
    want = ref["history"]
    assert len({h["rewards/token_reward/mean"] for h in want}) > 1  # the completions differ step to step
    for name, result in zip(names, got[0], strict=True):
        for step, (a, b) in enumerate(zip(result["history"], want, strict=True), 1):
            for k in (*KEYS, "rewards/token_reward/mean", "completions/max_length"):
                k = "rewards/token_reward/std" if k == "rewards/regex/std" else k
                assert (k in a) == (k in b) and a.get(k) == pytest.approx(b.get(k), abs=1e-5), (name, step, k)


def _run_sampled(recipe_dicts: list[dict[str, Any]]) -> list[Any]:
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]

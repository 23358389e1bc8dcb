"""GRPO against TRL 1.x's ``GRPOTrainer``: the same tiny Llama (fp32), starting LoRA adapter,
prompts, completions (TRL's through its ``rollout_func`` hook, ours through the batch source's
``generate`` hook) and reward functions; per optimizer step the loss, KL, clip ratios, rewards and
completion lengths agree within 1e-5 for every ``loss_type``, ``beta`` 0 and > 0, ``num_iterations``
1 and 2; the adapter we write loads in peft and equals TRL's trained one."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from nxd_finetune.data.prompts import PromptRow, prompt_rows
from nxd_finetune.export import ExportSpec, export_model
from nxd_finetune.objectives import objective_of
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.rl.objective import grpo_reference
from nxd_finetune.rl.rewards import Reward
from nxd_finetune.rl.sampler import Completions
from nxd_finetune.rl.source import GRPOSource, completions_of, reference_weights
from nxd_finetune.sft.engine import Engine, build_engine
from nxd_finetune.sft.step import train_step
from tests.preference_helpers import LORA, WORDS, word_tokenizer
from tests.rl_helpers import grpo_trainer, start_adapter

pytest.importorskip("trl")
from trl import GRPOConfig  # noqa: E402

GRPOTrainer = grpo_trainer()

STEPS, ROWS, GENERATIONS, MAX_LEN, LR = 6, 8, 4, 6, 2e-2
EOS, PAD = 3, 1  # word_tokenizer's </s> and <pad>


def count_reward(completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float | None]:
    """A score every completion gets: its tokens divisible by 3."""
    return [float(sum(1 for t in ids if t % 3 == 0)) for ids in completion_ids]


def word_reward(completions: Sequence[str], bonus: Sequence[float], **kwargs: Any) -> list[float | None]:
    """Unscored (None) past 4 words, else the words plus the row's ``bonus`` column."""
    return [None if len(c.split()) > 4 else len(c.split()) + b for c, b in zip(completions, bonus, strict=True)]


FUNCS, WEIGHTS = [count_reward, word_reward], [1.0, 0.5]


def prompts_data(n: int) -> list[dict[str, Any]]:
    rng = random.Random(5)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6))), "bonus": 0.25 * (i % 4)}
            for i in range(n)]


def completion_table(k: int, rows: int) -> list[list[int]]:
    """The ``k``-th generation's completions: random words, some ending in eos, some truncated."""
    rng = random.Random(100 + k)
    out = []
    for _ in range(rows):
        if rng.random() < 0.4:
            out.append([rng.randrange(4, 104) for _ in range(MAX_LEN)])  # no eos: truncated
        else:
            out.append([rng.randrange(4, 104) for _ in range(rng.randint(0, MAX_LEN - 1))] + [EOS])
    return out


def run_trl(model_dir: Path, adapter: Path, data: list[dict[str, Any]], out: Path, rl: dict[str, Any]):
    tokenizer = word_tokenizer()
    calls: list[list[str]] = []

    def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
        calls.append(list(prompts))
        return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts],
                "completion_ids": completion_table(len(calls) - 1, len(prompts)), "logprobs": None}

    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, adapter, is_trainable=True)
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=ROWS, gradient_accumulation_steps=1,
                      num_generations=GENERATIONS, max_completion_length=MAX_LEN, learning_rate=LR, max_steps=STEPS,
                      lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, report_to=[], use_cpu=True,
                      save_strategy="no", bf16=False, fp16=False, seed=0, max_grad_norm=1.0, weight_decay=0.0,
                      shuffle_dataset=False, dataloader_num_workers=0, reward_weights=WEIGHTS, **rl)
    trainer = GRPOTrainer(model=model, reward_funcs=FUNCS, args=args, train_dataset=Dataset.from_list(data),
                          processing_class=tokenizer, rollout_func=rollout)
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], calls, trainer


def our_run(model_dir: Path, adapter: Path, data: list[dict[str, Any]], out: Path, rl: dict[str, Any],
            trl_prompts: list[list[str]]) -> tuple[list[dict[str, float]], Engine]:
    recipe = recipe_from_dict({
        "model": {"path": str(model_dir)},
        "data": {"train": str(out / "prompts.jsonl"), "format": "prompt", "shuffle": False},
        "objective": "grpo",
        "rl": {"reward_funcs": ["tests.test_grpo_trl:count_reward", "tests.test_grpo_trl:word_reward"],
               "reward_weights": WEIGHTS, "num_generations": GENERATIONS, "max_completion_length": MAX_LEN, **rl},
        "lora": {"rank": LORA["r"], "alpha": LORA["lora_alpha"], "target_modules": LORA["target_modules"],
                 "init_from": str(adapter)},
        "training": {"micro_batch_size": ROWS, "max_steps": STEPS, "lr": LR, "scheduler": "constant",
                     "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.0, "device": "cpu"},
        "output": {"dir": str(out / "ours")},
    })
    assert recipe.rl is not None
    tokenizer = word_tokenizer()
    generations: list[list[str]] = []

    def generate(engine: Engine, rows: Sequence[PromptRow], step: int) -> Completions:
        generations.append([str(r.prompt) for r in rows])
        table = completion_table(len(generations) - 1, len(rows))
        return completions_of([r.ids for r in rows], table, [EOS], PAD)

    engine = build_engine(recipe, model_dir, torch.device("cpu"), STEPS)
    kind = grpo_reference(recipe.rl, str(adapter))  # beta > 0: the starting adapter (TRL's "ref" copy)
    source = GRPOSource(recipe.rl, prompt_rows(data, tokenizer), tokenizer,
                        [Reward(f.__name__, f, w) for f, w in zip(FUNCS, WEIGHTS, strict=True)], ROWS, 1, STEPS,
                        (EOS,), PAD, generate=generate,
                        reference=None if kind is None else reference_weights(engine, kind))
    objective = objective_of(recipe)
    records = []
    engine.train(True)
    for step in range(1, STEPS + 1):
        batches, n_input = source.next_step(engine, step)
        result = train_step(engine, batches, n_input, objective=objective)
        assert result.stats is not None
        assert result.grad_norm is not None
        records.append({"loss": float(result.loss), "grad_norm": float(result.grad_norm),
                        **objective.train_record(result.stats.tolist()),
                        **source.metrics()})
    assert generations == trl_prompts  # the same prompts, in TRL's order
    return records, engine


KEYS = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
        "clip_ratio/high_max", "clip_ratio/region_mean", "reward",
        "reward_std", "frac_reward_zero_std", "rewards/count_reward/mean", "rewards/count_reward/std",
        "rewards/word_reward/mean", "rewards/word_reward/std", "completions/mean_length",
        "completions/min_length", "completions/max_length", "completions/clipped_ratio",
        "completions/mean_terminated_length")

CASES = [
    pytest.param("grpo", 0.0, 1, {}, id="grpo-beta0-it1"),
    pytest.param("dapo", 0.05, 2, {"epsilon_high": 0.28, "mask_truncated_completions": True}, id="dapo-beta-it2"),
    pytest.param("dr_grpo", 0.05, 1, {"scale_rewards": "none", "temperature": 0.7}, id="dr_grpo-beta-it1"),
    pytest.param("bnpo", 0.0, 2, {"scale_rewards": "batch", "epsilon": 0.1}, id="bnpo-beta0-it2"),
    pytest.param("grpo", 0.05, 2, {"mask_truncated_completions": True}, id="grpo-beta-it2", marks=pytest.mark.slow),
    pytest.param("dapo", 0.0, 1, {}, id="dapo-beta0-it1", marks=pytest.mark.slow),
    pytest.param("dr_grpo", 0.0, 2, {"epsilon": 0.05}, id="dr_grpo-beta0-it2", marks=pytest.mark.slow),
    pytest.param("bnpo", 0.05, 1, {"temperature": 1.3}, id="bnpo-beta-it1", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("loss_type", "beta", "iterations", "more"), CASES)
def test_grpo_equals_trl_per_step(loss_type, beta, iterations, more, make_tiny_hf, tmp_path):
    equal_to_trl(loss_type, beta, iterations, more, make_tiny_hf, tmp_path)


@pytest.mark.parametrize("iterations", [1, 2])
def test_grpo_from_a_trained_adapter_equals_trl(iterations, make_tiny_hf, tmp_path):
    """Starting from a trained adapter (B != 0) with beta > 0: TRL measures the KL against a frozen
    copy of it (its "ref" adapter), as our default reference (``init_from``) does."""
    equal_to_trl("grpo", 0.2, iterations, {}, make_tiny_hf, tmp_path, trained=True)


def equal_to_trl(loss_type: str, beta: float, iterations: int, more: dict[str, Any], make_tiny_hf: Any,
                 tmp_path: Path, trained: bool = False) -> None:
    _, model_dir = make_tiny_hf("llama")
    adapter = tmp_path / "start"
    start_adapter(model_dir, adapter, trained)
    rl = {"loss_type": loss_type, "beta": beta, "num_iterations": iterations, **more}
    data = prompts_data(STEPS * ROWS // GENERATIONS)
    theirs, calls, trainer = run_trl(model_dir, adapter, data, tmp_path / "trl", rl)
    ours, engine = our_run(model_dir, adapter, data, tmp_path, rl, calls)
    assert len(ours) == len(theirs) == STEPS
    compared = 0
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        for key in KEYS:
            if key == "kl" and not beta:
                assert "kl" not in a and "kl" not in b
                continue
            assert (key in a) == (key in b), (step, key, sorted(a), sorted(b))  # generation steps only
            if key in b:
                assert a[key] == pytest.approx(b[key], abs=1e-5), (step, key, a[key], b[key])
                compared += 1
    assert compared >= STEPS * 5
    if iterations > 1:
        assert max(r["clip_ratio/high_max"] for r in ours) > 0  # the clip ratios were compared off zero
    if beta:
        assert max(r["kl"] for r in ours) > 1e-6  # the policy left the reference
    # the adapter we write loads in peft and equals TRL's trained one
    spec = ExportSpec(mode="adapter", source_dir=model_dir, base_name=str(model_dir), dtype=torch.float32,
                      revision=None, tokenizer=None)
    export_model(engine.rank_model, tmp_path / "final", spec, config=engine.config, lora=engine.lora_config,
                 lora_targets=engine.lora_targets)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 33, 60, 3]])
    with torch.no_grad():
        base = hf(ids).logits
        loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "final").eval()
        torch.testing.assert_close(loaded(ids).logits, trainer.model.eval()(ids).logits, atol=1e-4, rtol=1e-4)
    assert (loaded(ids).logits - base).abs().max() > 1e-3  # it trained: the adapter moved the model

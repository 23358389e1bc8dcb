"""Helpers of the GRPO tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.preference_helpers import LORA, WORDS, word_tokenizer

TESTS = Path(__file__).resolve().parent


def grpo_trainer() -> type:
    """TRL's ``GRPOTrainer``, imported with ``tests/`` off ``sys.path``: pytest puts it there (the
    tests are no package), where ``tests/vllm`` would pass for vLLM in TRL's ``is_vllm_available``
    (a version of 'N/A', which fails its import)."""
    removed = [p for p in sys.path if p and Path(p).resolve() == TESTS]
    for p in removed:
        sys.path.remove(p)
    try:
        from trl.trainer.grpo_trainer import GRPOTrainer
    finally:
        sys.path[:0] = removed
    return GRPOTrainer


def grpo_recipe(root: Path, model_dir: Path, out: Path, steps: int, training: dict[str, Any] | None = None,
                **rl: Any) -> dict[str, Any]:
    """A GRPO run recipe (dict) on the tiny model: 10 word prompts with an ``answer`` column under
    ``root`` (written once, with the word tokenizer), the built-in rewards, LoRA, ``steps`` steps of
    8 completions (``training``: more settings), ``rl``: more ``rl`` settings."""
    prompts = root / "prompts.jsonl"
    if not prompts.exists():
        rows = [{"prompt": " ".join(WORDS[i:i + 3]), "answer": WORDS[i + 3]} for i in range(0, 40, 4)]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        word_tokenizer().save_pretrained(root / "tok")
    return {
        "model": {"path": str(model_dir), "tokenizer": str(root / "tok")},
        "data": {"train": str(prompts), "format": "prompt", "shuffle": False},
        "objective": "grpo",
        "rl": {"reward_funcs": [{"type": "exact_match", "column": "answer"}, {"type": "regex", "pattern": "w1"}],
               "reward_weights": [1.0, 0.5], "num_generations": 4, "max_completion_length": 4, "beta": 0.04,
               "num_iterations": 2, "loss_type": "grpo", **rl},
        "lora": {"rank": LORA["r"], "alpha": LORA["lora_alpha"], "target_modules": LORA["target_modules"]},
        "training": {"micro_batch_size": 8, "max_steps": steps, "lr": 2e-2, "scheduler": "constant",
                     "warmup_steps": 0, "device": "cpu", **(training or {})},
        "output": {"dir": str(out)}, "logging": {"progress": False}, "eval": {"before": False},
    }


def token_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float | None]:
    """A reward that varies on random completions: the tokens divisible by 3."""
    return [float(sum(1 for t in ids if t % 3 == 0)) for ids in completion_ids]

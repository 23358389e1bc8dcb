"""Helpers of the GRPO tests."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxd_finetune.data.prompts import PromptRow
from nxd_finetune.rl.sampler import Completions
from nxd_finetune.rl.source import completions_of
from tests.preference_helpers import LORA, WORDS, word_tokenizer

if TYPE_CHECKING:
    from nxd_finetune.sft.engine import Engine

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


def start_adapter(model_dir: Path, out: Path, trained: bool = False) -> None:
    """peft's default LoRA init (B = 0: the policy starts at the base), or ``trained``: B drawn
    too, as an SFT adapter a run starts from (TRL's reference for beta > 0: its frozen copy)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    if trained:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
    model.save_pretrained(out)


FIXED_GENERATIONS, FIXED_EOS, FIXED_PAD = 4, 3, 1  # the word tokenizer's </s> and <pad>


def fixed(engine: Engine, rows: Sequence[PromptRow], step: int) -> Completions:
    """Completions by step, prompt and place in the group (of ``FIXED_GENERATIONS``): the same rows
    get the same on any layout."""
    table = []
    for i, row in enumerate(rows):
        rng = random.Random(f"{step}/{row.prompt}/{i % FIXED_GENERATIONS}")
        n = rng.randint(1, 4)
        table.append([rng.choice([FIXED_EOS, 5, 8, 13]) if k == n - 1 else rng.randrange(4, 104) for k in range(n)])
    return completions_of([r.ids for r in rows], table, [FIXED_EOS], FIXED_PAD)

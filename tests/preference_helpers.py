"""Shared pieces of the preference tests: a one-token-per-word tokenizer inside the tiny model's
vocabulary (and one with a ChatML-like chat template), random preference pairs (text or
conversations), and a peft LoRA adapter with random non-zero factors."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(100)]
STEPS = 6  # the layout tests' optimizer steps (the length of :func:`assert_same_curve`'s curve)
KEYS = ("train_loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
        "logps/chosen", "logps/rejected")
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)


def word_tokenizer():
    """One token per word (WordLevel) inside the tiny model's 128-token vocabulary."""
    specials = ["[UNK]", "<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="[UNK]")


CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def chat_word_tokenizer():
    """:func:`word_tokenizer` (the same ids) with ChatML-like turns: ``<|im_start|>role content<|im_end|>``,
    the end of turn not the eos ``</s>`` (as SmolLM2's or Qwen's ``<|im_end|>\n``)."""
    specials = ["[UNK]", "<pad>", "<s>", "</s>"]
    vocab = specials + WORDS + CHAT_TOKENS + ["user", "assistant", "system"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="[UNK]", additional_special_tokens=CHAT_TOKENS,
                                   chat_template=CHAT_TEMPLATE)


def chat_pairs(n: int, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """:func:`pairs` as conversations: the prompt a user turn (every third pair after an earlier
    exchange), the completions one assistant turn each."""
    def turn(role: str, content: str) -> dict[str, str]:
        return {"role": role, "content": content.strip()}

    out = []
    for i, p in enumerate(pairs(n, seed=seed)):
        earlier = [turn("user", p["chosen"]), turn("assistant", p["rejected"])] if i % 3 == 2 else []
        out.append({"prompt": [*earlier, turn("user", p["prompt"])], "chosen": [turn("assistant", p["chosen"])],
                    "rejected": [turn("assistant", p["rejected"])]})
    return out


def pairs(n: int, seed: int = 0, prompt: bool = True) -> list[dict[str, str]]:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    return [{"prompt": (text(2, 6) + " ") if prompt else "", "chosen": text(1, 7), "rejected": text(1, 7)}
            for _ in range(n)]


def start_adapter(model_dir: Path, out: Path):
    """A peft LoRA on the tiny model with random non-zero factors (policy != base at step 0), saved."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted((n, p) for n, p in pm.named_parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(out)
    return pm




def dpo_setup(make_tiny_hf: Any, root: Path, n_pairs: int, seed: int = 3, **config: Any) -> dict[str, Any]:
    """A tiny Llama (``config`` overrides), its starting adapter, the word tokenizer and ``n_pairs``
    pairs as jsonl under ``root``: ``{"model_dir", "adapter", "tokenizer", "train", "data"}``."""
    _, model_dir = make_tiny_hf("llama", **config)
    adapter, tok_dir, train = root / "start", root / "tok", root / "pairs.jsonl"
    start_adapter(model_dir, adapter)
    word_tokenizer().save_pretrained(tok_dir)
    data = pairs(n_pairs, seed=seed)
    train.write_text("".join(json.dumps(d) + "\n" for d in data))
    held_out = root / "eval.jsonl"  # 5 pairs: over 2 dp ranks, one all-padding pair evens them out
    held_out.write_text("".join(json.dumps(d) + "\n" for d in pairs(5, seed=seed + 100)))
    return {"model_dir": model_dir, "adapter": adapter, "tokenizer": tok_dir, "train": train, "data": data,
            "eval": held_out}


def dpo_recipe(setup: dict[str, Any], out: Path, beta: float, training: dict[str, Any],
               **more: Any) -> dict[str, Any]:
    """A DPO run recipe (dict) over ``setup`` (:func:`dpo_setup`), pairs in file order, LoRA from
    its starting adapter (the reference by default), no eval."""
    return {
        "model": {"path": str(setup["model_dir"]), "tokenizer": str(setup["tokenizer"])},
        "data": {"train": str(setup["train"]), "format": "preference", "packing": False, "shuffle": False,
                 "max_seq_len": 64, "cache_dir": str(out.parent / "cache"),
                 **({"eval": str(setup["eval"])} if setup.get("train_eval") else {})},
        "objective": "dpo", "preference": {"beta": beta},
        "lora": {"rank": LORA["r"], "alpha": LORA["lora_alpha"], "target_modules": LORA["target_modules"],
                 "init_from": str(setup["adapter"])},
        "training": {"scheduler": "constant", "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.0,
                     "device": "cpu", **training},
        "output": {"dir": str(out)}, "logging": {"progress": False}, "eval": {"before": False},
        "checkpoint": {"every_n_steps": None}, **more,
    }


def assert_same_curve(name: str, got: dict, ref: dict, keys: tuple[str, ...] = KEYS, dpo: bool = True) -> None:
    """Every logged step's loss and reward metrics within 1e-5 of the single-process run's."""
    want = [h for h in ref["history"] if "train_loss" in h]
    assert len(want) == STEPS and len({round(h["train_loss"], 4) for h in want}) > 2
    hist = [h for h in got["history"] if "train_loss" in h]
    for step, (a, b) in enumerate(zip(hist, want, strict=True), 1):
        for k in keys:
            if dpo and k == "rewards/accuracies" and step == 1:
                continue  # policy == reference: every margin is rounding noise, its sign arbitrary
            assert a[k] == pytest.approx(b[k], abs=1e-5), (name, step, k, a[k], b[k])

"""Shared pieces of the LoRA benchmark: model shapes, the random-init checkpoints, the recipe both
frameworks are configured from, and the FLOP count.

Everything is local: the models are ``transformers.LlamaForCausalLM`` initialised from a fixed seed
and written with ``save_pretrained`` under ``bench/.cache/models/<shape>`` (git-ignored), with the
quickstart tokenizer next to them. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CACHE = Path(os.environ.get("NXD_BENCH_CACHE", BENCH / ".cache"))
DATA = BENCH / "data" / "sft.jsonl"
SEED = 0
MAX_SEQ_LEN = 512

# vocab None = the quickstart tokenizer's; the larger model uses a Llama-2-sized vocabulary (the data
# only uses the first ids, which changes nothing in cost: the embedding is a gather, lm_head a matmul)
SHAPES: dict[str, dict[str, Any]] = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=688, vocab_size=None),
    "large": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                  intermediate_size=2816, vocab_size=32000),
}

# One training setup for both frameworks (same LoRA, optimizer, schedule, clipping).
LORA = dict(rank=16, alpha=32, dropout=0.0, target_modules="all-linear")
TRAIN = dict(lr=2.0e-4, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1.0, warmup_steps=2,
             scheduler="cosine", min_lr_ratio=0.0)


def ensure_model(shape: str) -> Path:
    """``bench/.cache/models/<shape>``: tokenizer + random-init (seed 0) LlamaForCausalLM, fp32."""
    out = CACHE / "models" / shape
    spec = dict(SHAPES[shape], seed=SEED, version=1)
    if (out / "config.json").is_file() and (out / "bench_spec.json").is_file():
        if json.loads((out / "bench_spec.json").read_text()) == spec:
            return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nxd_finetune.quickstart import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    dims = {k: v for k, v in SHAPES[shape].items() if k != "vocab_size"}
    config = LlamaConfig(
        vocab_size=SHAPES[shape]["vocab_size"] or len(tok), max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, **dims,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "bench_spec.json").write_text(json.dumps(spec))
    return out


def recipe_dict(shape: str, packing: bool, micro_batch_size: int, grad_accum: int,
                max_samples: int | None) -> dict[str, Any]:
    """The nxd-finetune recipe of one benchmark configuration (the HF loop reads the same values)."""
    return {
        "model": {"path": str(CACHE / "models" / shape), "dtype": "fp32"},
        "data": {"train": str(DATA), "format": "messages", "max_seq_len": MAX_SEQ_LEN, "packing": packing,
                 "shuffle": True, "cache_dir": str(CACHE / "data"), "max_samples": max_samples},
        "lora": dict(LORA),
        "training": {"micro_batch_size": micro_batch_size, "grad_accum": grad_accum, "max_steps": 1_000_000,
                     "seed": SEED, "precision": "fp32", "device": "cpu", **TRAIN},
        "logging": {"every_n_steps": 1_000_000, "progress": False},
        "output": {"dir": str(CACHE / "outputs")},
    }


def param_counts(config: dict[str, Any], lora_rank: int) -> dict[str, int]:
    """Matmul parameters of the frozen base (decoder linears + lm_head; the embedding is a gather)
    and of the LoRA adapters on every decoder linear."""
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    linears = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    base = n * sum(a * b for a, b in linears) + h * config["vocab_size"]
    lora = n * sum(lora_rank * (a + b) for a, b in linears)
    return {"base": base, "lora": lora, "q_dim": q, "layers": n}


def train_flops(config: dict[str, Any], lora_rank: int, segment_lengths: list[int]) -> float:
    """Model FLOPs of one LoRA training pass over samples of ``segment_lengths`` tokens.

    Per token: frozen base ``4 N_base`` (forward 2N, backward 2N for the input gradients only, no
    weight gradient) + adapters ``6 N_lora`` (forward 2, input grad 2, weight grad 2) -- full
    fine-tuning would be ``6 N``. Attention, causal within each sample of length L: forward
    ``2 L^2 q_dim`` per layer (QK^T and PV, half the pairs), backward twice that, so
    ``6 L^2 q_dim`` per layer and sample. Padding and cross-sample attention are not useful work
    and are not counted; lm_head is counted at every token, as the usual MFU convention does.
    """
    c = param_counts(config, lora_rank)
    tokens = sum(segment_lengths)
    attn = sum(6 * L * L * c["q_dim"] * c["layers"] for L in segment_lengths)
    return tokens * (4 * c["base"] + 6 * c["lora"]) + attn

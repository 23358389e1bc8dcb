"""Tiny mixture-of-experts configs (Qwen3-MoE, Mixtral) for the model tests: built locally, never
from the Hub."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import MixtralConfig, PretrainedConfig, Qwen3MoeConfig

# conftest's TINY sizes
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 128, "max_position_embeddings": 256}
MOE_FAMILIES = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}


def tiny_moe_config(family: str = "qwen3_moe", **overrides: object) -> PretrainedConfig:
    """``qwen3_moe``: 6 experts of width 32, top 2, renormalised, layer 1 dense (``mlp_only_layers``);
    ``mixtral``: 4 experts of width 96, top 2."""
    if family == "qwen3_moe":
        base = {**TINY, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "norm_topk_prob": True, "mlp_only_layers": [1]}
        return Qwen3MoeConfig(**{**base, **overrides})
    return MixtralConfig(**{**TINY, "num_local_experts": 4, "num_experts_per_tok": 2, **overrides})


def build_tiny_moe(config: PretrainedConfig, path: Path, seed: int = 0) -> torch.nn.Module:
    """Random-init ``config`` (norms perturbed, router weights spread so routing is decisive) with
    ``seed``, saved to ``path`` as transformers writes it; returns the model (eager attention)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model

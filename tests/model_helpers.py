"""Model facts the tests check the package against, computed apart from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from nxd_finetune.models import DecoderConfig, build_model
from nxd_finetune.models.loading import split_experts
from nxd_finetune.quickstart import ensure_tiny_model
from nxd_finetune.safetensors_io import header_bytes


def num_parameters(config: DecoderConfig) -> int:
    """Total parameter count of a decoder with ``config``, computed from shapes (no tensors built)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    assert config.head_dim is not None and config.num_key_value_heads is not None  # set by __post_init__
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if config.qkv_bias else 0) + (h if config.o_bias else 0)
    mlp = 3 * h * i + ((2 * i + h) if config.mlp_bias else 0)
    norms = (4 if config.sandwich_norms else 2) * h + (2 * config.head_dim if config.qk_norm else 0)
    # a mixture-of-experts layer: the router [E, H] and E experts of gate, up, down at width I_moe
    moe = config.num_experts * h + config.num_experts * 3 * h * (config.moe_intermediate_size or i)
    mlps = sum(moe if config.is_moe_layer(n) else mlp for n in range(config.num_hidden_layers))
    head = 0 if config.tie_word_embeddings else v * h
    return v * h + config.num_hidden_layers * (attn + norms) + mlps + h + head


# family -> tiny transformers config overrides (conftest.tiny_hf_config); head_dim set apart from
# hidden / heads where the family allows it
TINY_FAMILIES = {
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3-tied": ("qwen3", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True)),
    "qwen2.5-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-sliding": ("mistral", dict(sliding_window=5)),
    "phi3": ("phi3", {}),
    "phi3-mha-sliding": ("phi3", dict(num_key_value_heads=4, sliding_window=9)),
    "phi3-partial-rotary": ("phi3", dict(partial_rotary_factor=0.5)),
    # Phi-3 128k / Phi-3.5: longrope, its long factors past original_max_position_embeddings
    "phi3-longrope": ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=16, rope_scaling={
        "type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]})),
    # sliding, full, sliding layers; caps low enough to bend this tiny model's scores and logits
    "gemma2": ("gemma2", dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                              attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
    "gemma2-defaults": ("gemma2", dict(head_dim=16, sliding_window=6)),
    "gemma3": ("gemma3", dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3-linear-rope": ("gemma3", dict(num_hidden_layers=6, head_dim=16, sliding_window=6, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}
NO_SDPA = ("gemma2",)  # transformers has no sdpa Gemma 2 (soft-capped scores): eager only


def write_header_only_checkpoint(path: Path, raw: dict, shard_bytes: int = 2**31) -> Path:
    """``config.json`` and safetensors shards (with their index) whose headers name every tensor
    with its shape and whose data regions are holes (sparse files: no weights written or stored),
    plus the quickstart tokenizer. Enough for ``validate``, which reads headers only."""
    path.mkdir(parents=True)
    config = DecoderConfig.from_hf(raw)
    shards: list[list] = [[]]
    for n, t in ((key, part) for name, full in build_model(config).state_dict().items()
                 for key, part in split_experts(config, name, full)):  # an MoE model's per-expert keys
        if n == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if shards[-1] and sum(2 * s.numel() for _, _, s in shards[-1]) + 2 * t.numel() > shard_bytes:
            shards.append([])
        shards[-1].append((n, torch.bfloat16, t.shape))
    weight_map = {}
    for i, entries in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header = header_bytes(entries, {"format": "pt"})
        with open(path / name, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(2 * s.numel() for _, _, s in entries))
        weight_map.update(dict.fromkeys((n for n, _, _ in entries), name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(raw))
    for f in ensure_tiny_model().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path

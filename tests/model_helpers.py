"""Model facts the tests check the package against, computed apart from it."""

from __future__ import annotations

from nxd_finetune.models import DecoderConfig


def num_parameters(config: DecoderConfig) -> int:
    """Total parameter count of a decoder with ``config``, computed from shapes (no tensors built)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    assert config.head_dim is not None and config.num_key_value_heads is not None  # set by __post_init__
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if config.qkv_bias else 0) + (h if config.o_bias else 0)
    mlp = 3 * h * i + ((2 * i + h) if config.mlp_bias else 0)
    norms = (4 if config.sandwich_norms else 2) * h + (2 * config.head_dim if config.qk_norm else 0)
    per_layer = attn + mlp + norms
    head = 0 if config.tie_word_embeddings else v * h
    return v * h + config.num_hidden_layers * per_layer + h + head


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

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

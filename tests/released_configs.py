"""``config.json`` of released checkpoints (the fields that define the model) and the parameter
counts their publishers state, for the tests that check parameter counts and ``validate`` the
shipped recipes at real size.

Every entry says which public copy it was checked against, field by field (written first from
memory, without the Hub, then checked against copies vendored in public repositories; none of them
is the Hub itself). Where no copy of the ``config.json`` was found, the entry says what was checked
instead and which fields stay unverified.
"""

from __future__ import annotations

from typing import Any

RELEASED_CONFIGS: dict[str, dict[str, Any]] = {
    # Verified, every field: mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py (preset
    # "qwen3_8b") and citsjtu2020/LLM-Prof sglang/Model_Config.md ("Qwen3-8B").
    "Qwen3-8B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
        "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936},
    # Verified, every field: Prashanth-Arun/model-chunking README.md at commit 1501f20e (the
    # Qwen/Qwen2.5-0.5B-Instruct config.json with only "architectures" and "model_type" renamed).
    "Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
        "max_position_embeddings": 32768, "max_window_layers": 21, "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936},
    # Checked against two public copies of microsoft/phi-4's config.json (transformers 4.47.0)
    # found by exact-string search, whose repository the search index does not name; the shapes
    # also against the GGUF metadata printed in the smcleod/phi-4 mirror's README (a stored page,
    # https://hf.qhduan.com/smcleod/phi-4). Corrected from those copies: eos_token_id and
    # pad_token_id (100265 and 100349 from memory; the copies have 100257 for both). A later Hub
    # revision may have changed the two token ids; no copy of one was found.
    "phi-4": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False, "bos_token_id": 100257,
        "embd_pdrop": 0.0, "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 5120,
        "intermediate_size": 17920, "max_position_embeddings": 16384, "num_attention_heads": 40,
        "num_hidden_layers": 40, "num_key_value_heads": 10, "original_max_position_embeddings": 16384,
        "pad_token_id": 100257, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 250000, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "vocab_size": 100352},
    # Verified, every field: mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py (preset "phi-3",
    # commented out there; _name_or_path Phi-3-mini-4k-instruct, transformers 4.39.3).
    "Phi-3-mini-4k-instruct": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "bos_token_id": 1, "embd_pdrop": 0.0,
        "eos_token_id": 32000, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 8192,
        "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "pad_token_id": 32000,
        "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32064},
    # Verified, every field: mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py ("gemma2_9b",
    # transformers 4.42.0.dev0; the preset names the size, not base or -it, which share every
    # shape). Corrected from it: torch_dtype (float32 from memory, of the base release; the copy,
    # like the -it checkpoint the gemma2-9b recipe trains, has bfloat16), and the entry named for
    # that checkpoint.
    "gemma-2-9b-it": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "intermediate_size": 14336,
        "max_position_embeddings": 8192, "num_attention_heads": 16, "num_hidden_layers": 42,
        "num_key_value_heads": 8, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "bfloat16", "vocab_size": 256000},
    # Verified, every field: mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py ("gemma2_2b",
    # transformers 4.42.4; its eos_token_id [1, 107] is the -it release's). Corrected from it: the
    # entry was "gemma-2-2b" (base) with eos_token_id 1 and torch_dtype float32, no copy of the base
    # config.json having been found; it is now the -it config as published.
    "gemma-2-2b-it": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8,
        "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "bfloat16",
        "vocab_size": 256000},
    # Verified, every field: mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py ("gemma3_1b_it",
    # transformers 4.50.0.dev0).
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
        "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144},
}

# Verified, every field: mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py ("qwen3_0.6b"); it
# differs from Qwen3-8B's in these fields only
RELEASED_CONFIGS["Qwen3-0.6B"] = {
    **RELEASED_CONFIGS["Qwen3-8B"], "hidden_size": 1024, "intermediate_size": 3072, "max_window_layers": 28,
    "num_attention_heads": 16, "num_hidden_layers": 28, "tie_word_embeddings": True}

# No copy of this config.json was found. Checked instead: the exact parameter count (below) and the
# model card (ZHUI/paddlenlp_model_readme Qwen/Qwen2.5-7B-Instruct/index.md: 28 layers, 28 query /
# 4 kv heads, config.json set for 32,768 tokens). Not verified: the token ids, max_window_layers and
# sliding_window (the values of mlc-llm's "qwen2_7b" preset, Qwen2-7B-Instruct, of the same shapes).
# It differs from Qwen2.5-0.5B-Instruct's config in these fields
RELEASED_CONFIGS["Qwen2.5-7B-Instruct"] = {
    **RELEASED_CONFIGS["Qwen2.5-0.5B-Instruct"], "hidden_size": 3584, "intermediate_size": 18944,
    "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "sliding_window": 131072, "tie_word_embeddings": False, "vocab_size": 152064}

# Mixture-of-experts releases (the recipes qwen3-30b-a3b-lora.yaml and mixtral-8x7b-lora.yaml).
# Checked, every field, against two public copies of Qwen/Qwen3-30B-A3B's config.json found by
# exact-string search (the index names neither repository): one listing Qwen3 configs by name
# ("Qwen3-30B-A3B", transformers 4.51.0, every field below equal), one quoted in a model-config
# parser (transformers 4.57.1, "dtype" for "torch_dtype", every shape and token id equal); the shapes
# also against keras-hub qwen3_moe "qwen3_moe_30b_a3b_en" (48 layers, 32 query / 4 kv heads, 128
# experts, 8 active) and its parameter count below.
RELEASED_CONFIGS["Qwen3-30B-A3B"] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
# Verified, every field: mlc-ai/mlc-llm python/mlc_llm/model/model_preset.py (preset
# "Mixtral-8x7B-v0.1", transformers 4.36.0.dev0); the shapes also against a vendored
# BUILTIN_MODEL_CONFIGS["mixtral_8x7b"] citing the Hub's config.json (found by exact-string search,
# its repository not named by the index).
RELEASED_CONFIGS["Mixtral-8x7B-v0.1"] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000}

# name -> total parameters as published (the Hub's safetensors count, or a count that equals it).
# keras-hub is keras-team/keras-hub keras_hub/src/models/<family>/<family>_presets.py.
PUBLISHED_PARAMETERS: dict[str, int] = {
    "Qwen3-8B": 8_190_735_360,  # keras-hub qwen3 "qwen3_8b_en"
    "Qwen3-0.6B": 596_049_920,  # keras-hub qwen3 "qwen3_0.6b_en"
    "Qwen2.5-0.5B-Instruct": 494_032_768,  # keras-hub qwen "qwen2.5_instruct_0.5b_en"; card: 0.49B
    # the Hub's own record (safetensors.total) of Qwen/Qwen2.5-7B-Instruct, stored in
    # daniel-p-green/alain-ai-learning-platform out/research-qwen-qwen2-5-7b-instruct/sources/huggingface/model.json
    "Qwen2.5-7B-Instruct": 7_615_616_512,
    # llama.cpp's general.parameter_count of microsoft/phi-4, in several public files found by
    # exact-string search (their repository not named by the index)
    "phi-4": 14_659_507_200,
    "Phi-3-mini-4k-instruct": 3_821_079_552,  # keras-hub phi3 "phi3_mini_4k_instruct_en"
    "gemma-2-9b-it": 9_241_705_984,  # keras-hub gemma "gemma2_instruct_9b_en" (the base: the same)
    "gemma-2-2b-it": 2_614_341_888,  # keras-hub gemma "gemma2_instruct_2b_en"
    # keras-hub gemma3 "gemma3_instruct_1b", and the Hub's record (safetensors.total) in
    # daniel-p-green/alain-ai-learning-platform out/research-google-gemma-3-1b-it/sources/huggingface/model.json
    "gemma-3-1b-it": 999_885_952,
    "Qwen3-30B-A3B": 30_532_122_624,  # keras-hub qwen3_moe "qwen3_moe_30b_a3b_en" (card: 30.5B, 3.3B activated)
    "Mixtral-8x7B-v0.1": 46_702_792_704,  # keras-hub mixtral "mixtral_8_7b_en"
}

# name -> parameters without the embeddings (and without an untied lm_head), as the model cards
# print them, in billions (ZHUI/paddlenlp_model_readme Qwen/Qwen2.5-7B-Instruct/index.md;
# Abandon-ht/LLM-tutorial docs/source/model_pages/qwen2.5-0.5b-instruct.rst)
PUBLISHED_NON_EMBEDDING_B: dict[str, float] = {"Qwen2.5-7B-Instruct": 6.53, "Qwen2.5-0.5B-Instruct": 0.36}

"""One record per supported architecture: what ``config.json`` calls it, how its config reads, its
tensor-parallel plan.

Everything that differs between families and is keyed by the architecture name lives in a
:class:`Family` in :data:`FAMILIES`; :class:`~nxd_finetune.models.config.DecoderConfig` reads the
config fields from it and :func:`nxd_finetune.parallel.plan.tp_plan_for` the plan. A new dense family
whose modules the decoder already has is one record here. What the model computes per family is
carried by :class:`DecoderConfig`'s derived fields (``flags``), so the model, the preflight's memory
estimate and the checkpoint names read those, never the architecture name.

A TP plan maps module-name patterns (``*``: one dotted name component) to a parallel style
(``column``, ``column_kv``, ``column_qkv``, ``column_gate_up``, ``row``, ``vocab``, ``replicate``,
``replicate_heads``: :mod:`nxd_finetune.parallel.plan` says what each does and applies them). It is
plain data: the model code never imports ``parallel/``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

LLAMA_TP_PLAN: Mapping[str, str] = MappingProxyType({
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "column",
    "model.layers.*.self_attn.k_proj": "column_kv",
    "model.layers.*.self_attn.v_proj": "column_kv",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column",
    "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
    "model.layers.*.input_layernorm": "replicate",
    "model.layers.*.post_attention_layernorm": "replicate",
    "model.norm": "replicate",
    # logits stay vocab-sharded: use vocab_parallel_cross_entropy (gather_from_tp for full logits)
    "lm_head": "column",
})
_HEAD_NORMS = {"model.layers.*.self_attn.q_norm": "replicate_heads",
               "model.layers.*.self_attn.k_norm": "replicate_heads"}
QWEN3_TP_PLAN: Mapping[str, str] = MappingProxyType({**LLAMA_TP_PLAN, **_HEAD_NORMS})
PHI3_TP_PLAN: Mapping[str, str] = MappingProxyType({
    **{k: v for k, v in LLAMA_TP_PLAN.items()
       if not k.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))},
    "model.layers.*.self_attn.qkv_proj": "column_qkv",
    "model.layers.*.mlp.gate_up_proj": "column_gate_up",
})
GEMMA2_TP_PLAN: Mapping[str, str] = MappingProxyType({
    **LLAMA_TP_PLAN,
    "model.layers.*.pre_feedforward_layernorm": "replicate",
    "model.layers.*.post_feedforward_layernorm": "replicate",
})
GEMMA3_TP_PLAN: Mapping[str, str] = MappingProxyType({**GEMMA2_TP_PLAN, **_HEAD_NORMS})
# mixture-of-experts families: the router and the experts stay whole on every tp rank (their input
# is replicated over tp; expert parallel splits the experts: parallel/experts.py); Qwen3-MoE's dense
# layers (``mlp_only_layers``) keep Llama's MLP entries
_MOE = {"model.layers.*.mlp.gate": "replicate", "model.layers.*.mlp.experts": "replicate"}
QWEN3_MOE_TP_PLAN: Mapping[str, str] = MappingProxyType({**QWEN3_TP_PLAN, **_MOE})
MIXTRAL_TP_PLAN: Mapping[str, str] = MappingProxyType({
    **{k: v for k, v in LLAMA_TP_PLAN.items() if not k.endswith(("gate_proj", "up_proj", "down_proj"))}, **_MOE})

_GEMMA_FLAGS = {"embed_scale": True, "norm_unit_offset": True, "sandwich_norms": True}


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How a mixture-of-experts family's ``config.json`` and checkpoints name its MoE block.

    The model holds transformers 5's fused tensors (``mlp.gate.weight [E, H]``,
    ``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``); checkpoints (the
    Hub's, and what transformers 5.24 writes) hold one tensor per expert:
    ``<block>.experts.<e>.<gate|up|down>.weight``, and the router as ``<block>.gate.weight``.
    ``experts_key`` / ``intermediate_key``: the config keys of the expert count and width;
    ``defaults``: transformers' values for MoE keys a ``config.json`` may leave out;
    ``norm_topk_prob``: fixed by the family (Mixtral renormalises its top-k always), None: read.
    """

    block: str
    gate: str
    up: str
    down: str
    experts_key: str
    intermediate_key: str
    defaults: Mapping[str, int | float | bool]
    norm_topk_prob: bool | None = None


QWEN3_MOE_EXPERTS = ExpertLayout("mlp", "gate_proj", "up_proj", "down_proj", "num_experts", "moe_intermediate_size",
                                 MappingProxyType({"num_experts": 128, "num_experts_per_tok": 8,
                                                   "moe_intermediate_size": 768, "norm_topk_prob": False}))
MIXTRAL_EXPERTS = ExpertLayout("block_sparse_moe", "w1", "w3", "w2", "num_local_experts", "intermediate_size",
                               MappingProxyType({"num_local_experts": 8, "num_experts_per_tok": 2}),
                               norm_topk_prob=True)


@dataclasses.dataclass(frozen=True)
class Family:
    """A supported text architecture.

    ``architecture`` / ``model_type``: its names in ``config.json``. ``flags``: the
    :class:`DecoderConfig` derived fields that differ from Llama's (``qkv_bias``, ``qk_norm``,
    ``fused_qkv``, ``fused_gate_up``, ``embed_scale``, ``norm_unit_offset``, ``sandwich_norms``).
    ``attention_bias_all``: ``attention_bias`` puts a bias on q, k, v and o (else only ``flags``
    say where biases are). ``gemma``: Gemma's config reading (rope per layer type, ``layer_types``
    kept). ``window_needs_flag``: a ``sliding_window`` applies only with ``use_sliding_window``
    (Qwen2 / Qwen3). ``tp_plan``: module pattern -> parallel style. ``experts``: a
    mixture-of-experts family's names (:class:`ExpertLayout`; ``models/moe.py`` is its block).
    """

    architecture: str
    model_type: str
    tp_plan: Mapping[str, str]
    flags: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    attention_bias_all: bool = False
    gemma: bool = False
    window_needs_flag: bool = False
    experts: ExpertLayout | None = None


@dataclasses.dataclass(frozen=True)
class MultimodalFamily:
    """A multimodal architecture whose language model is one of :data:`FAMILIES` (``text_config``;
    images are not modelled): ``text_architecture`` names that family."""

    architecture: str
    model_type: str
    text_architecture: str


FAMILIES: Mapping[str, Family] = MappingProxyType({f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", LLAMA_TP_PLAN, attention_bias_all=True),
    Family("MistralForCausalLM", "mistral", LLAMA_TP_PLAN),
    Family("Qwen2ForCausalLM", "qwen2", LLAMA_TP_PLAN, {"qkv_bias": True}, window_needs_flag=True),
    Family("Qwen3ForCausalLM", "qwen3", QWEN3_TP_PLAN, {"qk_norm": True}, attention_bias_all=True,
           window_needs_flag=True),
    Family("Phi3ForCausalLM", "phi3", PHI3_TP_PLAN, {"fused_qkv": True, "fused_gate_up": True}),
    Family("Gemma2ForCausalLM", "gemma2", GEMMA2_TP_PLAN, _GEMMA_FLAGS, attention_bias_all=True, gemma=True),
    Family("Gemma3ForCausalLM", "gemma3_text", GEMMA3_TP_PLAN, {**_GEMMA_FLAGS, "qk_norm": True},
           attention_bias_all=True, gemma=True),
    Family("Qwen3MoeForCausalLM", "qwen3_moe", QWEN3_MOE_TP_PLAN, {"qk_norm": True}, attention_bias_all=True,
           window_needs_flag=True, experts=QWEN3_MOE_EXPERTS),
    Family("MixtralForCausalLM", "mixtral", MIXTRAL_TP_PLAN, {"router_fp32_weights": True},
           experts=MIXTRAL_EXPERTS),
)})
"""Every supported text architecture, by its ``config.json`` name."""

REFUSED: Mapping[str, str] = MappingProxyType({
    "GptOssForCausalLM": "its attention sinks (a learned per-head logit in the softmax) have no kernel in the "
                         "decoder's SDPA / flex attention, and its experts (biases, clamped SwiGLU over interleaved "
                         "gate/up, a router with a bias and softmax after top-k) are not the Qwen3-MoE / Mixtral block",
})
"""Architectures refused with a reason (one line), by their ``config.json`` name."""

MULTIMODAL: Mapping[str, MultimodalFamily] = MappingProxyType({f.architecture: f for f in (
    MultimodalFamily("Gemma3ForConditionalGeneration", "gemma3", "Gemma3ForCausalLM"),
)})
"""Every supported multimodal architecture, by its ``config.json`` name."""


def architecture_of_type(model_type: str) -> str:
    """The architecture a ``config.json`` without ``architectures`` means by ``model_type`` ("" if none)."""
    names = {f.model_type: f.architecture for f in FAMILIES.values()}
    names.update((f.model_type, f.architecture) for f in MULTIMODAL.values())
    return names.get(model_type, "")

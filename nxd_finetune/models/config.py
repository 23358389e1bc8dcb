"""Decoder configuration read from a HuggingFace ``config.json``.

One dataclass covers the Llama family (Llama 2, Llama 3/3.1/3.2, Mistral, Qwen2/2.5) and the families
that differ from it in a few places (Qwen3: per-head q/k norms), as fields. Field names
are HF's so ``config.json`` maps onto it directly and parallel code can check divisibility on the
same names users see in their checkpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.jsontypes import JsonObject
from nxd_finetune.models.families import FAMILIES, MULTIMODAL, REFUSED, Family, architecture_of_type

ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")
LANGUAGE_MODEL_PREFIX = "model.language_model."
"""A multimodal model's language model, as transformers 5 names its modules."""
# transformers 5.24's Gemma3TextConfig defaults for what a ``text_config`` may leave out (the released
# Gemma 3 4b/12b/27b configs name only a few keys); the rope keys in their pre-5 flat form
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
    "attention_bias": False, "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "tie_word_embeddings": True, "_sliding_window_pattern": 6,
}
# fields of ours that are not HF config keys (never written by to_hf)
_DERIVED = ("raw", "architecture", "qkv_bias", "qk_norm", "fused_qkv", "fused_gate_up", "embed_scale",
            "norm_unit_offset", "sandwich_norms", "multimodal", "router_fp32_weights")
# the mixture-of-experts fields, written by to_hf only for a model with experts
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
               "mlp_only_layers", "router_aux_loss_coef", "output_router_logits", "router_jitter_noise")


@dataclasses.dataclass
class DecoderConfig:
    """Hyper-parameters of a Llama-family decoder, with HF field names.

    ``rope_scaling`` is the HF dict (``rope_type`` / ``type``: ``default``, ``linear`` or ``llama3``)
    or None. ``qkv_bias`` is True for Qwen2 (bias on q/k/v, none on o) and follows
    ``attention_bias`` (bias on q/k/v/o) for Llama and Qwen3. ``qk_norm`` (Qwen3): an RMSNorm over
    ``head_dim`` applied to every query and key head before rope (``q_norm``/``k_norm``, one weight
    shared by the heads). ``fused_qkv`` / ``fused_gate_up`` (Phi-3, Phi-4): one ``qkv_proj`` (q,
    k, v rows) and one ``gate_up_proj`` (gate, up halves) instead of separate projections.
    ``partial_rotary_factor``: rope turns the first ``head_dim * factor`` dimensions of each head.

    Gemma 2 / 3: ``embed_scale`` (embeddings times sqrt(hidden_size)), ``norm_unit_offset`` (RMSNorm
    weights applied as ``1 + weight``), ``sandwich_norms`` (four norms per layer: the attention and MLP
    outputs are normed before the residual too), ``hidden_act`` ``gelu_pytorch_tanh`` (GeGLU),
    ``query_pre_attn_scalar`` (softmax scale ``1/sqrt(it)``), ``attn_logit_softcapping`` and
    ``final_logit_softcapping`` (``cap * tanh(x / cap)`` on attention scores and on the logits),
    ``layer_types`` (``sliding_attention`` layers use ``sliding_window``, ``full_attention`` ones do
    not; None: every layer uses ``sliding_window``), ``rope_local_base_freq`` (Gemma 3: the rope base
    of the sliding layers, which take no rope scaling).

    ``multimodal``: read from a multimodal checkpoint (``Gemma3ForConditionalGeneration``): the fields
    are its ``text_config``'s, ``raw`` the whole config; :meth:`checkpoint_keys` and
    :meth:`module_name` name the language model's tensors and modules as that checkpoint does.

    Mixture of experts (Qwen3-MoE, Mixtral; ``models/moe.py``): ``num_experts`` (0: a dense model)
    experts of width ``moe_intermediate_size`` on the layers :meth:`is_moe_layer` names (Qwen3-MoE's
    ``decoder_sparse_step`` / ``mlp_only_layers``; the others keep an MLP of ``intermediate_size``),
    ``num_experts_per_tok`` of them per token, their softmax weights renormalised over the top k with
    ``norm_topk_prob``; ``router_fp32_weights`` (Mixtral) keeps those weights in fp32 where Qwen3-MoE
    casts them to the model's dtype. ``router_aux_loss_coef`` / ``output_router_logits``: transformers'
    load-balancing loss settings (:func:`nxd_finetune.models.moe.router_aux_loss` computes it);
    ``router_jitter_noise``: Mixtral's multiplicative noise on the block's input while training.
    """

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    partial_rotary_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    embed_scale: bool = False
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_types: list[str] | None = None
    rope_local_base_freq: float | None = None
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()  # a plain default: adapters recorded before it compare equal
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    router_jitter_noise: float = 0.0
    router_fp32_weights: bool = False
    multimodal: bool = False
    raw: JsonObject = dataclasses.field(default_factory=dict, repr=False)  # the HF config.json read

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"hidden_act={self.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok={self.num_experts_per_tok} must lie in 1..num_experts="
                                 f"{self.num_experts}")
        if self.num_experts and self.decoder_sparse_step < 1:
            raise ModelLoadError(f"decoder_sparse_step={self.decoder_sparse_step} must be at least 1")

    @classmethod
    def from_hf(cls, source: str | Path | JsonObject) -> DecoderConfig:
        """Build from a config dict, a ``config.json`` path or a model directory.

        Raises ModelLoadError for an unreadable file or an unsupported architecture (the message
        lists the supported ones).
        """
        # HF's values go into the fields as they are (``__post_init__`` checks them): read untyped
        raw: dict[str, Any]
        if isinstance(source, dict):
            raw = dict(source)
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ModelLoadError(f"model config not found: {path}")
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        archs = raw.get("architectures") or [architecture_of_type(raw.get("model_type", ""))]
        arch = archs[0] if archs else ""
        if arch in MULTIMODAL:
            return cls._from_multimodal(arch, raw)
        if arch in REFUSED:
            raise ModelLoadError(f"{arch} is not supported: {REFUSED[arch]}")
        if arch not in FAMILIES:
            supported = ", ".join(FAMILIES)
            raise ModelLoadError(f"unsupported architecture {arch or raw.get('model_type')!r}; supported: {supported}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in fields and k not in _DERIVED}
        # transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; older checkpoints
        # write rope_theta + rope_scaling. Normalise to the latter.
        rope_params = raw.get("rope_parameters")
        family = FAMILIES[arch]
        if family.gemma:
            rope_params = _gemma_kwargs(arch, raw, kwargs)
        else:
            kwargs.pop("layer_types", None)  # windows apply to every layer of the other families
        if isinstance(rope_params, dict):
            rope_params = dict(rope_params)
            kwargs["rope_theta"] = rope_params.pop("rope_theta", kwargs.get("rope_theta", 10000.0))
            if "partial_rotary_factor" in rope_params:
                kwargs["partial_rotary_factor"] = rope_params.pop("partial_rotary_factor")
            kind = rope_params.get("rope_type", rope_params.get("type", "default"))
            kwargs["rope_scaling"] = None if kind == "default" else rope_params
        kwargs.update(family.flags)
        _expert_kwargs(family, raw, kwargs)
        if family.attention_bias_all:
            kwargs["qkv_bias"] = bool(raw.get("attention_bias", False))
        if family.window_needs_flag and not raw.get("use_sliding_window", False):
            kwargs["sliding_window"] = None
        elif arch == "Qwen3ForCausalLM":  # windows on some layers only (max_window_layers): not modelled
            raise ModelLoadError("Qwen3 with use_sliding_window=true is not supported")
        return cls(architecture=arch, raw=raw, **kwargs)

    @classmethod
    def _from_multimodal(cls, arch: str, raw: JsonObject) -> DecoderConfig:
        """The language model of a multimodal config: its ``text_config`` over transformers'
        defaults, the tie of the top level (where transformers reads it), no logit soft-capping
        (transformers' multimodal head applies none), ``raw`` the whole config."""
        text = raw.get("text_config") or {}
        if not isinstance(text, dict):
            raise ModelLoadError(f"{arch} config: text_config is not a mapping")
        # transformers' multimodal head never soft-caps the logits, whatever text_config says
        text = {**GEMMA3_TEXT_DEFAULTS, **text, "architectures": [MULTIMODAL[arch].text_architecture],
                "final_logit_softcapping": None}
        if "tie_word_embeddings" in raw:
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        config = cls.from_hf(text)
        config.multimodal, config.raw = True, raw
        return config

    def checkpoint_keys(self, name: str) -> tuple[str, ...]:
        """The keys a checkpoint may hold our tensor ``name`` under, in the order to try: itself
        for a text model; for a multimodal one the layout transformers writes
        (``language_model.model.*``, ``language_model.lm_head.weight``), then its module names
        (``model.language_model.*``, ``lm_head.weight``), which it also reads."""
        if self.multimodal:
            return ("language_model." + name, self.module_name(name))
        layout = FAMILIES[self.architecture].experts if self.architecture in FAMILIES else None
        if layout is not None and layout.block != "mlp" and name.endswith(".mlp.gate.weight"):
            return (name, name.removesuffix(".mlp.gate.weight") + f".{layout.block}.gate.weight")
        return (name,)

    def expert_module_names(self) -> frozenset[str]:
        """The short module names PEFT reads as this model's experts in an adapter's ``target_modules``
        (transformers 5 fused the per-expert ``gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's
        ``w1`` / ``w3`` / ``w2``, and PEFT maps those names onto the fused tensors, for every layer):
        empty for a dense model."""
        layout = FAMILIES[self.architecture].experts if self.architecture in FAMILIES else None
        if layout is None or not self.num_experts:
            return frozenset()
        return frozenset((layout.gate, layout.up, layout.down))

    def expert_keys(self, name: str) -> tuple[tuple[str, ...], ...] | None:
        """The per-expert checkpoint keys our fused expert tensor ``name`` is made of (None for
        any other tensor): ``mlp.experts.gate_up_proj`` is each expert's gate weights stacked, then
        each one's up weights (concatenated along dim 1), ``mlp.experts.down_proj`` each one's down
        weights stacked, under the family's names (:class:`~nxd_finetune.models.families.ExpertLayout`)."""
        layout = FAMILIES[self.architecture].experts if self.architecture in FAMILIES else None
        prefix, _, param = name.rpartition(".mlp.experts.")
        if layout is None or not prefix or param not in ("gate_up_proj", "down_proj"):
            return None
        parts = (layout.gate, layout.up) if param == "gate_up_proj" else (layout.down,)
        return tuple(tuple(f"{prefix}.{layout.block}.experts.{e}.{part}.weight" for e in range(self.num_experts))
                     for part in parts)

    def module_name(self, name: str) -> str:
        """Our module or parameter ``name`` as transformers' model names it (PEFT's adapter keys):
        ``model.layers.0...`` is ``model.language_model.layers.0...`` in a multimodal model
        (:func:`text_model_name` is the way back)."""
        if self.multimodal and name.startswith("model."):
            return LANGUAGE_MODEL_PREFIX + name.removeprefix("model.")
        return name

    def to_hf(self) -> JsonObject:
        """The HF ``config.json`` dict (the original one when read from disk)."""
        if self.raw:
            return dict(self.raw)
        model_type = FAMILIES[self.architecture].model_type
        out = {k: v for k, v in dataclasses.asdict(self).items()
               if k not in _DERIVED and (self.num_experts or k not in _MOE_FIELDS)}
        out.update(architectures=[self.architecture], model_type=model_type, torch_dtype="float32")
        return out

    def config_hash(self) -> str:
        """A short stable hash of the HF config, recorded in adapters to tie them to a base."""
        blob = json.dumps(self.to_hf(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and FAMILIES[self.architecture].attention_bias_all

    def is_moe_layer(self, index: int) -> bool:
        """Layer ``index`` has a mixture-of-experts block (else a dense MLP), as transformers'
        Qwen3-MoE decides: not in ``mlp_only_layers`` and ``index + 1`` a multiple of
        ``decoder_sparse_step``."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer ``index`` (None: full causal attention)."""
        if self.layer_types is not None and self.layer_types[index] != "sliding_attention":
            return None
        return self.sliding_window


def _expert_kwargs(family: Family, raw: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """A mixture-of-experts family's expert fields into ``kwargs`` (nothing for a dense family): the
    family's config keys over transformers' defaults (``num_experts`` is ``num_local_experts`` in
    Mixtral's configs and in those transformers 5 writes for Qwen3-MoE)."""
    layout = family.experts
    if layout is None:
        return
    read = {**layout.defaults, **raw}
    kwargs["num_experts"] = raw.get("num_experts", raw.get("num_local_experts", layout.defaults[layout.experts_key]))
    kwargs["num_experts_per_tok"] = read["num_experts_per_tok"]
    kwargs["moe_intermediate_size"] = read.get(layout.intermediate_key)
    kwargs["norm_topk_prob"] = read.get("norm_topk_prob") if layout.norm_topk_prob is None else layout.norm_topk_prob
    kwargs["mlp_only_layers"] = tuple(read.get("mlp_only_layers") or ())


def _gemma_kwargs(arch: str, raw: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Gemma's fields into ``kwargs``: the activation (``hidden_activation``), tied embeddings unless
    the config says otherwise, the layer types when the
    config predates them (Gemma 2 alternates sliding and full layers starting with a sliding one;
    Gemma 3 makes every ``sliding_window_pattern``-th layer full), and Gemma 3's per-layer-type rope
    (transformers 5's ``rope_parameters`` keyed by layer type). Returns the rope parameters of the
    full-attention layers in the one-dict form the caller normalises."""
    kwargs["hidden_act"] = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    # transformers' defaults for what a Gemma config.json may leave out (released ones omit the tie)
    defaults: dict[str, Any] = {"tie_word_embeddings": True, "head_dim": 256, "query_pre_attn_scalar": 256}
    if arch == "Gemma2ForCausalLM":
        defaults.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    for key, value in defaults.items():
        kwargs.setdefault(key, value)
    n = int(raw.get("num_hidden_layers", 0))
    if not raw.get("layer_types"):
        every = 2 if arch == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern")
                                                           or raw.get("_sliding_window_pattern") or 6)
        kwargs["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"rope scaling on sliding layers ({local.get('rope_type')}) is not supported")
        kwargs["rope_local_base_freq"] = local.get("rope_theta", raw.get("rope_local_base_freq"))
        return dict(rope["full_attention"])
    if arch == "Gemma3ForCausalLM" and kwargs.get("rope_local_base_freq") is None:
        kwargs["rope_local_base_freq"] = 10000.0  # transformers' default for Gemma 3
    return rope if isinstance(rope, dict) else None


_TEXT_MODEL_PREFIXES = ((LANGUAGE_MODEL_PREFIX, "model."), ("language_model.model.", "model."),
                        ("language_model.lm_head.", "lm_head."))


def text_model_name(key: str) -> str:
    """A multimodal model's language-model name (``model.language_model.*`` as transformers 5
    names it, ``language_model.model.*`` / ``language_model.lm_head.*`` as its checkpoints and 4.x
    adapters do) as ours: the inverse of :meth:`DecoderConfig.module_name` and
    :meth:`DecoderConfig.checkpoint_keys`; other names unchanged."""
    for theirs, ours in _TEXT_MODEL_PREFIXES:
        if key.startswith(theirs):
            return ours + key.removeprefix(theirs)
    return key

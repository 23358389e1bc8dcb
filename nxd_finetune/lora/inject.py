"""Putting LoRA into a model, finding it again, and folding it back out.

Matching follows PEFT (``peft.tuners.tuners_utils.check_target_module_exists``): list entries match
a module whose name equals the entry or ends with ``"." + entry``; a string is ``re.fullmatch``-ed
against the full module name; ``"all-linear"`` is every linear layer but ``lm_head``. Modules named
in ``modules_to_save`` (and everything under them) are never LoRA targets. ``target_parameters``
puts LoRA on a mixture-of-experts model's fused expert tensors (:mod:`nxd_finetune.lora.experts`).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from nxd_finetune.errors import AdapterError, NxdWarning
from nxd_finetune.lora.config import ALL_LINEAR, LoraConfig
from nxd_finetune.lora.dora import MAGNITUDE, dora_layer_for
from nxd_finetune.lora.experts import ExpertLora, expert_parameters, find_expert_targets, wrap_experts
from nxd_finetune.lora.layers import LoraLinear, ModulesToSaveWrapper, lora_layer_for
from nxd_finetune.models.config import DecoderConfig

OUTPUT_LAYER = "lm_head"


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """``(name, module)`` for every :class:`LoraLinear` in ``model`` (found by type, not by name)."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


def lora_target_names(model: nn.Module) -> list[str]:
    """The LoRA-wrapped linear modules' names (what ``all-linear`` resolves to in an adapter's
    ``target_modules``), leaving out the expert-tensor wrappers of ``target_parameters``."""
    return [name for name, m in lora_modules(model) if not isinstance(m, ExpertLora)]


def saved_modules(model: nn.Module) -> Iterator[tuple[str, ModulesToSaveWrapper]]:
    """``(name, wrapper)`` for every ``modules_to_save`` wrapper in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            yield name, module


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every parameter with ``requires_grad``, in module order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def cast_adapter_params(model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Cast LoRA factors and ``modules_to_save`` copies to ``dtype`` (fp32 master weights for a
    bf16/fp16 base), as PEFT's ``autocast_adapter_dtype`` does. Both layer types convert their
    inputs and outputs, so the model runs as before. Biases trained in place (``bias`` modes) are
    left in their base layer's dtype: ``F.linear`` needs weight and bias in one dtype.
    """
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_A.to(dtype)
            m.lora_B.to(dtype)
            magnitude = m._parameters.get(MAGNITUDE)
            if magnitude is not None:  # DoRA's
                magnitude.data = magnitude.data.to(dtype)
        for _, w in saved_modules(model):
            w.modules_to_save.to(dtype)


def base_param_name(name: str) -> str:
    """The HF checkpoint key of a parameter of a LoRA-injected model.

    ``...q_proj.base_layer.weight`` -> ``...q_proj.weight``; ``lm_head.original_module.weight`` and
    ``lm_head.modules_to_save.weight`` -> ``lm_head.weight``. LoRA factors keep their names (they are
    not in the base checkpoint). Pass as ``name_map`` to ``models.materialize`` to load a base
    checkpoint into a model injected on the meta device.
    """
    return re.sub(r"\.(?:base_layer|original_module|modules_to_save)(?=\.)", "", name)


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if lora_layer_for(m) is not None]


def _matches_name(name: str, entries: list[str]) -> bool:
    return any(name == e or name.endswith("." + e) for e in entries)


def _is_target(name: str, module: nn.Module, cfg: LoraConfig, hf_name: str | None = None) -> bool:
    """Whether ``cfg.target_modules`` selects module ``name``, or its transformers name ``hf_name``
    (a multimodal model's, which its adapters name: :meth:`DecoderConfig.module_name`)."""
    if hf_name is not None and hf_name != name and _is_target(hf_name, module, cfg):
        return True
    if cfg.modules_to_save and any(re.match(rf"(^|.*\.){re.escape(m)}($|\..*)", name) for m in cfg.modules_to_save):
        return False
    targets = cfg.target_modules
    if targets == ALL_LINEAR:
        return lora_layer_for(module) is not None and name.rpartition(".")[2] != OUTPUT_LAYER
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return _matches_name(name, targets)


def find_targets(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Names of the modules ``cfg.target_modules`` selects, in module order.

    Raises AdapterError when nothing matches (listing the linear layers that exist, by short
    name) or when a match is not a linear layer LoRA can wrap. On a mixture-of-experts model the
    names PEFT reads as the experts (:meth:`DecoderConfig.expert_module_names`: a dense layer's
    ``gate_proj`` / ``up_proj`` / ``down_proj`` in Qwen3-MoE) are left out of ``all-linear`` and
    refused when named, and ``all-linear`` says in one warning line what it covers there.
    ``target_modules`` may match nothing when ``target_parameters`` is set.
    """
    found = []
    config = getattr(model, "config", None)
    experts = config.expert_module_names() if isinstance(config, DecoderConfig) else frozenset()
    for name, module in model.named_modules():
        if not name or isinstance(module, (LoraLinear, ModulesToSaveWrapper)):
            continue
        hf_name = config.module_name(name) if isinstance(config, DecoderConfig) else None
        if _is_target(name, module, cfg, hf_name):
            short = name.rpartition(".")[2]
            if short in experts and cfg.target_modules == ALL_LINEAR:
                continue  # a dense layer's MLP of a mixture-of-experts model: see below
            if short in experts:
                raise AdapterError(f"lora target {name}: on a mixture-of-experts model PEFT reads target_modules "
                                   f"{short!r} as the experts' fused tensors, so the adapter would not load as "
                                   "trained; target the attention projections (q_proj, k_proj, v_proj, o_proj)")
            if lora_layer_for(module) is None:
                raise AdapterError(f"lora target {name} is a {type(module).__name__}; LoRA wraps only linear layers")
            found.append(name)
    if experts and cfg.target_modules == ALL_LINEAR:
        _note_all_linear(model, found, cfg)
    if not found and not cfg.target_parameters:
        short = sorted({n.rpartition(".")[2] for n in _linear_names(model)})
        raise AdapterError(
            f"lora target_modules {cfg.target_modules!r} matched no module; linear modules in the model: "
            f"{', '.join(short) or '(none)'}"
        )
    return found


def _note_all_linear(model: nn.Module, found: list[str], cfg: LoraConfig) -> None:
    covered = ", ".join(sorted({n.rpartition(".")[2] for n in found})) or "no module"
    tensors = ", ".join(sorted({"mlp.experts." + p for _, p, _ in expert_parameters(model)}))
    experts = (f"the expert tensors through lora.target_parameters {cfg.target_parameters}" if cfg.target_parameters
               else f"not the experts (name them in lora.target_parameters: {tensors})")
    warnings.warn(f"lora all-linear on a mixture-of-experts model covers {covered}; {experts}; the router "
                  "(mlp.gate) trains only through lora.modules_to_save", NxdWarning, stacklevel=3)


def inject_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Wrap the modules ``cfg`` targets with LoRA, in place, and set what trains.

    Afterwards only LoRA factors, ``modules_to_save`` copies and (per ``cfg.bias``) biases have
    ``requires_grad``; every other parameter is frozen. Module names do not change, so a target's
    parameters become ``<name>.base_layer.weight``, ``<name>.lora_A.weight``,
    ``<name>.lora_B.weight`` (PEFT's names; with ``use_dora`` also ``<name>.lora_magnitude_vector``,
    :mod:`nxd_finetune.lora.dora`); ``target_parameters`` wrap the experts modules
    (:class:`~nxd_finetune.lora.experts.ExpertLora`, PEFT's nesting and names). Returns the wrapped
    linear module names in module order (the expert wrappers are not among them).

    Raises AdapterError when the model already holds LoRA layers, when ``target_modules`` matches
    nothing (see :func:`find_targets`) or when a ``modules_to_save`` entry matches no module.
    """
    if next(lora_modules(model), None) is not None:
        raise AdapterError("the model already has LoRA layers; inject_lora runs once per model")
    targets = find_targets(model, cfg)
    expert_targets = find_expert_targets(model, cfg)
    save_names = _modules_to_save_names(model, cfg.modules_to_save)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in targets:
        base = model.get_submodule(name)
        layer_cls = lora_layer_for(base)
        assert layer_cls is not None  # find_targets keeps modules with a registered LoRA layer only
        if cfg.use_dora:
            layer_cls = dora_layer_for(layer_cls, name)
        wrapped = layer_cls(
            base,
            r=cfg.r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            use_rslora=cfg.use_rslora,
            init_lora_weights=cfg.init_lora_weights,
        )
        _set_submodule(model, name, wrapped)
    for module, parameter_name in expert_targets:
        wrap_experts(model, module, parameter_name, cfg)
    for name in save_names:
        _set_submodule(model, name, ModulesToSaveWrapper(model.get_submodule(name)))
    _mark_trainable_biases(model, cfg.bias)
    return targets


def _modules_to_save_names(model: nn.Module, entries: list[str]) -> list[str]:
    names: list[str] = []
    for entry in entries:
        hits = [n for n, _ in model.named_modules() if n and _matches_name(n, [entry])]
        if not hits:
            raise AdapterError(f"modules_to_save entry {entry!r} matched no module")
        names.extend(hits)
    # outermost first; drop a module that sits inside another one already chosen
    chosen: list[str] = []
    for n in sorted(set(names), key=lambda s: (s.count("."), s)):
        if not any(n.startswith(c + ".") for c in chosen):
            chosen.append(n)
    return chosen


def _mark_trainable_biases(model: nn.Module, bias: str) -> None:
    """PEFT's ``bias`` modes: ``all`` trains every ``*.bias`` (a frozen ``original_module`` kept for
    ``modules_to_save`` excepted), ``lora_only`` the biases of LoRA-wrapped layers."""
    if bias == "all":
        for n, p in model.named_parameters():
            if n.endswith(".bias") and ".original_module." not in n:
                p.requires_grad_(True)
    elif bias == "lora_only":
        for _, m in lora_modules(model):
            if m.base_layer.bias is not None:
                m.base_layer.bias.requires_grad_(True)


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain layers back, in place.

    ``LoraLinear`` -> its (merged) base layer; ``ModulesToSaveWrapper`` -> its trained copy. When
    the config ties ``lm_head`` to the embeddings and either one changed, the tie is broken first
    (merging into a shared weight would change both) and ``model.config`` is replaced by a copy
    with ``tie_word_embeddings=False``, so saving the result keeps both tensors. Returns ``model``.
    """
    changed = {n for n, _ in lora_modules(model)} | {n for n, _ in saved_modules(model)}
    config = getattr(model, "config", None)
    untie = bool(getattr(config, "tie_word_embeddings", False)) and any(
        n == OUTPUT_LAYER or n.endswith(".embed_tokens") for n in changed
    )
    for name, module in reversed(list(lora_modules(model))):  # innermost first: nested expert wrappers
        if untie and name == OUTPUT_LAYER:
            w = module.weight
            module.base_layer.weight = nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
        module.merge()
        _set_submodule(model, name, module.base_layer)
    for name, wrapper in list(saved_modules(model)):
        _set_submodule(model, name, wrapper.modules_to_save)
    if untie:
        assert isinstance(config, DecoderConfig)  # untie: a config with tie_word_embeddings set
        model.config = untied_config(config)  # type: ignore[assignment]  # nn.Module types attributes as Tensor | Module
    return model


def untied_config(config: DecoderConfig) -> DecoderConfig:
    """A copy of a ``DecoderConfig`` with ``tie_word_embeddings=False`` (also in its raw HF dict)."""
    raw = {**config.raw, "tie_word_embeddings": False} if config.raw else {}
    return dataclasses.replace(config, tie_word_embeddings=False, raw=raw)

"""Model checks of ``validate``: config, weights and tokenizer files are there, every tensor the
config implies is in the checkpoint with its shape (safetensors headers only), and the parameter
counts of a meta-device build with the recipe's LoRA injected."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.errors import ModelLoadError
from nxd_finetune.lora import LoraConfig, inject_lora
from nxd_finetune.lora.init_from import check_init_from
from nxd_finetune.models import DecoderConfig, build_model, checkpoint_index
from nxd_finetune.models.loading import checkpoint_shapes
from nxd_finetune.preflight.data import first_line
from nxd_finetune.registry.fetch import fetch_adapter

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe


def find_model_dir(recipe: Recipe) -> Path:
    """The model directory, after checking config, weights and tokenizer files are there."""
    path = recipe.model.path
    if "://" in path:
        raise ModelLoadError(f"model.path {path}: remote models are not supported; give a local directory")
    model_dir = resolve_model_dir(path)
    tok = recipe.model.tokenizer
    if tok is None or "://" not in tok:
        tok_dir = Path(tok) if tok else model_dir
        names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        if not any((tok_dir / n).is_file() for n in names):
            raise ModelLoadError(f"no tokenizer in {tok_dir} (expected one of {', '.join(names)}); "
                                 "set model.tokenizer")
    return model_dir


def check_weights(model: torch.nn.Module, config: DecoderConfig, model_dir: Path) -> None:
    """Every model tensor is in the checkpoint with the right shape (safetensors headers only)."""
    from safetensors import safe_open

    index = checkpoint_index(model_dir)
    tensors = dict(model.state_dict())
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = {key: shape for name, t in tensors.items()
                for key, shape in checkpoint_shapes(config, name, t.shape, index).items()}
    missing = [n for n in expected if n not in index]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"checkpoint in {model_dir} lacks {', '.join(missing[:3])}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(index[name], []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                shapes = {name: list(f.get_slice(name).get_shape()) for name in names}
        except Exception as e:  # a truncated or corrupt header
            raise ModelLoadError(f"{file}: unreadable safetensors file: {first_line(e)}") from None
        for name, shape in shapes.items():
            want = expected[name]
            if shape != want:
                raise ModelLoadError(f"{file.name}: tensor {name} has shape {shape}, the config implies {want}")


def count_parameters(recipe: Recipe, config: DecoderConfig,
                     model_dir: Path | None = None) -> tuple[int, int, list[str]]:
    """(total, trainable, LoRA-wrapped module names) from a meta-device build of the model with the
    recipe's LoRA injected; checks the checkpoint's tensor names/shapes when ``model_dir`` is given.
    ``inject_lora`` raises AdapterError when ``lora.target_modules`` matches nothing."""
    model = build_model(config)
    if model_dir is not None:
        check_weights(model, config, model_dir)
    targets: list[str] = []
    if recipe.lora is not None:
        for p in model.parameters():
            p.requires_grad_(False)
        with torch.device("meta"):
            targets = inject_lora(model, LoraConfig.from_section(recipe.lora))
    params = list(model.parameters())  # deduplicated, so tied embeddings count once
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), targets


def expert_parameters(config: DecoderConfig) -> tuple[int, int]:
    """``(expert parameters, those a token runs)`` of a mixture-of-experts model: each MoE layer's
    fused experts, ``E x 3 x H x I_moe`` (``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``), of
    which a token runs ``num_experts_per_tok`` experts' share; ``(0, 0)`` for a dense model. The
    router counts with the dense parameters (every token runs it): the active parameters per token
    are ``total - experts + active experts``."""
    if not config.num_experts:
        return 0, 0
    per_layer = 3 * config.hidden_size * (config.moe_intermediate_size or config.intermediate_size)
    layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    return config.num_experts * per_layer * layers, config.num_experts_per_tok * per_layer * layers


def check_init_from_adapter(recipe: Recipe, config: DecoderConfig, model_dir: Path) -> None:
    """``lora.init_from``: the checks ``run`` makes before loading the adapter
    (:func:`nxd_finetune.lora.init_from.check_init_from`: LoRA ``peft_type``, the recipe's LoRA, the
    same base), so ``validate`` refuses what ``run`` refuses with the same line."""
    if recipe.lora is None or not recipe.lora.init_from:
        return
    source = recipe.lora.init_from
    with fetch_adapter(source, "lora.init_from") as fetched:
        check_init_from(fetched.path, LoraConfig.from_section(recipe.lora), source, config=config,
                        model_dir=model_dir, revision=recipe.model.revision,
                        allow_other_base=recipe.lora.allow_other_base)

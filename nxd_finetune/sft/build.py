"""Building the pieces of a run from a recipe: tokenizer, model (+ LoRA), optimizer, schedule."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from nxd_finetune.errors import ModelLoadError, NxdError
from nxd_finetune.models import DecoderConfig, build_model, materialize, resolve_dtype
from nxd_finetune.sft.schedule import lr_factor


def resolve_model_dir(path: str) -> Path:
    """``builtin:tiny-llama`` -> the locally generated quickstart model; other paths unchanged."""
    from nxd_finetune.quickstart import resolve_model_path

    model_dir = Path(resolve_model_path(path))
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"model.path {path!r}: no config.json in {model_dir}")
    return model_dir


def load_tokenizer(recipe: Any, model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    source = recipe.model.tokenizer or str(model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=recipe.model.revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer from {source}: {str(e).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def lora_config_from_recipe(lora: Any) -> Any:
    from nxd_finetune.lora import LoraConfig

    return LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias=lora.bias,
        target_modules=lora.target_modules, use_rslora=lora.use_rslora,
        init_lora_weights=lora.init_lora_weights, modules_to_save=list(lora.modules_to_save),
    )


@dataclasses.dataclass
class BuiltModel:
    """``lineage``: the pinned registry REF ``lora.init_from`` pulled (for the registry manifest),
    None when the run started from fresh factors or from an adapter directory."""

    model: torch.nn.Module
    config: DecoderConfig
    lora_config: Any | None
    lora_targets: list[str]
    lineage: str | None = None


def build_training_model(recipe: Any, model_dir: Path, device: torch.device) -> BuiltModel:
    """Meta-device build -> weights in ``model.dtype`` -> LoRA (trainable params in fp32 unless
    ``training.precision`` is pure ``bf16``) -> the ``lora.init_from`` adapter's values, if set
    (:mod:`nxd_finetune.sft.init_from`). Full SFT when the recipe has no ``lora`` section."""
    config = DecoderConfig.from_hf(model_dir)
    precision = recipe.training.precision
    dtype = torch.bfloat16 if precision == "bf16" else resolve_dtype(recipe.model.dtype)
    model = build_model(config)
    materialize(model, model_dir, dtype=dtype, device=device)
    lora_cfg, targets, lineage = None, [], None
    if recipe.lora is not None:
        from nxd_finetune.lora import inject_lora

        lora_cfg = lora_config_from_recipe(recipe.lora)
        for p in model.parameters():
            p.requires_grad_(False)
        targets = inject_lora(model, lora_cfg)
        if precision != "bf16":
            from nxd_finetune.lora import cast_adapter_params

            cast_adapter_params(model, torch.float32)
        model.to(device)
        if recipe.lora.init_from:
            from nxd_finetune.sft.init_from import init_lora_from

            lineage = init_lora_from(model, lora_cfg, recipe.lora.init_from, config=config,
                                     revision=recipe.model.revision)
    elif dtype != torch.float32 and precision != "bf16":
        raise NxdError(
            f"full SFT with model.dtype={recipe.model.dtype} needs training.precision=bf16 "
            "(or model.dtype=fp32 with bf16-mixed for fp32 master weights)"
        )
    return BuiltModel(model, config, lora_cfg, targets, lineage)


def build_optimizer(model: torch.nn.Module, recipe: Any, total_steps: int) -> tuple[Any, Any]:
    """AdamW over trainable parameters (no decay on 1-D tensors) + warmup/decay LambdaLR."""
    t = recipe.training
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise NxdError("the model has no trainable parameters (check lora.target_modules / modules_to_save)")
    decay = [p for _, p in named if p.ndim >= 2]
    no_decay = [p for _, p in named if p.ndim < 2]
    groups = [g for g in ({"params": decay, "weight_decay": t.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total_steps, t.warmup_steps, t.scheduler, t.min_lr_ratio)
    )
    return opt, sched

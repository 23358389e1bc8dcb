"""``lora.init_from``: start a LoRA run from an existing adapter instead of fresh factors.

The source is a local adapter directory (ours or HF PEFT's), a registry REF or a plain ``s3://``
adapter prefix (:func:`nxd_finetune.registry.fetch.fetch_adapter`). The adapter must describe the
same LoRA as the recipe: rank, alpha, rsLoRA, DoRA, bias mode, ``modules_to_save``, the set of modules
``target_modules`` selects in this model (compared after matching, so ``all-linear`` and the explicit
list of the same layers agree) and the expert tensors ``target_parameters`` selects. Any difference
is one AdapterError line naming the recipe field and both values. A base model that differs from
the one the adapter records (:func:`nxd_finetune.lora.identity.check_base`: config keys, or the
same config with other weights) is one AdapterError line too, unless
``lora.allow_other_base: true``; an adapter that records no base fingerprint, or another revision,
is a warning.

:func:`check_init_from` is the whole check without loading anything; ``run`` (through
:func:`init_lora_from`) and ``validate`` both call it, so they refuse the same adapters with the
same line. Loading it (fetch, check, copy) is ``sft.init_from.init_lora_from``.
"""

from __future__ import annotations

import json
from pathlib import Path

from nxd_finetune.errors import AdapterError
from nxd_finetune.lora import LoraConfig, find_targets
from nxd_finetune.lora.experts import find_expert_targets
from nxd_finetune.lora.identity import check_base
from nxd_finetune.lora.io import CONFIG_NAME
from nxd_finetune.models import DecoderConfig, build_model


def check_same_lora(recipe_cfg: LoraConfig, adapter_cfg: LoraConfig, config: DecoderConfig, source: str) -> None:
    """Raise AdapterError naming the first ``lora.*`` field where the adapter differs from the recipe."""
    where = f"lora.init_from {source}"
    pairs = (
        ("lora.rank", recipe_cfg.r, adapter_cfg.r),
        ("lora.alpha", float(recipe_cfg.lora_alpha), float(adapter_cfg.lora_alpha)),
        ("lora.use_rslora", recipe_cfg.use_rslora, adapter_cfg.use_rslora),
        ("lora.use_dora", recipe_cfg.use_dora, adapter_cfg.use_dora),
        ("lora.bias", recipe_cfg.bias, adapter_cfg.bias),
        ("lora.modules_to_save", sorted(recipe_cfg.modules_to_save), sorted(adapter_cfg.modules_to_save)),
    )
    for field, ours, theirs in pairs:
        if ours != theirs:
            raise AdapterError(f"{where}: the recipe has {field}={ours!r} but the adapter has {theirs!r}")
    model = build_model(config)  # meta device: module names only
    try:
        theirs_targets = find_targets(model, adapter_cfg)
        theirs_experts = find_expert_targets(model, adapter_cfg)
    except AdapterError as e:
        raise AdapterError(f"{where}: the adapter does not fit this model: {e}") from None
    if find_targets(model, recipe_cfg) != theirs_targets:
        raise AdapterError(
            f"{where}: the recipe has lora.target_modules={recipe_cfg.target_modules!r} but the adapter has "
            f"{adapter_cfg.target_modules!r} (they select different modules)"
        )
    if find_expert_targets(model, recipe_cfg) != theirs_experts:
        raise AdapterError(f"{where}: the recipe has lora.target_parameters={recipe_cfg.target_parameters!r} but the "
                           f"adapter has {adapter_cfg.target_parameters!r} (they select different expert tensors)")


def check_init_from(adapter_dir: Path, recipe_cfg: LoraConfig, source: str, *, config: DecoderConfig,
                    model_dir: Path, revision: str | None = None, allow_other_base: bool = False,
                    warn: bool = True) -> None:
    """Check the fetched adapter in ``adapter_dir`` before anything is loaded: a LoRA adapter
    (``peft_type``), the same LoRA as the recipe (:func:`check_same_lora`) and the same base
    (:func:`~nxd_finetune.lora.identity.check_base`). One AdapterError line naming ``source``."""
    try:
        adapter_cfg = LoraConfig.from_peft_dict(json.loads((adapter_dir / CONFIG_NAME).read_text()))
    except (AdapterError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"lora.init_from {source}: {e}") from None
    check_same_lora(recipe_cfg, adapter_cfg, config, source)
    check_base(adapter_dir, config, model_dir, where=f"lora.init_from {source}", allow=allow_other_base,
               allow_hint="set lora.allow_other_base: true", revision=revision, warn=warn)

"""LoRA: config, layers, injection into a model, merging, PEFT-format adapter I/O and save modes."""

from nxd_finetune.lora.config import ALL_LINEAR, LoraConfig
from nxd_finetune.lora.inject import (
    base_param_name,
    cast_adapter_params,
    find_targets,
    inject_lora,
    lora_modules,
    merge_lora,
    saved_modules,
    trainable_parameters,
)
from nxd_finetune.lora.io import (
    SAVE_MODES,
    adapter_state_dict,
    load_adapter,
    lora_state_dict,
    read_adapter,
    save_adapter,
    save_model,
    save_tokenizer,
)
from nxd_finetune.lora.layers import LoraLinear, ModulesToSaveWrapper, lora_layer_for, register_lora_layer

__all__ = [
    "ALL_LINEAR",
    "SAVE_MODES",
    "LoraConfig",
    "LoraLinear",
    "ModulesToSaveWrapper",
    "adapter_state_dict",
    "base_param_name",
    "cast_adapter_params",
    "find_targets",
    "inject_lora",
    "load_adapter",
    "lora_layer_for",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "read_adapter",
    "register_lora_layer",
    "save_adapter",
    "save_model",
    "save_tokenizer",
    "saved_modules",
    "trainable_parameters",
]

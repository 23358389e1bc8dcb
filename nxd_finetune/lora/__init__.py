"""LoRA: config, layers, injection into a model, merging, PEFT-format adapter I/O and save modes.

Importing this package registers the tensor-parallel LoRA layers (:mod:`.sharded`).
"""

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
    adapter_state_dict,
    gather_adapter_state_dict,
    load_adapter,
    lora_state_dict,
    read_adapter,
    save_adapter,
    save_tokenizer,
    write_adapter_files,
)
from nxd_finetune.lora.layers import LoraLinear, ModulesToSaveWrapper, lora_layer_for, register_lora_layer
from nxd_finetune.lora.sharded import ColumnParallelLoraLinear, RowParallelLoraLinear

__all__ = [
    "ALL_LINEAR",
    "ColumnParallelLoraLinear",
    "LoraConfig",
    "LoraLinear",
    "ModulesToSaveWrapper",
    "RowParallelLoraLinear",
    "adapter_state_dict",
    "base_param_name",
    "cast_adapter_params",
    "find_targets",
    "gather_adapter_state_dict",
    "inject_lora",
    "load_adapter",
    "lora_layer_for",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "read_adapter",
    "register_lora_layer",
    "save_adapter",
    "write_adapter_files",
    "save_tokenizer",
    "saved_modules",
    "trainable_parameters",
]

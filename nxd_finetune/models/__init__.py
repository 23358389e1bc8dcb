"""Plain PyTorch Llama-family decoders with HuggingFace module names, and HF checkpoint I/O."""

from nxd_finetune.models.config import DecoderConfig
from nxd_finetune.models.families import FAMILIES, Family
from nxd_finetune.models.llama import DecoderForCausalLM
from nxd_finetune.models.loading import (
    build_model,
    check_checkpoint_files,
    checkpoint_index,
    checkpoint_key,
    copy_generation_config,
    load_pretrained,
    materialize,
    resolve_dtype,
    save_pretrained,
)

__all__ = [
    "FAMILIES",
    "Family",
    "DecoderConfig",
    "DecoderForCausalLM",
    "copy_generation_config",
    "build_model",
    "check_checkpoint_files",
    "checkpoint_index",
    "checkpoint_key",
    "load_pretrained",
    "materialize",
    "resolve_dtype",
    "save_pretrained",
]

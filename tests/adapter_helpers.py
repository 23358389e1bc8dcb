"""A small LoRA adapter of the quickstart model, made in a second without training (for tests that
need any valid adapter: bad-input variants, console checks). Needs the ``quickstart_cache``
fixture (the model is built into ``NXD_FINETUNE_CACHE``)."""

from __future__ import annotations

from pathlib import Path

from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.lora import LoraConfig, inject_lora, save_adapter
from nxd_finetune.models import load_pretrained


def small_adapter(out: Path) -> Path:
    """A rank-4 LoRA on q/v of ``builtin:tiny-llama`` (zero B: the base's own outputs), saved to
    ``out`` as ``run`` exports one (PEFT layout, base identity recorded); returns ``out``."""
    base = resolve_model_dir("builtin:tiny-llama")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = load_pretrained(base)
    inject_lora(model, cfg)
    save_adapter(model, cfg, out, base_model_name_or_path="builtin:tiny-llama", base_dir=base)
    return out

"""A run's inputs from a recipe: the model directory and the tokenizer (the model and optimizer are
assembled by :func:`nxd_finetune.sft.engine.build_engine`; the LoRA config is
:meth:`nxd_finetune.lora.LoraConfig.from_section`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.quickstart import resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.recipe import Recipe


def resolve_model_dir(path: str) -> Path:
    """``builtin:tiny-llama`` -> the locally generated quickstart model; other paths unchanged."""
    model_dir = Path(resolve_model_path(path))
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"model.path {path!r}: no config.json in {model_dir}")
    return model_dir


def load_tokenizer(recipe: Recipe, model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    source = recipe.model.tokenizer or str(model_dir)
    try:
        tok = AutoTokenizer.from_pretrained(source, revision=recipe.model.revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer from {source}: {str(e).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok

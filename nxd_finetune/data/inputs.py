"""A run's inputs from a recipe: the model directory and the tokenizer (the model and optimizer are
assembled by :func:`nxd_finetune.sft.engine.build_engine`; the LoRA config is
:meth:`nxd_finetune.lora.LoraConfig.from_section`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.quickstart import resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

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
        tok = AutoTokenizer.from_pretrained(source, revision=recipe.model.revision, config=_light_config(source))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer from {source}: {str(e).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _light_config(source: str) -> PreTrainedConfig | None:
    """A local directory's ``config.json`` as a plain ``PreTrainedConfig`` with its ``model_type``
    and path, what ``AutoTokenizer`` reads of a config to pick the tokenizer class: loading it by
    itself, ``AutoConfig`` imports the family's config module, which pulls transformers' DTensor
    and accelerate integrations (~60 MB resident a run never uses). None (``AutoTokenizer`` loads
    the config) for a Hub name or a directory without a readable ``config.json``."""
    from transformers import PreTrainedConfig

    path = Path(source) / "config.json"
    try:
        fields = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        return None
    try:
        config = PreTrainedConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    except (TypeError, ValueError):
        return None
    config.model_type = fields["model_type"]  # type: ignore[misc]  # the instance's, as AutoConfig's class gives
    config._name_or_path = source
    return config

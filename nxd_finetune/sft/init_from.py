"""``lora.init_from`` at run time: fetch the adapter, check it (:mod:`nxd_finetune.lora.init_from`,
the check ``validate`` makes too) and load its factors into the injected model."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from nxd_finetune.errors import AdapterError
from nxd_finetune.lora import LoraConfig, load_adapter
from nxd_finetune.lora.init_from import check_init_from
from nxd_finetune.models import DecoderConfig
from nxd_finetune.registry.fetch import fetch_adapter


def init_lora_from(
    model: nn.Module, recipe_cfg: LoraConfig, source: str, *, config: DecoderConfig, model_dir: Path,
    revision: str | None = None, allow_other_base: bool = False, warn: bool = True,
) -> str | None:
    """Load the adapter ``source`` names into ``model`` (already injected with ``recipe_cfg``).

    Checks the adapter (:func:`check_init_from`; ``model_dir``: the base checkpoint, whose
    fingerprint is compared; ``warn``: print its warnings, e.g. on rank 0 only) and, through
    ``load_adapter``, every tensor's name and shape before anything is copied; values are cast to
    the parameters' dtype (fp32 master weights stay fp32). Returns the lineage: the pinned
    registry REF the adapter was pulled from, or None for a directory. Raises AdapterError /
    RegistryError with one line.
    """
    with fetch_adapter(source, "lora.init_from") as fetched:
        check_init_from(fetched.path, recipe_cfg, source, config=config, model_dir=model_dir, revision=revision,
                        allow_other_base=allow_other_base, warn=warn)
        try:
            load_adapter(model, fetched.path, inject=False)
        except AdapterError as e:
            raise AdapterError(f"lora.init_from {source}: {e}") from None
        return fetched.lineage

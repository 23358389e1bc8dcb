"""``lora.init_from`` at run time: fetch the adapter, check it (:mod:`nxd_finetune.lora.init_from`,
the check ``validate`` makes too) and load its factors into the injected model; and what the run
started from, resolved (:class:`StartAdapter`: the registry version pulled and the weights' digest),
which keys the DPO reference log-probs measured against it."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from torch import nn

from nxd_finetune.errors import AdapterError
from nxd_finetune.lora import LoraConfig, load_adapter
from nxd_finetune.lora.init_from import check_init_from
from nxd_finetune.models import DecoderConfig
from nxd_finetune.registry.fetch import FetchedAdapter, fetch_adapter

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class StartAdapter:
    """The adapter ``lora.init_from`` resolved to: ``source``, the registry version pulled
    (``REG/name:3``, also ``lineage``) or, for a directory, the path as the recipe names it;
    ``sha256``: the digest of its weights file's bytes."""

    source: str
    lineage: str | None
    sha256: str

    @classmethod
    def of(cls, fetched: FetchedAdapter) -> StartAdapter:
        weights = fetched.path / ADAPTER_WEIGHTS
        try:
            digest = hashlib.sha256(weights.read_bytes()).hexdigest()
        except OSError as e:
            raise AdapterError(f"lora.init_from {fetched.source}: cannot read {weights} ({e.strerror})") from None
        return cls(fetched.lineage or fetched.source, fetched.lineage, digest)


def resolve_start(source: str) -> StartAdapter:
    """What ``source`` (a ``lora.init_from``) resolves to now, without loading it: a registry REF
    is pulled (checked against its manifest) to pin its version and digest its weights."""
    with fetch_adapter(source, "lora.init_from") as fetched:
        return StartAdapter.of(fetched)


def init_lora_from(
    model: nn.Module, recipe_cfg: LoraConfig, source: str, *, config: DecoderConfig, model_dir: Path,
    revision: str | None = None, allow_other_base: bool = False, warn: bool = True,
) -> StartAdapter:
    """Load the adapter ``source`` names into ``model`` (already injected with ``recipe_cfg``).

    Checks the adapter (:func:`check_init_from`; ``model_dir``: the base checkpoint, whose
    fingerprint is compared; ``warn``: print its warnings, e.g. on rank 0 only) and, through
    ``load_adapter``, every tensor's name and shape before anything is copied; values are cast to
    the parameters' dtype (fp32 master weights stay fp32). Returns what was loaded: its resolved
    source, lineage (the pinned registry REF it was pulled from, or None for a directory) and
    digest. Raises AdapterError / RegistryError with one line.
    """
    with fetch_adapter(source, "lora.init_from") as fetched:
        check_init_from(fetched.path, recipe_cfg, source, config=config, model_dir=model_dir, revision=revision,
                        allow_other_base=allow_other_base, warn=warn)
        start = StartAdapter.of(fetched)
        try:
            load_adapter(model, fetched.path, inject=False)
        except AdapterError as e:
            raise AdapterError(f"lora.init_from {source}: {e}") from None
        return start

"""Precision under Lightning: the run's three precisions through Lightning's precision plugin.

:class:`NxdPrecision` is a ``lightning.pytorch.plugins.precision.Precision``. ``Trainer(precision=...)``
works unchanged: :class:`~nxd_finetune.lightning.strategy.NxdStrategy` turns the plugin Lightning
builds for ``"32-true"``, ``"bf16-mixed"`` or ``"bf16-true"`` into this one (``16`` precisions are an
NxdError: the trainer has no loss scaling). What each means is the trainer's ``training.precision``:

- ``fp32``: no autocast;
- ``bf16-mixed``: the weights as ``model.dtype`` says (fp32 master weights with ``model.dtype=fp32``),
  forward under bf16 autocast;
- ``bf16``: every weight in bf16 (the engine loads them so; :meth:`convert_module` casts nothing),
  LoRA factors in bf16 too, forward under bf16 autocast.

The module reads :attr:`NxdPrecision.nxd_precision` when it builds the engine, so the weights are
loaded in the right dtype from the start instead of being cast afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from nxd_finetune.errors import NxdError

NxdPrecisionName = Literal["fp32", "bf16-mixed", "bf16"]
# Lightning's precision flag -> the trainer's training.precision
LIGHTNING_TO_NXD: dict[str, NxdPrecisionName] = {
    "32-true": "fp32", "32": "fp32", "fp32": "fp32",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16", "bf16": "bf16",
}


class NxdPrecision(Precision):
    """Lightning precision plugin for the trainer's ``fp32`` / ``bf16-mixed`` / ``bf16``.

    ``precision``: one of those names or Lightning's ``"32-true"`` / ``"bf16-mixed"`` /
    ``"bf16-true"``. ``device_type``: where autocast runs (the strategy sets it from its root
    device). NxdError for anything else (fp16 and fp64 are not supported)."""

    def __init__(self, precision: str = "fp32", device_type: str = "cpu") -> None:
        super().__init__()
        name = LIGHTNING_TO_NXD.get(str(precision))
        if name is None:
            raise NxdError(f"precision {precision!r} is not supported by nxd-finetune: use fp32 (32-true), "
                           "bf16-mixed or bf16 (bf16-true)")
        self.nxd_precision: NxdPrecisionName = name
        self.precision = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "bf16": "bf16-true"}[name]  # type: ignore[assignment]
        self.device_type = device_type

    @classmethod
    def from_lightning(cls, plugin: Precision, device_type: str) -> NxdPrecision:
        """The plugin Lightning built from ``Trainer(precision=...)`` as an :class:`NxdPrecision`."""
        if isinstance(plugin, cls):
            plugin.device_type = device_type
            return plugin
        known = type(plugin).__name__ in ("Precision", "MixedPrecision", "HalfPrecision")
        if not known:
            raise NxdError(f"NxdStrategy takes Trainer(precision='32-true' | 'bf16-mixed' | 'bf16-true') or "
                           f"NxdPrecision, not the {type(plugin).__name__} plugin")
        return cls(str(plugin.precision), device_type)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Nothing to cast: the engine loads the weights in the precision's dtype."""
        return module

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """bf16 autocast for ``bf16-mixed`` and ``bf16`` (as the trainer's engine), else nothing."""
        if self.nxd_precision == "fp32":
            yield
            return
        with torch.autocast(device_type=self.device_type, dtype=torch.bfloat16):
            yield

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

"""The Neuron precision presets: the environment each precision mode sets and which recipes it fits.

Data and one check, read by the recipe's validation (``neuron.precision``) and by
:func:`nxd_finetune.neuron.neuron_env`. Ground floor: imports nothing from the package but its errors.

- :data:`PRESETS`: name -> :class:`PrecisionPreset` (``XLA_USE_BF16``, ``XLA_DOWNCAST_BF16``,
  ``NEURON_RT_STOCHASTIC_ROUNDING_EN`` and compiler flags).
- :data:`PRESET_PRECISIONS` and :func:`resolve_preset`: which ``training.precision`` each fits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from nxd_finetune.errors import NxdError

SR_VAR = "NEURON_RT_STOCHASTIC_ROUNDING_EN"


@dataclasses.dataclass(frozen=True)
class PrecisionPreset:
    """Environment of one precision mode on Neuron. ``cc_flags`` go into ``NEURON_CC_FLAGS``
    unless the user's flags already set the same option."""

    name: str
    env: Mapping[str, str]
    cc_flags: tuple[str, ...] = ()
    summary: str = ""


PRESETS: dict[str, PrecisionPreset] = {
    p.name: p
    for p in (
        PrecisionPreset(
            "fp32", {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", SR_VAR: "0"}, ("--auto-cast=none",),
            "fp32 everywhere; the compiler's own fp32->bf16 matmul cast is turned off"),
        PrecisionPreset(
            "bf16-sr", {"XLA_USE_BF16": "1", "XLA_DOWNCAST_BF16": "0", SR_VAR: "1"}, (),
            "every float tensor on the device is bf16 (weights, grads, optimizer states); stochastic "
            "rounding keeps small updates from vanishing"),
        PrecisionPreset(
            "bf16-master", {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", SR_VAR: "0"}, ("--auto-cast=none",),
            "bf16 weights and compute (training.precision=bf16), fp32 master weights and optimizer "
            "states sharded by ZeRO-1 (parallel.zero1=true)"),
        PrecisionPreset(
            "autocast", {"XLA_USE_BF16": "0", "XLA_DOWNCAST_BF16": "0", SR_VAR: "0"}, ("--auto-cast=none",),
            "fp32 weights, torch.autocast bf16 forward (training.precision=bf16-mixed); the compiler "
            "casts nothing more"),
    )
}

# preset -> the training.precision values it works with
PRESET_PRECISIONS: dict[str, tuple[str, ...]] = {
    "fp32": ("fp32",), "bf16-sr": ("fp32", "bf16"), "bf16-master": ("bf16",), "autocast": ("bf16-mixed",),
}


def resolve_preset(precision: str, zero1: bool, preset: str = "auto") -> str:
    """The preset name for ``neuron.precision`` (``auto``: fp32 -> fp32, bf16 -> bf16-master with
    ZeRO-1 else bf16-sr, bf16-mixed -> autocast). Raises NxdError for a preset that does not fit
    ``training.precision`` / ``parallel.zero1``."""
    if preset == "auto":
        return {"fp32": "fp32", "bf16": "bf16-master" if zero1 else "bf16-sr", "bf16-mixed": "autocast"}[precision]
    if preset not in PRESETS:
        raise NxdError(f"unknown neuron.precision {preset!r}; use auto, {', '.join(PRESETS)}")
    allowed = PRESET_PRECISIONS[preset]
    if precision not in allowed:
        raise NxdError(f"neuron.precision={preset} needs training.precision={' or '.join(allowed)} "
                       f"(got {precision})")
    if preset == "bf16-master" and not zero1:
        raise NxdError("neuron.precision=bf16-master keeps fp32 master weights in ZeRO-1; set parallel.zero1=true")
    return preset

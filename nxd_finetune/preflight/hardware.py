"""Whether the machine suits the recipe (``run`` and ``validate``): :func:`check_device` says in one
line what ``training.device`` lacks for the recipe (:func:`nxd_finetune.device.device_gaps`), and a
run on a CPU that has no native 16-bit matrix instructions is warned about before it starts.

On such a CPU (x86 without AVX512-BF16 / AMX, e.g. AVX2-only EPYC and Xeon parts) torch's bf16 and
fp16 matmuls take a slow fallback path: a 512 x 2048 x 8192 bf16 matmul measured 0.27 GFLOP/s on a
2-core AVX2 EPYC against 106 GFLOP/s in fp32 (``bench/results/cpu_bf16.md``), so a bf16 step of a
1B model that should take seconds takes many minutes. fp32 is then both faster and more exact.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from nxd_finetune.device import device_for, device_gaps, known_device, require_torch_xla
from nxd_finetune.errors import NxdError, NxdWarning
from nxd_finetune.models.llama import compile_backend
from nxd_finetune.parallel.launch import resolve_device_name

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe


def check_device(recipe: Recipe, *, required: bool) -> None:
    """NxdError (one line) for the first thing ``training.device`` lacks for ``recipe``: a
    process-group backend for ``parallel.nproc > 1``, autocast for ``bf16-mixed``, the
    ``model.compile`` backend (:func:`nxd_finetune.device.device_gaps`). ``required`` (``run``): the
    device must be here (NxdError otherwise, as :func:`nxd_finetune.device.device_for` says);
    else (``validate``) a device torch does not have on this machine is one warning line and its
    checks are left to the machine that has it."""
    name = resolve_device_name(recipe.training.device)
    if required:
        require_torch_xla() if name == "xla" else device_for(name)
    elif not known_device(name):
        warnings.warn(f"training.device={name}: torch has no {name} device on this machine; what the device "
                      "offers is checked where it runs", NxdWarning, stacklevel=2)
        return
    gaps = device_gaps(name, processes=recipe.parallel.nproc, precision=recipe.training.precision,
                       compile_backend=compile_backend(recipe.model.compile))
    if gaps:
        raise NxdError(gaps[0])


def compute_dtypes(recipe: Recipe) -> set[str]:
    """The 16-bit formats the recipe's matmuls run in: ``bf16`` under ``training.precision`` bf16 /
    bf16-mixed, and the checkpoint's own 16-bit ``model.dtype`` (frozen weights stay in it)."""
    found = set()
    if recipe.training.precision in ("bf16", "bf16-mixed"):
        found.add("bf16")
    if recipe.model.dtype in ("bf16", "fp16"):
        found.add(recipe.model.dtype)
    return found


def cpu_supports(dtype: str) -> bool:
    """Whether this CPU runs ``dtype`` ("bf16" / "fp16") matmuls natively (oneDNN's own check)."""
    if dtype == "bf16":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def check_cpu_formats(recipe: Recipe) -> list[str]:
    """Warn (one :class:`NxdWarning` line) when the recipe trains on the CPU in a 16-bit format
    this CPU has no instructions for; returns the formats warned about."""
    if resolve_device_name(recipe.training.device) != "cpu":
        return []
    slow = sorted(d for d in compute_dtypes(recipe) if not cpu_supports(d))
    if slow:
        names = " and ".join(slow)
        warnings.warn(
            f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native {names} matrix instructions: "
            f"{names} matmuls take a fallback path that can be 100x slower than fp32; for a CPU run here set "
            "training.precision=fp32 model.dtype=fp32", NxdWarning, stacklevel=2)
    return slow

"""Neuron (Trainium) specifics: run-time detection and the environment a recipe asks for.

Light to import (no torch). Nothing here is required: ``torch_neuronx`` is only tried at run time;
the packages of that name on the public index are placeholders that raise ImportError, and count
as absent. The precision presets are in :mod:`nxd_finetune.neuron_presets`, which the recipe's
validation reads too.

- :func:`neuron_available` / :func:`torch_xla_available`: whether the package imports.
- :func:`neuron_env`: a pure function of the recipe -> ``NEURON_CC_FLAGS`` (``--model-type``,
  ``--cache_dir`` from ``neuron.compile_cache``, the preset's and the recipe's extra flags),
  ``XLA_USE_BF16``, ``XLA_DOWNCAST_BF16``, ``NEURON_RT_STOCHASTIC_ROUNDING_EN``.
- :func:`apply_neuron_env`: sets them in the environment, only on a Neuron machine for an xla run;
  torch_xla reads them once, so this runs before the first XLA tensor exists.
- :func:`precompile_command`: the ``neuron_parallel_compile`` command line of ``nxd-finetune precompile``.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import sys
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING

from nxd_finetune.errors import NxdError
from nxd_finetune.neuron_presets import PRESETS, SR_VAR, resolve_preset

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe

CC_FLAGS_VAR = "NEURON_CC_FLAGS"
PARALLEL_COMPILE = "neuron_parallel_compile"


# ---------------------------------------------------------------- detection


@functools.cache
def _importable(name: str) -> bool:
    try:
        __import__(name)
    except Exception:  # ImportError, and the placeholders' own errors
        return False
    return True


def torch_xla_available() -> bool:
    """Whether ``torch_xla`` imports (it loads only with the torch version it was built for)."""
    return _importable("torch_xla")


def neuron_available() -> bool:
    """Whether ``torch_neuronx`` imports, i.e. this is a Neuron (Trainium/Inferentia) machine."""
    return _importable("torch_neuronx")


# ---------------------------------------------------------------- Neuron environment


def _drop_flag(flags: list[str], name: str) -> list[str]:
    """``flags`` without ``name``, ``name=...`` and the value following a bare ``name``."""
    out, skip = [], False
    for tok in flags:
        if skip:
            skip = False
            continue
        if tok == name:
            skip = True
            continue
        if tok.startswith(name + "="):
            continue
        out.append(tok)
    return out


def _has_flag(flags: Iterable[str], name: str) -> bool:
    return any(t == name or t.startswith(name + "=") for t in flags)


def neuron_env(recipe: Recipe, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Neuron variables for ``recipe`` (a pure function: reads ``environ``, changes nothing).

    ``NEURON_CC_FLAGS``: the flags already in ``environ`` are kept, except ``--model-type`` and
    ``--cache_dir`` when the recipe sets them (the recipe wins); then ``--model-type
    <neuron.model_type>``, ``--cache_dir=<absolute neuron.compile_cache>``, the preset's flags
    (``--auto-cast=none`` unless some ``--auto-cast`` is already given) and ``neuron.cc_flags``.
    The preset's ``XLA_USE_BF16``, ``XLA_DOWNCAST_BF16`` and ``NEURON_RT_STOCHASTIC_ROUNDING_EN``
    (``neuron.stochastic_rounding`` overrides the last). Raises NxdError for a preset that does not
    fit the recipe (the recipe's own validation already refuses those).
    """
    environ = os.environ if environ is None else environ
    ncfg = recipe.neuron
    preset = PRESETS[resolve_preset(recipe.training.precision, recipe.parallel.zero1, ncfg.precision)]
    env = dict(preset.env)
    if ncfg.stochastic_rounding is not None:
        env[SR_VAR] = "1" if ncfg.stochastic_rounding else "0"
    flags = shlex.split(environ.get(CC_FLAGS_VAR, ""))
    extra: list[str] = []
    if ncfg.model_type:
        flags = _drop_flag(flags, "--model-type")
        extra += ["--model-type", ncfg.model_type]
    if ncfg.compile_cache:
        flags = _drop_flag(flags, "--cache_dir")
        extra.append(f"--cache_dir={os.path.abspath(os.path.expanduser(ncfg.compile_cache))}")
    extra += ncfg.cc_flags
    for flag in preset.cc_flags:
        name = flag.split("=", 1)[0]
        if not _has_flag(flags + extra, name):
            extra.append(flag)
    env[CC_FLAGS_VAR] = shlex.join(flags + extra)
    return env


def xla_requested(device: str) -> bool:
    """Whether ``training.device`` means xla on this machine (``auto`` does where Neuron imports)."""
    return device == "xla" or (device == "auto" and neuron_available())


def apply_neuron_env(recipe: Recipe, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set :func:`neuron_env` in ``environ`` (default ``os.environ``) when the run is on xla and
    ``torch_neuronx`` imports; returns what was set ({} otherwise). Call before any XLA tensor
    exists: torch_xla reads these variables once."""
    if not (xla_requested(recipe.training.device) and neuron_available()):
        return {}
    environ = os.environ if environ is None else environ
    env = neuron_env(recipe, environ)
    environ.update(env)
    return env


# ---------------------------------------------------------------- precompile


def require_parallel_compile() -> str:
    """The path of ``neuron_parallel_compile``; NxdError (one line) when Neuron is not installed."""
    if not neuron_available():
        raise NxdError("precompile needs the Neuron SDK (torch_neuronx and neuron_parallel_compile), which is not "
                       "installed here; run it on a Trainium instance (Neuron DLAMI or container)")
    tool = shutil.which(PARALLEL_COMPILE)
    if tool is None:
        raise NxdError(f"precompile: torch_neuronx imports but {PARALLEL_COMPILE} is not on PATH; "
                       "activate the Neuron environment")
    return tool


def precompile_command(tool: str, recipe_path: str, overrides: Sequence[str], recipe: Recipe, steps: int,
                       out_dir: str, python: str = sys.executable) -> list[str]:
    """``neuron_parallel_compile <python> -m nxd_finetune run RECIPE <overrides> <ours>``.

    ``neuron_parallel_compile`` runs the command once to record the graphs (without executing
    them), then compiles them in parallel into the cache. Our overrides come last so they win:
    xla device, ``steps`` optimizer steps (warmup clipped to fit), no periodic checkpoints, no
    resume, no registry push, outputs in ``out_dir``. NxdError (one line) for a recipe on another
    device (TorchNeuron's ``neuron`` compiles at run time: nothing to precompile). The graphs do
    not depend on the step count or the learning rate, so the cache serves the full run with the
    same recipe.
    """
    ours = precompile_overrides(recipe, steps, out_dir)
    return [tool, python, "-m", "nxd_finetune", "run", os.path.abspath(recipe_path), *overrides, *ours]


def native_device(recipe: Recipe) -> bool:
    """Whether ``recipe`` names an accelerator that is not torch-xla's (``training.device`` neuron
    -- TorchNeuron --, cuda, another registered backend): the torch-xla environment, its compile
    cache and precompile do not apply. xla, auto and cpu recipes keep them (the Neuron jobs run a
    cpu recipe, a trial's, on xla as before)."""
    return recipe.training.device not in ("xla", "auto", "cpu")


def require_xla_recipe(recipe: Recipe) -> None:
    """NxdError (one line) for a recipe on a :func:`native_device`: precompile fills torch-xla's
    compile cache; TorchNeuron compiles as it runs."""
    if native_device(recipe):
        raise NxdError(f"precompile fills torch-xla's Neuron compile cache (training.device=xla); a recipe on "
                       f"training.device={recipe.training.device} compiles as it runs (TorchNeuron: eager, or "
                       "model.compile=neuron), so there is nothing to precompile")


def precompile_overrides(recipe: Recipe, steps: int, out_dir: str) -> list[str]:
    """The overrides that make a ``run`` a precompile run (:func:`precompile_command`): they change
    neither the layout nor the batch (the per-rank shapes and micro-batches per step stay). NxdError
    for a recipe on a :func:`native_device`."""
    require_xla_recipe(recipe)
    return [
        "training.device=xla", f"training.max_steps={steps}", "training.epochs=null",
        f"training.warmup_steps={min(recipe.training.warmup_steps, steps)}",
        "checkpoint.every_n_steps=null", "checkpoint.resume=null", "output.registry=null",
        f"output.dir={out_dir}", "logging.progress=false",
    ]

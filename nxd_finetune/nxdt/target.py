"""``nxd-finetune import nxdt-config --target``: which Trainium stack the imported recipe is for.

- ``xla`` (the default): torch-xla, the stack of NxD Training itself (Neuron SDK <= 2.28, Trn1 /
  Trn2): the recipe's ``neuron:`` section carries the compiler flags, compile cache and precision
  preset that torch-xla's environment needs (docs/trainium.md).
- ``trn2`` / ``trn3``: TorchNeuron (Neuron SDK 2.33+, beta; Trn2 and Trn3 only), PyTorch's native
  ``neuron`` device: ``training.device: neuron``; the ``neuron:`` section, torch-xla's environment,
  is left out and the NxDT keys that went there are reported as not carried over.
"""

from __future__ import annotations

import copy
from typing import Literal

from nxd_finetune.nxdt.config import Translation
from nxd_finetune.recipe import recipe_from_dict

Target = Literal["xla", "trn2", "trn3"]
TARGETS: tuple[str, ...] = ("xla", "trn2", "trn3")
XLA_ONLY = ("torch-xla's Neuron environment (the recipe's neuron: section), which the TorchNeuron path "
            "(training.device=neuron) does not read")


def for_target(translation: Translation, target: Target) -> Translation:
    """``translation`` for ``target`` (see the module docstring); validated like the xla recipe."""
    if target == "xla":
        return translation
    recipe = copy.deepcopy(translation.recipe)
    recipe.setdefault("training", {})["device"] = "neuron"
    recipe.pop("neuron", None)
    to_xla = [(key, to) for key, to in translation.mapped if to.split("=", 1)[0].startswith("neuron.")]
    mapped = [entry for entry in translation.mapped if entry not in to_xla]
    dropped = [*translation.dropped, *((key, XLA_ONLY) for key, _ in to_xla)]
    recipe_from_dict(copy.deepcopy(recipe), source=f"the recipe translated from {translation.source} for {target}")
    return Translation(recipe=recipe, mapped=mapped, dropped=dropped, source=translation.source)

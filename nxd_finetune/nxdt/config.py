"""NxDT YAML config -> recipe: ``nxd-finetune import nxdt-config``.

The config is read with OmegaConf, the library NxDT reads it with, and resolved as NxDT resolves it
(``OmegaConf.to_container(cfg, resolve=True)``): absolute (``${trainer.max_steps}``) and relative
(``${.encoder_seq_length}``) interpolations, ``${oc.env:VAR}``, and NeMo's ``multiply`` resolver
that NxDT's shipped configs use (``${multiply:${a}, ${b}}``). The resolved tree is flattened to
dotted keys and translated by :mod:`nxd_finetune.nxdt.keys`; the recipe is validated with the
recipe loader itself before it is written, so the written file passes ``validate``'s recipe checks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nxd_finetune.errors import RecipeError
from nxd_finetune.nxdt.keys import KeyWalk, translate
from nxd_finetune.recipe import RecipeDict, recipe_from_dict
from nxd_finetune.recipe.messages import one_line
from nxd_finetune.recipe.yaml_loader import YamlValue

_SECTION_ORDER = ("model", "data", "objective", "preference", "lora", "parallel", "training", "eval", "checkpoint",
                  "output", "logging", "neuron")


def _multiply(a: int | float, b: int | float) -> int | float:
    """NeMo's ``multiply`` resolver (registered by NeMo's training scripts, which NxDT builds on).
    Integers stay integers (OmegaConf warns where a value does not match these hints)."""
    return a * b


def resolve_config(path: str | Path) -> dict[str, YamlValue]:
    """The NxDT config at ``path`` as a plain dict, every interpolation resolved by OmegaConf.
    Raises RecipeError (one line) for a missing file, invalid YAML or an interpolation that does
    not resolve."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"NxDT config not found: {file}")
    if not OmegaConf.has_resolver("multiply"):
        OmegaConf.register_resolver("multiply", _multiply)
    try:
        cfg = OmegaConf.load(file)
        data = OmegaConf.to_container(cfg, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
        raise RecipeError(f"{file}: {one_line(str(e))}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{file}: the top level must be a mapping of sections")
    return {str(k): v for k, v in data.items()}


def flatten(tree: dict[str, YamlValue], prefix: str = "") -> dict[str, YamlValue]:
    """Dotted key -> leaf value; lists are leaves, an empty mapping is a leaf (None)."""
    out: dict[str, YamlValue] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = None if isinstance(value, dict) else value
    return out


@dataclasses.dataclass
class Translation:
    """The recipe (a plain dict, validated) and the report: ``mapped`` (NxDT key, recipe key or
    note) and ``dropped`` (NxDT key, why it is not carried over), one entry per key of the input."""

    recipe: RecipeDict
    mapped: list[tuple[str, str]]
    dropped: list[tuple[str, str]]
    source: Path

    def report_lines(self) -> list[str]:
        lines = [f"mapped: {key} -> {to}" for key, to in self.mapped]
        lines += [f"not carried over: {key}: {why}" for key, why in self.dropped]
        return lines

    def to_yaml(self) -> str:
        """The recipe as YAML, headed by comments naming the source and every key not carried over."""
        head = [f"# recipe imported from the NxD Training config {self.source}",
                "# by `nxd-finetune import nxdt-config`"]
        if self.dropped:
            head.append("# not carried over:")
            head += [f"#   {key}: {why}" for key, why in self.dropped]
        ordered = {k: self.recipe[k] for k in _SECTION_ORDER if k in self.recipe}
        body = yaml.safe_dump(ordered, sort_keys=False, default_flow_style=False)
        return "\n".join(head) + "\n" + body


def translate_config(path: str | Path, model_path: str | None = None, cwd: Path | None = None) -> Translation:
    """Translate the NxDT config at ``path`` into a validated recipe.

    ``model_path``: the HF checkpoint to train (default: the directory of ``model.model_config``,
    where NxDT's HF ``config.json`` lives). Relative NxDT paths are made absolute against ``cwd``
    (default: the current directory), where NxDT would have read them. Raises RecipeError.
    """
    file = Path(path)
    walk = KeyWalk(flat=flatten(resolve_config(file)), base=(cwd or Path.cwd()).resolve())
    translate(walk, model_path)
    recipe_from_dict(_plain(walk.recipe), source=f"the recipe translated from {file}")
    return Translation(recipe=walk.recipe, mapped=walk.mapped, dropped=walk.dropped, source=file)


def _plain(tree: RecipeDict) -> RecipeDict:
    """A deep copy (validation may not touch the dict that is written)."""
    return {k: _plain(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v for k, v in tree.items()}

"""NxDT YAML config -> recipe: ``nxd-finetune import nxdt-config``.

The config is read with OmegaConf, the library NxDT reads it with, and resolved as NxDT resolves it
(``OmegaConf.to_container(cfg, resolve=True)``): absolute (``${trainer.max_steps}``) and relative
(``${.encoder_seq_length}``) interpolations and NeMo's ``multiply`` resolver that NxDT's shipped
configs use (``${multiply:${a}, ${b}}``, of numbers). ``${oc.env:VAR}`` is refused: an environment
value (a key, a token) would be copied into the recipe and the report. A resolved string longer than
any path (4096 characters) is refused too. The resolved tree is flattened to dotted keys and
translated by :mod:`nxd_finetune.nxdt.keys`; the recipe is validated with the recipe loader itself
before it is written, so the written file passes ``validate``'s recipe checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.resolvers import oc

from nxd_finetune.errors import RecipeError
from nxd_finetune.nxdt.keys import KeyWalk, translate
from nxd_finetune.recipe import RecipeDict, recipe_from_dict
from nxd_finetune.recipe.messages import one_line
from nxd_finetune.recipe.yaml_loader import YamlValue

_SECTION_ORDER = ("model", "data", "objective", "preference", "lora", "parallel", "training", "eval", "checkpoint",
                  "output", "logging", "neuron")


_LONGEST = 4096  # characters of a resolved string: PATH_MAX; NxDT's values are names, paths and flags
_ENV = re.compile(r"\$\{\s*(?:oc\.)?env\s*:\s*([^,}]*)")


def _multiply(a: int | float, b: int | float) -> int | float:
    """NeMo's ``multiply`` resolver (registered by NeMo's training scripts, which NxDT builds on).
    Integers stay integers (OmegaConf warns where a value does not match these hints); anything
    but numbers, or a product out of range, is refused (``'ab' * 10**9`` would be a string of 2 GB)."""
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b)):
        raise ValueError(f"multiply takes two numbers, not {type(a).__name__} and {type(b).__name__}")
    product = a * b
    if not math.isfinite(product) or abs(product) >= 2**63:
        raise ValueError("multiply: the product is out of range")
    return product


def _env_refused_line(variable: str) -> str:
    return (f"${{oc.env:{variable}}} reads an environment variable, which is not imported (its value may be a "
            "secret): write the value into the config")


def _refuse_env(key: str, default: str | None = None) -> str:
    """``oc.env`` while an NxDT config resolves: refused, the variable named, its value never read."""
    raise ValueError(_env_refused_line(key))


@contextlib.contextmanager
def _no_env() -> Iterator[None]:
    """``oc.env`` refused while the block runs (however an interpolation reaches it), then OmegaConf's again."""
    OmegaConf.register_resolver("oc.env", _refuse_env, replace=True, annotation_validation="off")
    try:
        yield
    finally:
        OmegaConf.register_resolver("oc.env", oc.env, replace=True, annotation_validation="off")


def _leaves(tree: YamlValue, key: str = "") -> Iterator[tuple[str, YamlValue]]:
    """(dotted key, value) of every leaf, in lists too (``key[i]``)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{key}[{i}]")
    else:
        yield key, tree


def _check_raw(tree: YamlValue, file: Path) -> None:
    """Refuse an environment resolver before anything resolves (the error names the key and the variable)."""
    for key, value in _leaves(tree):
        if isinstance(value, str) and (m := _ENV.search(value)):
            raise RecipeError(f"{file}: {key}: {_env_refused_line(m.group(1).strip())}")


def _check_resolved(tree: YamlValue, file: Path) -> None:
    for key, value in _leaves(tree):
        if isinstance(value, str) and len(value) > _LONGEST:
            raise RecipeError(f"{file}: {key} is {len(value)} characters long once interpolated; NxD Training's "
                              f"values are names, paths and flags (at most {_LONGEST} characters)")


def resolve_config(path: str | Path) -> dict[str, YamlValue]:
    """The NxDT config at ``path`` as a plain dict, every interpolation resolved by OmegaConf.
    Raises RecipeError (one line) for a missing file, invalid YAML or an interpolation that does
    not resolve."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"NxDT config not found: {file}")
    OmegaConf.register_resolver("multiply", _multiply, replace=True, annotation_validation="off")  # it checks itself
    try:
        cfg = OmegaConf.load(file)
        _check_raw(OmegaConf.to_container(cfg, resolve=False), file)
        with _no_env():
            data = OmegaConf.to_container(cfg, resolve=True)
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as e:
        raise RecipeError(f"{file}: {one_line(str(e))}") from None
    except RecursionError:
        raise RecipeError(f"{file}: its interpolations nest too deeply to resolve") from None
    except MemoryError:
        raise RecipeError(f"{file}: its interpolations make values too large to hold in memory") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{file}: the top level must be a mapping of sections")
    _check_resolved(data, file)
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

"""Loading a recipe: YAML (duplicate keys rejected) + ``key.path=value`` overrides -> validated
:class:`~nxd_finetune.recipe.sections.Recipe`, with relative input paths resolved (see the package
docstring for which paths and against what)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import yaml
from pydantic import ValidationError

from nxd_finetune.assets import builtin_recipe
from nxd_finetune.errors import RecipeError
from nxd_finetune.recipe.messages import describe_errors, one_line
from nxd_finetune.recipe.sections import Recipe, RecipeDict
from nxd_finetune.recipe.yaml_loader import YamlValue, load_yaml

PATH_KEYS: frozenset[tuple[str, str]] = frozenset({
    ("model", "path"), ("model", "tokenizer"), ("data", "train"), ("data", "eval"), ("data", "cache_dir"),
    ("data", "chat_template"), ("lora", "init_from"),
})
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://|builtin:)")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = (), base_dir: str | None = None) -> Recipe:
    """Read a YAML recipe, apply ``key.path=value`` overrides (values parsed as YAML), validate.

    Relative paths in the file resolve against its directory, those in overrides against the
    current directory (see the module docstring). ``builtin:quickstart`` names the recipe shipped in
    the package (:mod:`nxd_finetune.assets`). ``base_dir``: resolve the file's relative paths against
    it instead (the recipe's directory as another machine sees it: a cluster's pods). Raises
    RecipeError (one line) for a missing or unparsable file, a malformed override and every
    validation failure.
    """
    file = builtin_recipe(str(path)) or Path(path)
    if not file.is_file():
        raise RecipeError(f"recipe file not found: {file}")
    try:
        data = load_yaml(file.read_text())
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        raise RecipeError(f"{where}: invalid YAML: {e.problem or e.context}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"{file}: invalid YAML: {one_line(str(e))}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{file}: the top level must be a mapping of sections, got {type(data).__name__}")
    data = _resolve_paths(data, Path(base_dir) if base_dir else file.resolve().parent)
    parsed = [_parse_override(text) for text in overrides]
    cwd = Path.cwd()
    for keys, value, text in parsed:
        _set_path(data, keys, _resolve_value(keys, value, cwd), text)
    return recipe_from_dict(data, source=str(file), overrides=parsed)


def recipe_from_dict(data: RecipeDict, source: str = "recipe",
                     overrides: Sequence[tuple[list[str], YamlValue, str]] = ()) -> Recipe:
    """Validate a plain dict (paths already resolved). Errors become one-line RecipeErrors prefixed
    with ``source``, or with the override that set the offending key."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        path, message = describe_errors(e, data, Recipe)
        origin = f"{source}: "
        for keys, _, text in overrides:
            n = min(len(keys), len(path))
            if n and tuple(keys[:n]) == tuple(path[:n]):
                origin = f"override '{text}': "
        raise RecipeError(origin + message) from None


def _parse_override(text: str) -> tuple[list[str], YamlValue, str]:
    if "=" not in text:
        raise RecipeError(f"override {text!r} has no '='; write key.path=value (e.g. lora.rank=16)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not _KEY.match(key):
        raise RecipeError(f"override {text!r}: {key!r} is not a dotted key like training.lr")
    try:
        value = load_yaml(raw) if raw.strip() else None
    except (yaml.composer.ComposerError, yaml.constructor.ConstructorError) as e:
        raise RecipeError(f"override {text!r}: {e.problem}") from None  # too deep or too big, duplicate key
    except yaml.YAMLError:
        raise RecipeError(f"override {text!r}: the value is not valid YAML (quote it)") from None
    return key.split("."), value, text


def _set_path(data: RecipeDict, keys: list[str], value: YamlValue, text: str) -> None:
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            where = ".".join(keys[: i + 1])
            raise RecipeError(f"override '{text}': {where} is {child!r}, not a section")
        node = child
    node[keys[-1]] = value


def is_uri(value: str) -> bool:
    """Whether a path value is a URI with a scheme (``s3://``, ``hf://``) or a ``builtin:`` name, not a file."""
    return bool(_SCHEME.match(value))


def resolve_path(value: str, base: Path) -> str:
    """``value`` made absolute against ``base``; URIs with a scheme and ``builtin:`` unchanged."""
    if is_uri(value):
        return value
    p = Path(value).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)


def _resolve_value(keys: Sequence[str], value: YamlValue, base: Path) -> YamlValue:
    if len(keys) == 1 and isinstance(value, dict):
        return {k: _resolve_value((keys[0], k), v, base) for k, v in value.items()}
    if tuple(keys) not in PATH_KEYS:
        return value
    if tuple(keys) == ("checkpoint", "resume") and value == "latest":
        return value
    if tuple(keys) == ("data", "chat_template") and isinstance(value, str) and ("{{" in value or "{%" in value):
        return value  # an inline Jinja template, not a file
    if isinstance(value, str):
        return resolve_path(value, base)
    if isinstance(value, list):
        return [resolve_path(v, base) if isinstance(v, str) else v for v in value]
    return value


def _resolve_paths(data: dict, base: Path) -> dict:
    return {k: _resolve_value((k,), v, base) if isinstance(k, str) else v for k, v in data.items()}

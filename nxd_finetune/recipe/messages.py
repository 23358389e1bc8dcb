"""One-line messages for recipe validation errors: the dotted path of the offending key, the
closest valid key for a typo (aliases from other trainers first), the expected type in words."""

from __future__ import annotations

import difflib
import reprlib
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ValidationError

# names other trainers (NxD, HF Trainer, PEFT) use, tried before spelling similarity
_ALIASES = {
    "tensor_parallel_size": "tp", "tensor_parallel": "tp", "tp_size": "tp", "pipeline_parallel_size": "pp",
    "pipeline_parallel": "pp", "pp_size": "pp", "world_size": "nproc", "learning_rate": "lr",
    "gradient_accumulation_steps": "grad_accum", "batch_size": "micro_batch_size", "num_epochs": "epochs",
    "num_train_epochs": "epochs", "lr_scheduler_type": "scheduler", "r": "rank", "lora_alpha": "alpha",
    "lora_dropout": "dropout", "lora_rank": "rank", "max_length": "max_seq_len", "seq_len": "max_seq_len",
    "sequence_length": "max_seq_len", "model_name_or_path": "path", "max_grad_norm": "grad_clip",
}


def suggest(key: str, choices: Sequence[str], prefix: str = "") -> str:
    """`` (did you mean 'prefix<closest>'?)`` or ''."""
    alias = _ALIASES.get(str(key))
    close = [alias] if alias in choices else difflib.get_close_matches(str(key), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def one_line(text: str) -> str:
    return " ".join(text.split())


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _short(value: Any) -> str:
    """``repr(value)`` in at most 60 characters, built with ``reprlib`` so that a huge value (a
    long list, a structure of shared references) is never rendered whole."""
    text = _REPR.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _section_class(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _describe_type(ann: Any) -> str:
    """A human phrase for a type annotation: ``int | None`` -> 'an integer or null'."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:
        return _describe_type(args[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is list:
        return f"a list of {_describe_type(args[0]).split(' ', 1)[-1]}s"
    if origin is dict:
        return "a mapping of names to strings"
    if origin is tuple:
        return f"a list of {len(args)} numbers"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "a mapping (section)"
    return {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
            str: "a string"}.get(ann, str(ann))


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_BOUND_CTX = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def describe_errors(err: ValidationError, data: dict, root: type[BaseModel]) -> tuple[list[str], str]:
    """(dotted path as a list, one-line message) for the first problem of validating ``data`` as
    ``root`` (the recipe model), counting the others."""
    problems: dict[str, tuple[list[str], str]] = {}
    for e in err.errors():
        path, message = _describe_one(e, data, root)
        problems.setdefault(".".join(path), (path, message))
    (path, message), *rest = problems.values()
    if rest:
        others = ", ".join(".".join(p) or "recipe" for p, _ in rest[:3])
        message += f" (and {len(rest)} more: {others}{', ...' if len(rest) > 3 else ''})"
    return path, message


def _describe_one(e: Any, data: dict, root: type[BaseModel]) -> tuple[list[str], str]:
    loc, kind = e["loc"], e["type"]
    owner: type[BaseModel] | None = root
    path: list[str] = []
    field = None
    rest_loc = list(loc)
    while rest_loc and owner is not None and isinstance(rest_loc[0], str) and rest_loc[0] in owner.model_fields:
        name = rest_loc.pop(0)
        field = owner.model_fields[name]
        path.append(name)
        owner = _section_class(field.annotation)
    dotted = ".".join(path)
    if kind == "extra_forbidden":
        key = str(loc[-1])
        choices = list(owner.model_fields) if owner is not None else []
        prefix = f"{dotted}." if dotted else ""
        hint = suggest(key, choices, prefix) or f"; valid keys: {', '.join(prefix + c for c in choices)}"
        return [*path, key], f"unknown key '{prefix}{key}'{hint}"
    if kind == "missing" and not rest_loc:
        return path, f"missing required key '{dotted}'"
    if kind == "value_error":
        return path, one_line(str(e["ctx"]["error"]))
    index = "".join(f"[{p}]" for p in rest_loc if isinstance(p, int))
    if kind in _BOUNDS:
        bound = e["ctx"][_BOUND_CTX[kind]]
        return path, f"{dotted}{index} must be {_BOUNDS[kind]} {bound}, got {_short(e['input'])}"
    if kind == "finite_number":
        return path, f"{dotted}{index} must be a finite number, got {_short(e['input'])}"
    if kind == "too_short":
        return path, f"{dotted} must not be empty"
    expected = _describe_type(field.annotation) if field is not None else "a mapping"
    value = _lookup(data, path)
    return path, f"{dotted or 'recipe'}: expected {expected}, got {_short(value)}"


def _lookup(data: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return data
        data = data.get(key)
    return data

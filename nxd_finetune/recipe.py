"""The typed recipe tree: YAML file + dotted overrides -> a validated :class:`Recipe`.

Every section is a pydantic model with ``extra="forbid"``; attribute names are the contract listed
in ``docs/architecture.md``. Everything a user can get wrong raises :class:`RecipeError` with one
line: unknown keys name their dotted path and the closest valid key, type errors name the path and
the expected value, cross-field rules carry the numbers. Checks that need the model's shape (heads
divisible by tp, layers by pp) are in :func:`check_against_model`.

Relative paths. In a recipe *file*, a relative *input* path (model, tokenizer, data, chat template,
adapter to start from) is relative to the directory of that file, so a recipe and its data can move
together; ``~`` is expanded. *Output* paths (``output.dir``, ``output.registry``, ``checkpoint.dir``,
``checkpoint.resume``) stay relative to the current directory, where the user runs the job. On the
*command line* (overrides), a relative path is relative to the current directory, like any other
CLI argument. Strings with a scheme
(``s3://...``, ``hf://...``, ``registry://...``, any ``name://``) and ``builtin:`` names are never
touched. The path-valued keys are listed in :data:`PATH_KEYS`; ``checkpoint.resume: latest`` is a
keyword and a ``data.chat_template`` holding ``{{`` or ``{%`` is an inline template, not a path.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nxd_finetune.errors import NxdError, RecipeError
from nxd_finetune.sft.formats import OPTIONAL_FIELDS, REQUIRED_FIELDS

PosInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
StrList = list[str]

PATH_KEYS: frozenset[tuple[str, str]] = frozenset({
    ("model", "path"), ("model", "tokenizer"), ("data", "train"), ("data", "eval"), ("data", "cache_dir"),
    ("data", "chat_template"), ("lora", "init_from"),
})
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://|builtin:)")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

# data.format -> its canonical fields (data.fields maps them to column names); owned by sft.formats
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    fmt: REQUIRED_FIELDS[fmt] + OPTIONAL_FIELDS.get(fmt, ()) for fmt in REQUIRED_FIELDS
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    """``path``: HF model directory (config.json + safetensors) or ``builtin:tiny-llama``.
    ``dtype``: the dtype the base weights are loaded in. ``tokenizer``: defaults to ``path``."""

    path: str = Field(min_length=1)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    revision: str | None = None
    tokenizer: str | None = None


class DataSection(_Section):
    """``train``/``eval``: one file or a list. Without ``eval``, ``eval_fraction`` of train is held
    out. ``fields`` maps the format's canonical fields (:data:`FORMAT_FIELDS`) to column names."""

    train: str | StrList
    eval: str | StrList | None = None
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    format: Literal["messages", "alpaca", "prompt_completion", "text"] = "messages"
    fields: dict[str, str] = {}
    chat_template: str | None = None
    max_seq_len: int = Field(512, ge=2)
    packing: bool = True
    train_on_prompt: bool = False
    cache_dir: str | None = None
    shuffle: bool = True
    max_samples: PosInt | None = None

    @model_validator(mode="after")
    def _check(self) -> DataSection:
        for key in ("train", "eval"):
            if getattr(self, key) == []:
                raise ValueError(f"data.{key} is an empty list")
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError(f"data.eval is set and data.eval_fraction={self.eval_fraction}; set only one")
        known = FORMAT_FIELDS[self.format]
        for name in self.fields:
            if name not in known:
                raise ValueError(f"data.fields.{name} is not a field of format {self.format}"
                                 f"{_suggest(name, known)}; its fields: {', '.join(known)}")
        return self


class LoraSection(_Section):
    """LoRA hyper-parameters (PEFT semantics). ``target_modules``: module names, a regex string or
    ``"all-linear"``. ``init_from``: an adapter directory to start from."""

    rank: PosInt = 8
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: Literal["none", "all", "lora_only"] = "none"
    target_modules: StrList | str = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    use_rslora: bool = False
    init_lora_weights: Literal["default", "gaussian"] = "default"
    modules_to_save: StrList = []
    init_from: str | None = None

    @model_validator(mode="after")
    def _check(self) -> LoraSection:
        if self.target_modules in ([], ""):
            raise ValueError("lora.target_modules is empty")
        return self


class ParallelSection(_Section):
    """Process layout: ``nproc = tp * pp * dp``. ``pp_cuts``: the first layer index of every
    pipeline stage after the first (``pp * virtual_stages - 1`` numbers); None splits evenly.
    ``max_restarts``: how often ``nxd-finetune run`` restarts its workers after one failed (torch
    elastic; the run resumes from the newest complete checkpoint)."""

    nproc: PosInt = 1
    tp: PosInt = 1
    pp: PosInt = 1
    virtual_stages: PosInt = 1
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    pp_cuts: list[PosInt] | None = None
    zero1: bool = False
    sequence_parallel: bool = False
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    checkpoint_modules: StrList = []
    max_restarts: NonNegInt = 0

    @property
    def dp(self) -> int:
        """Data-parallel degree, ``nproc // (tp * pp)``."""
        return self.nproc // (self.tp * self.pp)

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @model_validator(mode="after")
    def _check(self) -> ParallelSection:
        tp, pp, vs = self.tp, self.pp, self.virtual_stages
        if self.nproc % (tp * pp):
            raise ValueError(f"parallel.nproc={self.nproc} is not divisible by tp*pp={tp}*{pp}={tp * pp}")
        if vs > 1 and pp == 1:
            raise ValueError(f"parallel.virtual_stages={vs} needs parallel.pp > 1 (pp=1)")
        if vs > 1 and self.pp_schedule != "interleaved_1f1b":
            raise ValueError(f"parallel.virtual_stages={vs} needs parallel.pp_schedule=interleaved_1f1b "
                             f"(got {self.pp_schedule})")
        if self.sequence_parallel and tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1 (tp=1)")
        if self.pp_cuts is not None:
            cuts, stages = self.pp_cuts, self.num_stages
            if len(cuts) != stages - 1:
                raise ValueError(f"parallel.pp_cuts has {len(cuts)} entries; pp*virtual_stages={pp}*{vs}="
                                 f"{stages} stages need {stages - 1}")
            if any(b <= a for a, b in zip(cuts, cuts[1:], strict=False)):
                raise ValueError(f"parallel.pp_cuts={cuts} must be strictly increasing")
        if self.checkpoint_modules and self.activation_checkpointing == "none":
            raise ValueError("parallel.checkpoint_modules is set but parallel.activation_checkpointing=none")
        return self


class TrainingSection(_Section):
    """Optimisation. Exactly one of ``max_steps`` / ``epochs`` (neither -> ``epochs=1``). Batch:
    ``global_batch_size = micro_batch_size * grad_accum * dp``; give either of the last two."""

    micro_batch_size: PosInt = 1
    global_batch_size: PosInt | None = None
    grad_accum: PosInt | None = None
    max_steps: PosInt | None = None
    epochs: float | None = Field(None, gt=0)
    lr: float = Field(2e-4, gt=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: NonNegInt = 0
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    seed: NonNegInt = 42
    precision: Literal["fp32", "bf16", "bf16-mixed"] = "fp32"
    device: Literal["auto", "cpu", "cuda", "xla"] = "auto"

    @model_validator(mode="after")
    def _check(self) -> TrainingSection:
        if self.max_steps is not None and self.epochs is not None:
            raise ValueError(f"training.max_steps={self.max_steps} and training.epochs={self.epochs} "
                             "are both set; set only one")
        if self.max_steps is None and self.epochs is None:
            self.epochs = 1.0
        if self.max_steps is not None and self.warmup_steps > self.max_steps:
            raise ValueError(f"training.warmup_steps={self.warmup_steps} exceeds "
                             f"training.max_steps={self.max_steps}")
        return self

    def grad_accum_steps(self, dp: int) -> int:
        """Micro-batches per optimizer step on each data-parallel rank.

        Raises RecipeError when ``global_batch_size`` is not a multiple of ``micro_batch_size * dp``
        or disagrees with an explicit ``grad_accum``.
        """
        micro, accum, total = self.micro_batch_size, self.grad_accum, self.global_batch_size
        if total is None:
            return accum or 1
        per_step = micro * dp
        if total % per_step:
            raise RecipeError(f"training.global_batch_size={total} is not divisible by "
                              f"micro_batch_size*dp={micro}*{dp}={per_step}")
        if accum is not None and accum != total // per_step:
            raise RecipeError(f"training.global_batch_size={total} disagrees with micro_batch_size*grad_accum*dp="
                              f"{micro}*{accum}*{dp}={micro * accum * dp}; set only one of the two")
        return total // per_step

    def global_batch(self, dp: int) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.micro_batch_size * self.grad_accum_steps(dp) * dp


class EvalSection(_Section):
    every_n_steps: PosInt | None = None
    max_batches: PosInt | None = None


class CheckpointSection(_Section):
    """``dir`` None -> ``<output.dir>/checkpoints`` (a local path or ``s3://bucket/prefix``).
    Training state is saved every ``every_n_steps`` (None: only at the end and on SIGTERM/SIGINT);
    the ``keep_last`` newest complete checkpoints are kept. ``async_save`` writes in a background
    thread. ``resume``: ``latest`` (the default: the newest complete checkpoint of ``dir``, or a
    fresh start when there is none), a checkpoint path, or None (start fresh, removing earlier
    checkpoints of ``dir``); the CLI's ``--resume``/``--no-resume`` set it. ``save_mode`` applies
    to LoRA runs' final artefact; full SFT always saves the whole model."""

    dir: str | None = None
    every_n_steps: PosInt | None = None
    keep_last: PosInt = 2
    async_save: bool = False
    save_mode: Literal["adapter", "base_and_adapter", "merged"] = "adapter"
    resume: str | None = "latest"


class OutputSection(_Section):
    dir: str = "outputs/run"
    registry: str | None = None


class LoggingSection(_Section):
    every_n_steps: PosInt = 1
    tensorboard: bool = False
    progress: bool = True


class NeuronSection(_Section):
    """Trainium settings, applied only when ``torch_neuronx`` imports and the run is on xla
    (:func:`nxd_finetune.neuron.neuron_env`). ``compile_cache``: the compiler cache root
    (``--cache_dir``; None keeps Neuron's default, /var/tmp/neuron-compile-cache). ``precision``:
    a preset (``auto`` derives it from ``training.precision`` and ``parallel.zero1``).
    ``stochastic_rounding``: None keeps the preset's choice. ``cc_flags``: more compiler flags."""

    compile_cache: str | None = None
    model_type: str | None = Field("transformer", min_length=1)
    precision: Literal["auto", "fp32", "bf16-sr", "bf16-master", "autocast"] = "auto"
    stochastic_rounding: bool | None = None
    cc_flags: StrList = []


class Recipe(_Section):
    """A validated recipe. ``lora`` None means full SFT."""

    model: ModelSection
    data: DataSection
    lora: LoraSection | None = None
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    output: OutputSection = Field(default_factory=OutputSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    neuron: NeuronSection = Field(default_factory=NeuronSection)

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        from nxd_finetune.neuron import resolve_preset

        try:
            resolve_preset(self.training.precision, self.parallel.zero1, self.neuron.precision)
        except NxdError as e:
            raise ValueError(str(e)) from None
        try:
            self.training.grad_accum_steps(self.parallel.dp)
        except RecipeError as e:
            raise ValueError(str(e)) from None
        tp, seq = self.parallel.tp, self.data.max_seq_len
        if self.parallel.sequence_parallel and seq % tp:
            raise ValueError(f"data.max_seq_len={seq} is not divisible by parallel.tp={tp} "
                             "(sequence_parallel splits the sequence over tp ranks)")
        if self.eval.every_n_steps and self.data.eval is None and self.data.eval_fraction == 0:
            raise ValueError(f"eval.every_n_steps={self.eval.every_n_steps} but there is no eval data; "
                             "set data.eval or data.eval_fraction")
        return self

    @property
    def grad_accum_steps(self) -> int:
        """``training.grad_accum_steps(parallel.dp)``."""
        return self.training.grad_accum_steps(self.parallel.dp)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (lists, no tuples) that :func:`recipe_from_dict` turns back into this recipe."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------- loading


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Recipe:
    """Read a YAML recipe, apply ``key.path=value`` overrides (values parsed as YAML), validate.

    Relative paths in the file resolve against its directory, those in overrides against the
    current directory (see the module docstring). Raises RecipeError (one line) for a missing or
    unparsable file, a malformed override and every validation failure.
    """
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"recipe file not found: {file}")
    try:
        data = yaml.load(file.read_text(), Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        raise RecipeError(f"{where}: invalid YAML: {e.problem or e.context}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"{file}: invalid YAML: {_one_line(str(e))}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{file}: the top level must be a mapping of sections, got {type(data).__name__}")
    data = _resolve_paths(data, file.resolve().parent)
    parsed = [_parse_override(text) for text in overrides]
    cwd = Path.cwd()
    for keys, value, text in parsed:
        _set_path(data, keys, _resolve_value(keys, value, cwd), text)
    return recipe_from_dict(data, source=str(file), overrides=parsed)


def recipe_from_dict(data: dict[str, Any], source: str = "recipe", overrides: Sequence[tuple] = ()) -> Recipe:
    """Validate a plain dict (paths already resolved). Errors become one-line RecipeErrors prefixed
    with ``source``, or with the override that set the offending key."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        path, message = _describe_errors(e, data)
        origin = f"{source}: "
        for keys, _, text in overrides:
            n = min(len(keys), len(path))
            if n and tuple(keys[:n]) == tuple(path[:n]):
                origin = f"override '{text}': "
        raise RecipeError(origin + message) from None


def _parse_override(text: str) -> tuple[list[str], Any, str]:
    if "=" not in text:
        raise RecipeError(f"override {text!r} has no '='; write key.path=value (e.g. lora.rank=16)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not _KEY.match(key):
        raise RecipeError(f"override {text!r}: {key!r} is not a dotted key like training.lr")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise RecipeError(f"override {text!r}: the value is not valid YAML (quote it)") from None
    return key.split("."), value, text


def _set_path(data: dict, keys: list[str], value: Any, text: str) -> None:
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


def resolve_path(value: str, base: Path) -> str:
    """``value`` made absolute against ``base``; URIs with a scheme and ``builtin:`` unchanged."""
    if _SCHEME.match(value):
        return value
    p = Path(value).expanduser()
    return os.path.normpath(p if p.is_absolute() else base / p)


def _resolve_value(keys: Sequence[str], value: Any, base: Path) -> Any:
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


# ---------------------------------------------------------------- error messages


# names other trainers (NxD, HF Trainer, PEFT) use, tried before spelling similarity
_ALIASES = {
    "tensor_parallel_size": "tp", "tensor_parallel": "tp", "tp_size": "tp", "pipeline_parallel_size": "pp",
    "pipeline_parallel": "pp", "pp_size": "pp", "world_size": "nproc", "learning_rate": "lr",
    "gradient_accumulation_steps": "grad_accum", "batch_size": "micro_batch_size", "num_epochs": "epochs",
    "num_train_epochs": "epochs", "lr_scheduler_type": "scheduler", "r": "rank", "lora_alpha": "alpha",
    "lora_dropout": "dropout", "lora_rank": "rank", "max_length": "max_seq_len", "seq_len": "max_seq_len",
    "sequence_length": "max_seq_len", "model_name_or_path": "path", "max_grad_norm": "grad_clip",
}


def _suggest(key: str, choices: Sequence[str], prefix: str = "") -> str:
    """`` (did you mean 'prefix<closest>'?)`` or ''."""
    alias = _ALIASES.get(str(key))
    close = [alias] if alias in choices else difflib.get_close_matches(str(key), list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _short(value: Any) -> str:
    text = repr(value)
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


def _describe_errors(err: ValidationError, data: dict) -> tuple[list[str], str]:
    """(dotted path as a list, one-line message) for the first problem, counting the others."""
    problems: dict[str, tuple[list[str], str]] = {}
    for e in err.errors():
        path, message = _describe_one(e, data)
        problems.setdefault(".".join(path), (path, message))
    (path, message), *rest = problems.values()
    if rest:
        others = ", ".join(".".join(p) or "recipe" for p, _ in rest[:3])
        message += f" (and {len(rest)} more: {others}{', ...' if len(rest) > 3 else ''})"
    return path, message


def _describe_one(e: Any, data: dict) -> tuple[list[str], str]:
    loc, kind = e["loc"], e["type"]
    owner: type[BaseModel] | None = Recipe
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
        hint = _suggest(key, choices, prefix) or f"; valid keys: {', '.join(prefix + c for c in choices)}"
        return [*path, key], f"unknown key '{prefix}{key}'{hint}"
    if kind == "missing" and not rest_loc:
        return path, f"missing required key '{dotted}'"
    if kind == "value_error":
        return path, _one_line(str(e["ctx"]["error"]))
    index = "".join(f"[{p}]" for p in rest_loc if isinstance(p, int))
    if kind in _BOUNDS:
        bound = e["ctx"][_BOUND_CTX[kind]]
        return path, f"{dotted}{index} must be {_BOUNDS[kind]} {bound}, got {_short(e['input'])}"
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


# ---------------------------------------------------------------- model-dependent checks


def check_against_model(recipe: Recipe, config: Any) -> None:
    """Rules that need the model's shape; ``config`` has HF attribute names (``num_attention_heads``,
    ``num_key_value_heads``, ``num_hidden_layers``, ``vocab_size``, optionally
    ``intermediate_size``), e.g. ``nxd_finetune.models.DecoderConfig``.

    - attention heads, vocab and MLP width split evenly over tp;
    - key/value heads: tp divides them, or is a multiple of them (kv heads are then replicated);
    - layers split evenly over ``pp * virtual_stages`` stages unless ``parallel.pp_cuts`` places the
      cuts, which must then lie inside ``1 .. num_hidden_layers-1``.
    Raises RecipeError with the numbers.
    """
    par = recipe.parallel
    tp, stages = par.tp, par.num_stages
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    if heads % tp:
        raise RecipeError(f"parallel.tp={tp} does not divide the model's num_attention_heads={heads}")
    if kv % tp and tp % kv:
        raise RecipeError(f"parallel.tp={tp} must divide the model's num_key_value_heads={kv} "
                          "or be a multiple of it")
    if config.vocab_size % tp:
        raise RecipeError(f"parallel.tp={tp} does not divide the model's vocab_size={config.vocab_size}")
    inter = getattr(config, "intermediate_size", None)
    if inter is not None and inter % tp:
        raise RecipeError(f"parallel.tp={tp} does not divide the model's intermediate_size={inter}")
    if par.pp_cuts is not None:
        if par.pp_cuts[-1] >= layers:
            raise RecipeError(f"parallel.pp_cuts={par.pp_cuts} must lie below the model's "
                              f"num_hidden_layers={layers}")
    elif layers % stages:
        raise RecipeError(f"the model's num_hidden_layers={layers} is not divisible by "
                          f"pp*virtual_stages={par.pp}*{par.virtual_stages}={stages}; set parallel.pp_cuts")

"""``nxd-finetune`` command line: parse, validate, delegate.

Only typer is imported at module level so ``--help`` stays fast; the recipe (pydantic), torch and
the training code are imported inside the commands. :func:`main` turns every :class:`NxdError`
into ``error: <message>`` on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from nxd_finetune.errors import DataError, ModelLoadError, NxdError

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe

app = typer.Typer(
    name="nxd-finetune",
    help="SFT and LoRA fine-tuning of HuggingFace decoder LLMs, driven by YAML recipes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)

RecipeArg = Annotated[Path, typer.Argument(help="YAML recipe file.", show_default=False)]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(help="Overrides key.path=value, values parsed as YAML (lora.rank=16, lora=null).",
                   show_default=False),
]
NprocOpt = Annotated[int | None, typer.Option("--nproc", help="Number of processes (sets parallel.nproc).")]


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``nxd-finetune``, ``python -m nxd_finetune``)."""
    try:
        app(args=argv, prog_name="nxd-finetune")
    except NxdError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)


def _load(recipe: Path, overrides: list[str] | None, nproc: int | None = None,
          resume: str | None = None, no_resume: bool = False) -> Recipe:
    """Recipe + overrides; CLI options become overrides applied last, so they win."""
    from nxd_finetune.errors import RecipeError
    from nxd_finetune.recipe import load_recipe

    extra = list(overrides or [])
    world = None
    if nproc is not None:
        extra.append(f"parallel.nproc={nproc}")
    elif "WORLD_SIZE" in os.environ and not any(o.startswith("parallel.nproc=") for o in extra):
        # one worker of torchrun: the world it was started in is the process count
        world = os.environ["WORLD_SIZE"]
        extra.insert(0, f"parallel.nproc={world}")
    if resume is not None and no_resume:
        raise RecipeError("--resume and --no-resume are mutually exclusive")
    if resume is not None:
        extra.append(f"checkpoint.resume={resume}")
    if no_resume:
        extra.append("checkpoint.resume=null")
    try:
        return load_recipe(recipe, extra)
    except RecipeError as e:
        if world is None or f"parallel.nproc={world} " not in str(e):
            raise
        raise RecipeError(f"the launcher started {world} process(es) (WORLD_SIZE={world}), which the recipe's "
                          f"layout does not fit: {e}") from None


@app.command()
def run(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    nproc: NprocOpt = None,
    resume: Annotated[str | None, typer.Option(
        "--resume", metavar="latest|PATH",
        help="Resume from the latest checkpoint of checkpoint.dir or from PATH (sets checkpoint.resume).")] = None,
    no_resume: Annotated[bool, typer.Option(
        "--no-resume", help="Start fresh even if the recipe sets checkpoint.resume.")] = False,
    max_restarts: Annotated[int | None, typer.Option(
        "--max-restarts", min=0, help="Restart the workers up to K times after a failure, resuming from the "
                                      "newest checkpoint (sets parallel.max_restarts; with --nproc > 1).")] = None,
) -> None:
    """Train: load and validate the recipe, then run the SFT loop."""
    restarts = [] if max_restarts is None else [f"parallel.max_restarts={max_restarts}"]
    loaded = _load(recipe, [*(overrides or []), *restarts], nproc, resume, no_resume)
    from nxd_finetune.checkpoint.training import as_training_stopped
    from nxd_finetune.sft import trainer

    try:
        trainer.run(loaded)
    except Exception as err:
        stopped = as_training_stopped(err, loaded)  # SIGTERM / SIGINT: saved; one line on how to resume
        if stopped is None:
            raise
        typer.echo(str(stopped), err=True)
        raise typer.Exit(stopped.exit_code) from None


@app.command()
def validate(recipe: RecipeArg, overrides: OverridesArg = None, nproc: NprocOpt = None) -> None:
    """Check a recipe without training and estimate memory per rank.

    Checks files, the model config against the parallel layout, the checkpoint's tensor names and
    shapes, LoRA target modules and dataset columns; prints the resolved recipe, parameter counts
    and a per-rank memory estimate. Exit code 0 when everything holds.
    """
    loaded = _load(recipe, overrides, nproc)
    typer.echo(loaded.to_yaml())
    for key in ("train", "eval"):
        spec = getattr(loaded.data, key)
        if spec is not None:
            check_data(loaded, key, spec)
    model_dir = _model_dir(loaded)
    from nxd_finetune.models import DecoderConfig
    from nxd_finetune.recipe import check_against_model

    config = DecoderConfig.from_hf(model_dir)
    check_against_model(loaded, config)
    total, trainable, targets = count_parameters(loaded, config, model_dir)
    _print_report(loaded, config, total, trainable, targets)


# ---------------------------------------------------------------- data


def _data_sources(key: str, spec: str | list[str]) -> list[Path]:
    """The local files or ``save_to_disk`` directories behind ``data.<key>`` (the sources
    ``sft.data.load_rows`` reads); remote ones (``hf://...``) are reported and skipped."""
    sources: list[Path] = []
    for item in [spec] if isinstance(spec, str) else spec:
        if "://" in item:
            print(f"note: data.{key} {item} is remote; not checked", file=sys.stderr)
            continue
        path = Path(item)
        if not path.exists():
            raise DataError(f"data.{key}: not found: {path}")
        sources.append(path)
    return sources


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _rows_jsonl(path: Path, n: int) -> list[dict]:
    import json

    rows = []
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):  # a JSON array, not JSON lines
            data = json.load(f)
            return data[:n] if isinstance(data, list) else [data]
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            if len(rows) >= n:
                break
    return rows


def _rows_csv(path: Path, n: int) -> list[dict]:
    import csv
    import itertools

    with path.open(encoding="utf-8", newline="") as f:
        return list(itertools.islice(csv.DictReader(f), n))


def _rows_parquet(path: Path, n: int) -> list[dict]:
    import pyarrow.parquet as pq

    batch = next(pq.ParquetFile(path).iter_batches(batch_size=n), None)
    return batch.to_pylist() if batch is not None else []


def _rows_arrow(path: Path, n: int) -> list[dict]:
    import datasets

    if path.is_dir():  # a save_to_disk directory
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"{path} holds splits {', '.join(loaded)}; expected a 'train' split")
            loaded = loaded["train"]
    else:
        loaded = datasets.Dataset.from_file(str(path))
    return loaded.select(range(min(n, len(loaded)))).to_list()


# the file types of sft.data.LOCAL_BUILDERS, read a few rows at a time (no full conversion)
_READERS = {".jsonl": _rows_jsonl, ".json": _rows_jsonl, ".csv": _rows_csv, ".parquet": _rows_parquet,
            ".arrow": _rows_arrow}


def check_data(recipe: Recipe, key: str, spec: str | list[str], n_rows: int = 5) -> None:
    """Read the first rows of every file of ``data.<key>`` and check they fit ``data.format``:
    the mapped columns exist (``sft.formats.resolve_columns``) and hold the right kind of value.
    Raises DataError naming the file and row."""
    from nxd_finetune.sft.formats import resolve_columns

    fmt = recipe.data.format
    for path in _data_sources(key, spec):
        reader = _rows_arrow if path.is_dir() else _READERS.get(path.suffix.lower())
        if reader is None:
            raise DataError(f"data.{key}: {path}: unsupported file type; use {', '.join(_READERS)}")
        try:
            rows = reader(path, n_rows)
        except DataError:
            raise
        except Exception as e:  # parse errors of csv/parquet/arrow/json: one line naming the file
            raise DataError(f"data.{key}: cannot read {path}: {type(e).__name__}: {_first_line(e)}") from None
        if not rows:
            raise DataError(f"data.{key}: {path} is empty")
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise DataError(f"data.{key}: {path} row {i} is {type(row).__name__}, not an object")
            try:
                columns = resolve_columns(list(row), fmt, recipe.data.fields)
            except DataError as e:
                raise DataError(f"data.{key}: {path} row {i}: {e}") from None
            problem = _row_problem(row, fmt, columns)
            if problem:
                raise DataError(f"data.{key}: {path} row {i}: {problem}")


def _row_problem(row: dict, fmt: str, columns: dict[str, str]) -> str | None:
    if fmt != "messages":
        for name, column in columns.items():
            if not isinstance(row[column], str):
                return f"column {column!r} ({name}) holds {type(row[column]).__name__}, expected a string"
        return None
    messages, role, content = row[columns["messages"]], columns["role"], columns["content"]
    if not isinstance(messages, list) or not messages:
        return f"column {columns['messages']!r} must be a non-empty list of messages"
    for m in messages:
        if not isinstance(m, dict) or role not in m or content not in m:
            return f"every message needs keys {role!r} and {content!r} (map them with data.fields.role/content)"
    return None


# ---------------------------------------------------------------- model


def _model_dir(recipe: Recipe) -> Path:
    """The model directory, after checking config, weights and tokenizer files are there."""
    from nxd_finetune.sft.build import resolve_model_dir

    path = recipe.model.path
    if "://" in path:
        raise ModelLoadError(f"model.path {path}: remote models are not supported; give a local directory")
    model_dir = resolve_model_dir(path)
    tok = recipe.model.tokenizer
    if tok is None or "://" not in tok:
        tok_dir = Path(tok) if tok else model_dir
        names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
        if not any((tok_dir / n).is_file() for n in names):
            raise ModelLoadError(f"no tokenizer in {tok_dir} (expected one of {', '.join(names)}); "
                                 "set model.tokenizer")
    return model_dir


def _check_weights(model: Any, config: Any, model_dir: Path) -> None:
    """Every model tensor is in the checkpoint with the right shape (safetensors headers only)."""
    from safetensors import safe_open

    from nxd_finetune.models import checkpoint_index

    index = checkpoint_index(model_dir)
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = [n for n in expected if n not in index]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"checkpoint in {model_dir} lacks {', '.join(missing[:3])}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(index[name], []).append(name)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                shapes = {name: list(f.get_slice(name).get_shape()) for name in names}
        except Exception as e:  # a truncated or corrupt header
            raise ModelLoadError(f"{file}: unreadable safetensors file: {_first_line(e)}") from None
        for name, shape in shapes.items():
            want = list(expected[name].shape)
            if shape != want:
                raise ModelLoadError(f"{file.name}: tensor {name} has shape {shape}, the config implies {want}")


def count_parameters(recipe: Recipe, config: Any, model_dir: Path | None = None) -> tuple[int, int, list[str]]:
    """(total, trainable, LoRA-wrapped module names) from a meta-device build of the model with the
    recipe's LoRA injected; checks the checkpoint's tensor names/shapes when ``model_dir`` is given.
    ``inject_lora`` raises AdapterError when ``lora.target_modules`` matches nothing."""
    import torch

    from nxd_finetune.models import build_model

    model = build_model(config)
    if model_dir is not None:
        _check_weights(model, config, model_dir)
    targets: list[str] = []
    if recipe.lora is not None:
        from nxd_finetune.lora import inject_lora
        from nxd_finetune.sft.build import lora_config_from_recipe

        for p in model.parameters():
            p.requires_grad_(False)
        with torch.device("meta"):
            targets = inject_lora(model, lora_config_from_recipe(recipe.lora))
    params = list(model.parameters())  # deduplicated, so tied embeddings count once
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), targets


# ---------------------------------------------------------------- memory estimate

def estimate_memory(recipe: Recipe, config: Any, total: int, trainable: int) -> dict[str, float]:
    """Approximate bytes per rank on the busiest rank: weights, grads, optimizer, activations.

    - weights: frozen params in their load dtype (bf16 when ``precision=bf16``, else ``model.dtype``)
      + trainable params in fp32 (bf16 under pure ``bf16``); divided by ``tp*pp``.
    - gradients: one per trainable param, in the trainable dtype; divided by ``tp*pp``.
    - optimizer: AdamW's two fp32 states per trainable param, plus an fp32 master copy when the
      trainable params are bf16; divided by ``tp*pp``, and by ``dp`` under ``zero1``.
    - activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", bytes per layer
      for 16-bit activations, s=max_seq_len, b=micro_batch_size, h=hidden, a=heads, t=tp):
      none: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` (``34/t`` instead of ``10 + 24/t`` with
      sequence_parallel); selective drops the ``5*a*s/(h*t)`` attention-score term; full keeps
      ``2*s*b*h`` (``/t`` with sequence_parallel) per layer plus one layer's full activations for
      the recompute. Doubled for fp32. Times ``ceil(layers/pp)`` layers and the micro-batches a
      stage holds at once (1 without pp, ``min(pp, grad_accum)`` for 1F1B, ``grad_accum`` for
      GPipe), plus fp32 logits and their gradient, ``8*b*s*vocab/t``, on the last stage.
    """
    par, tr = recipe.parallel, recipe.training
    t, pp = par.tp, par.pp
    pure_bf16 = tr.precision == "bf16"
    load_bytes = 2 if pure_bf16 or recipe.model.dtype != "fp32" else 4
    train_bytes = 2 if pure_bf16 else 4
    shard = t * pp
    frozen = total - trainable
    weights = (frozen * load_bytes + trainable * train_bytes) / shard
    grads = trainable * train_bytes / shard
    optimizer = trainable * (8 + (4 if train_bytes == 2 else 0)) / shard / (par.dp if par.zero1 else 1)

    s, b, h, a = recipe.data.max_seq_len, tr.micro_batch_size, config.hidden_size, config.num_attention_heads
    linear = 34 / t if par.sequence_parallel else 10 + 24 / t
    scores = 5 * a * s / (h * t)
    full_layer = s * b * h * (linear + scores)
    per_layer = {"none": full_layer, "selective": s * b * h * linear,
                 "full": 2 * s * b * h / (t if par.sequence_parallel else 1)}[par.activation_checkpointing]
    scale = 1 if tr.precision in ("bf16", "bf16-mixed") else 2
    layers = math.ceil(config.num_hidden_layers / pp)
    accum = tr.grad_accum_steps(par.dp)
    in_flight = 1 if pp == 1 else (accum if par.pp_schedule == "gpipe" else min(pp, accum))
    extra = full_layer if par.activation_checkpointing == "full" else 0
    logits = 8 * b * s * config.vocab_size / t
    first = (per_layer * layers * in_flight + extra) * scale
    last = (per_layer * layers + extra) * scale + logits
    activations = first + logits if pp == 1 else max(first, last)
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": activations}


def _print_report(recipe: Recipe, config: Any, total: int, trainable: int, targets: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    par = recipe.parallel
    mode = f"LoRA on {len(targets)} modules" if recipe.lora is not None else "full SFT"
    console.print(f"model: {config.architecture}, {config.num_hidden_layers} layers, "
                  f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads ({mode})")
    console.print(f"parameters: total {total:,}  trainable {trainable:,} ({100 * trainable / total:.2f}%)")
    console.print(f"layout: nproc={par.nproc} = tp {par.tp} x pp {par.pp} x dp {par.dp}; "
                  f"grad_accum {recipe.grad_accum_steps}, global batch {recipe.training.global_batch(par.dp)}")
    mem = estimate_memory(recipe, config, total, trainable)
    table = Table(title="memory per rank, estimate", title_justify="left")
    table.add_column("component")
    table.add_column("size", justify="right")
    for name, value in mem.items():
        table.add_row(name, _human(value))
    table.add_row("total", _human(sum(mem.values())), style="bold")
    console.print(table)
    console.print(f"(busiest rank; activations for micro_batch_size {recipe.training.micro_batch_size} x "
                  f"max_seq_len {recipe.data.max_seq_len}, checkpointing {par.activation_checkpointing}; "
                  "formulas: nxd_finetune.cli.estimate_memory)")
    console.print("recipe is valid", style="green")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


# ---------------------------------------------------------------- merge


@app.command()
def merge(
    adapter: Annotated[str, typer.Option(
        "--adapter", show_default=False, metavar="REF|DIR",
        help="Adapter: a local directory (ours or HF PEFT's), REGISTRY/NAME[:VERSION|@TAG] (local or s3://, "
             "pulled and verified), or an s3:// prefix holding adapter files.")],
    base: Annotated[str, typer.Option(
        "--base", show_default=False,
        help="Base model directory (HF config.json + safetensors) or builtin:tiny-llama.")],
    out: Annotated[Path, typer.Option(
        "--out", show_default=False, help="Directory for the merged checkpoint (must not exist, or be empty).")],
    dtype: Annotated[str | None, typer.Option(
        "--dtype", metavar="bf16|fp16|fp32", help="Dtype of the merged tensors (default: the base's).")] = None,
    max_shard_size: Annotated[str, typer.Option(
        "--max-shard-size", help="Largest safetensors shard, e.g. 5GB, 500MB, 2GiB.")] = "5GB",
    base_revision: Annotated[str | None, typer.Option(
        "--base-revision", help="The base's revision, checked against the one the adapter records.")] = None,
) -> None:
    """Fold a LoRA adapter into its base: a plain HF checkpoint, loadable by transformers alone.

    Streams tensor by tensor (peak memory about one shard plus the adapter). Exit code 2 with one
    line when the adapter does not fit the base.
    """
    from nxd_finetune.lora.merge import merge_adapter, parse_size
    from nxd_finetune.models import resolve_dtype
    from nxd_finetune.registry.fetch import fetch_adapter
    from nxd_finetune.sft.build import resolve_model_dir

    shard_bytes = parse_size(max_shard_size)
    if dtype is not None:
        resolve_dtype(dtype)  # a bad --dtype fails before anything is downloaded
    base_dir = resolve_model_dir(base)
    with fetch_adapter(adapter, "--adapter") as fetched:
        merge_adapter(fetched.path, base_dir, out, dtype=dtype, max_shard_bytes=shard_bytes,
                      base_revision=base_revision, progress=True)
    typer.echo(f"merged {fetched.lineage or adapter} into {base_dir} -> {out}")


@app.command()
def precompile(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    nproc: NprocOpt = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps to trace.")] = 5,
) -> None:
    """Fill the Neuron compile cache (Trainium only): run a few steps under `neuron_parallel_compile`.

    Runs `nxd-finetune run` with the recipe on xla for `--steps` steps (no periodic checkpoints, no
    registry push, outputs in a temporary directory) with the recipe's Neuron environment, so the
    later `run` finds its graphs in `neuron.compile_cache`. Exit code 2 with one line where the
    Neuron SDK is not installed.
    """
    import os
    import subprocess
    import tempfile

    from nxd_finetune.neuron import neuron_env, precompile_command, require_parallel_compile

    loaded = _load(recipe, [*(overrides or []), "training.device=xla"], nproc)
    tool = require_parallel_compile()
    env = {**os.environ, **neuron_env(loaded)}
    with tempfile.TemporaryDirectory(prefix="nxd-precompile-") as out_dir:
        extra = [*(overrides or []), *([f"parallel.nproc={nproc}"] if nproc is not None else [])]
        argv = precompile_command(tool, str(recipe), extra, loaded, steps, out_dir)
        typer.echo(f"precompile: {' '.join(argv)}", err=True)
        code = subprocess.call(argv, env=env)
    if code != 0:
        raise NxdError(f"{argv[0]} exited with code {code}")
    cache = loaded.neuron.compile_cache or "the default Neuron cache"
    typer.echo(f"compiled the graphs of {steps} steps into {cache}")

def _mount_subcommands() -> None:
    from nxd_finetune.registry.cli import adapters_app

    app.add_typer(adapters_app, name="adapters", help="Push, pull, list, show, tag and remove adapters in a registry.")
    from nxd_finetune.cluster.cli import k8s_app

    app.add_typer(k8s_app, name="k8s", help="Write Kubernetes manifests for a recipe (PyTorchJob, precompile Job).")


_mount_subcommands()

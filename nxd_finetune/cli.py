"""``nxd-finetune`` command line: parse, validate, delegate.

Only typer is imported at module level so ``--help`` stays fast; the recipe (pydantic), torch and
the training code are imported inside the commands. :func:`main` turns every :class:`NxdError`
into ``error: <message>`` on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nxd_finetune.errors import NxdError

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
    from nxd_finetune.errors import show_warnings_as_lines

    show_warnings_as_lines()
    # bitsandbytes (the [qlora] extra; peft imports it where installed) logs a warning on import on
    # CPUs with AVX512-BF16 about an optional kernel package it would fetch from the Hub: nothing a
    # user of generate / chat / eval can act on
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        app(args=argv, prog_name="nxd-finetune")
    except NxdError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # the machine's limits, not the user's input: one line, exit 1
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        target = e.filename2 or e.filename  # a copy names its destination second
        where = f" writing {target}" if target else ""
        print(f"error: no space left on device{where}", file=sys.stderr)
        sys.exit(1)


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
    """Train: load and validate the recipe, then fine-tune the model.

    The recipe's `objective`: SFT (`sft`, the default) or preference tuning on chosen / rejected pairs,
    DPO (`dpo`) or ORPO (`orpo`); LoRA adapters (a `lora` section) or full fine-tuning of every weight (`lora: null`);
    one process, or `--nproc` processes in the recipe's tp / pp / dp layout. Evaluates, checkpoints and
    resumes as the recipe says, writes the final model to `output.dir` and pushes it to `output.registry`
    when one is set.
    """
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
def validate(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    nproc: NprocOpt = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON document (layout, parameters, memory per rank) instead of the report.")] = False,
) -> None:
    """Check a recipe without training and estimate memory per rank.

    Checks files, the model config against the parallel layout, the checkpoint's tensor names and
    shapes, LoRA target modules and dataset columns; prints the resolved recipe, parameter counts
    and a per-rank memory estimate. Exit code 0 when everything holds.
    """
    loaded = _load(recipe, overrides, nproc)
    from nxd_finetune.preflight import print_report, report_json, run_checks

    if not as_json:
        typer.echo(loaded.to_yaml())
    result = run_checks(loaded)
    if as_json:
        typer.echo(json.dumps(report_json(result), indent=2))
    else:
        print_report(result)


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
    allow_other_base: Annotated[bool, typer.Option(
        "--allow-other-base", help="Merge even when the adapter records another base (other config or "
                                   "weights); a warning instead of an error.")] = False,
) -> None:
    """Fold a LoRA adapter into its base: a plain HF checkpoint, loadable by transformers alone.

    Streams tensor by tensor (peak memory about one shard plus the adapter). Exit code 2 with one
    line when the adapter does not fit the base or was trained on another base.
    """
    from nxd_finetune.data.inputs import resolve_model_dir
    from nxd_finetune.lora.merge import merge_adapter, parse_size
    from nxd_finetune.lora.quantized import describe, trained_quantization
    from nxd_finetune.models import resolve_dtype
    from nxd_finetune.registry.fetch import fetch_adapter

    shard_bytes = parse_size(max_shard_size)
    if dtype is not None:
        resolve_dtype(dtype)  # a bad --dtype fails before anything is downloaded
    base_dir = resolve_model_dir(base)
    with fetch_adapter(adapter, "--adapter") as fetched:
        merge_adapter(fetched.path, base_dir, out, dtype=dtype, max_shard_bytes=shard_bytes,
                      base_revision=base_revision, progress=True, allow_other_base=allow_other_base)
        recorded = trained_quantization(fetched.path)
    note = "" if recorded is None else (f" (the full-precision base, from its checkpoint files; the adapter was "
                                        f"trained on its {describe(recorded)} quantization)")
    typer.echo(f"merged {fetched.lineage or adapter} into {base_dir}{note} -> {out}")


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

    app.add_typer(adapters_app, name="adapters",
                  help="Push, pull, list, show, tag, remove and gc adapters in a registry.")
    from nxd_finetune.serve.cli import register as register_serve

    register_serve(app)  # generate, chat, eval
    from nxd_finetune.cluster.cli import k8s_app

    app.add_typer(k8s_app, name="k8s", help="Write Kubernetes manifests for a recipe (PyTorchJob, precompile Job).")
    from nxd_finetune.nxdt.cli import import_app

    app.add_typer(import_app, name="import", help="Import NxD Training YAML configs and sharded checkpoints.")


_mount_subcommands()

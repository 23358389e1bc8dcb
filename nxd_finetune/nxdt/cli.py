"""``nxd-finetune import ...``: bring NxD Training configs and checkpoints over (thin: parse, delegate).

The conversions live in :mod:`nxd_finetune.nxdt`; they are imported inside the commands so that
``nxd-finetune --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

import_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                         help="Import NxD Training (NeuronX Distributed Training) configs and checkpoints.")


@import_app.command("nxdt-config")
def nxdt_config(
    config: Annotated[Path, typer.Argument(help="NxD Training YAML config.", show_default=False)],
    out: Annotated[Path | None, typer.Option(
        "-o", "--out", help="Write the recipe here (default: print it on stdout).")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="HF checkpoint directory to train (model.path); its config.json defines the model and "
                        "model.model_config is not read. Default: the directory of model.model_config.")] = None,
    target: Annotated[Literal["xla", "trn2", "trn3"], typer.Option(
        "--target", help="xla: torch-xla (Neuron SDK <= 2.28, Trn1/Trn2: NxD Training's own stack); trn2 / trn3: "
                         "TorchNeuron, training.device=neuron (Neuron SDK 2.33+, beta).")] = "xla",
) -> None:
    """Translate an NxD Training YAML config into a recipe.

    `${...}` interpolations are resolved by OmegaConf, as NxD Training resolves them; `${oc.env:...}`
    is refused (an environment value may be a secret) and its value never read. Every key is
    reported on stderr: `mapped: KEY -> recipe key` or `not carried over: KEY: reason`; the keys
    not carried over are also written as comments at the top of the recipe. The recipe is
    validated before it is written.
    """
    from nxd_finetune.nxdt.config import translate_config
    from nxd_finetune.nxdt.target import for_target

    translation = for_target(translate_config(config, model_path=model), target)
    text = translation.to_yaml()
    if out is not None:
        from nxd_finetune.storage.atomic import publish_file

        publish_file(out, text.encode())  # beside it, then renamed: an existing recipe is never cut
    for line in translation.report_lines():  # after the write: a failed one is its error line alone
        typer.echo(line, err=True)
    if out is None:
        typer.echo(text, nl=False)
        return
    typer.echo(f"wrote {out}: {len(translation.mapped)} key(s) mapped, {len(translation.dropped)} not carried over",
               err=True)


@import_app.command("nxdt-checkpoint")
def nxdt_checkpoint(
    directory: Annotated[Path, typer.Argument(
        help="NxD checkpoint: a tag directory (with model/ and done), its model/ directory, or a directory of "
             "tags (the newest complete one is read).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Output directory (must not exist, or be empty).",
                                      show_default=False)],
    config: Annotated[Path, typer.Option(
        "--config", show_default=False,
        help="The model's HF config.json (or its directory), or the NxD Training YAML that trained it.")],
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="Tokenizer directory copied beside the weights (default: the YAML's data.tokenizer.type).")
    ] = None,
    kv_layout: Annotated[str, typer.Option(
        "--kv-layout", metavar="auto|interleaved|blocked",
        help="How KV heads were replicated (kv_replicator > 1): interleaved on Trn1, blocked on Trn2; auto reads "
             "it from the weights.")] = "auto",
    base: Annotated[str | None, typer.Option(
        "--base", help="An adapter's base model (base_model_name_or_path); default: the config's directory.")] = None,
) -> None:
    """Convert an NxD sharded checkpoint into an HF checkpoint and/or a PEFT adapter.

    Reads every tp/pp shard with `torch.load(weights_only=True)` (including `save_xser` files), splits
    NxD's fused `qkv_proj` / `gate_up_proj`, undoes the KV replication and writes HF names. A LoRA
    checkpoint becomes `adapter_config.json` + `adapter_model.safetensors`, ready for `run`'s
    `lora.init_from`, `merge`, `adapters push` and vLLM.
    """
    from nxd_finetune.errors import NxdError
    from nxd_finetune.nxdt.convert import import_checkpoint, model_source

    layouts: tuple[Literal["auto", "interleaved", "blocked"], ...] = ("auto", "interleaved", "blocked")
    chosen = next((x for x in layouts if x == kv_layout), None)
    if chosen is None:
        raise NxdError(f"--kv-layout {kv_layout!r}: use auto, interleaved or blocked")
    summary = import_checkpoint(directory, out, model_source(config), tokenizer=tokenizer, kv_layout=chosen,
                                base=base)
    typer.echo(summary)

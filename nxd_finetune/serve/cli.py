"""``nxd-finetune generate``, ``chat`` and ``eval``: parse, then delegate to
:mod:`nxd_finetune.serve.generate` and :mod:`nxd_finetune.serve.evaluate`.

Only typer is imported here at module level (``nxd_finetune.cli`` mounts these commands at start).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

AdapterOpt = Annotated[str | None, typer.Option(
    "--adapter", metavar="REF|DIR", show_default=False,
    help="What `run` wrote: an adapter directory, a merged / full-SFT checkpoint or a base_and_adapter output; "
         "or REGISTRY/NAME[:VERSION|@TAG] (local or s3://, pulled and verified), or an s3:// adapter prefix.")]
BaseOpt = Annotated[str | None, typer.Option(
    "--base", show_default=False,
    help="Base model directory or builtin:tiny-llama (default: the adapter's base_model_name_or_path).")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", help="Most tokens to generate.")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", help="0 = greedy; > 0 samples.")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (with --temperature > 0).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed of the sampler.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cpu | cuda | cuda:N.")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", metavar="fp32|bf16|fp16",
                                              help="Load dtype (default: the checkpoint's).")]
FullPrecisionOpt = Annotated[bool, typer.Option(
    "--full-precision",
    help="An adapter trained on a quantized base (model.quantization): load the base unquantized instead of "
         "quantized as the adapter's metadata records it was trained (the default).")]
TemplateOpt = Annotated[str | None, typer.Option(
    "--chat-template", show_default=False, help="Jinja chat template (file or inline); default: the tokenizer's.")]
TemplateKwargsOpt = Annotated[str | None, typer.Option(
    "--chat-template-kwargs", metavar="JSON", show_default=False,
    help='Variables the chat template sees, as the recipe\'s data.chat_template_kwargs: '
         '\'{"enable_thinking": false}\' (Qwen3 without thinking).')]


def generate(
    adapter: AdapterOpt = None,
    base: BaseOpt = None,
    prompt: Annotated[str | None, typer.Option("--prompt", show_default=False,
                                               help="A user message (or plain text with --raw).")] = None,
    messages: Annotated[Path | None, typer.Option(
        "--messages", show_default=False, help="JSON file: a list of {role, content} messages.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Tokenize --prompt as plain text, no chat template.")] = False,
    chat_template: TemplateOpt = None,
    chat_template_kwargs: TemplateKwargsOpt = None,
    max_new_tokens: MaxNewOpt = 128,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    full_precision: FullPrecisionOpt = False,
) -> None:
    """Generate one completion with transformers + peft and print it.

    `--prompt` is sent as a user message through the chat template (the tokenizer's, or
    `--chat-template`); without any template, or with `--raw`, it is plain text.
    """
    from nxd_finetune.errors import NxdError
    from nxd_finetune.serve import generate as gen

    if (prompt is None) == (messages is None):
        raise NxdError("give exactly one of --prompt and --messages")
    config = gen.GenerationConfig(max_new_tokens, temperature, top_p, seed)
    template, kwargs = gen.load_template(chat_template), gen.load_template_kwargs(chat_template_kwargs)
    with gen.load_model(adapter, base, device, dtype, template, kwargs, full_precision) as loaded:
        if messages is not None:
            ids = gen.prompt_ids(loaded.tokenizer, gen.read_messages(messages), chat_template=template,
                                 template_kwargs=kwargs)
        elif raw or (template is None and not getattr(loaded.tokenizer, "chat_template", None)):
            ids = gen.prompt_ids(loaded.tokenizer, text=prompt)
        else:
            ids = gen.prompt_ids(loaded.tokenizer, [{"role": "user", "content": prompt or ""}], chat_template=template,
                                 template_kwargs=kwargs)
        typer.echo(gen.decode(loaded.tokenizer, gen.generate_ids(loaded, ids, config)))


def chat(
    adapter: AdapterOpt = None,
    base: BaseOpt = None,
    system: Annotated[str | None, typer.Option("--system", show_default=False, help="A system message.")] = None,
    chat_template: TemplateOpt = None,
    chat_template_kwargs: TemplateKwargsOpt = None,
    max_new_tokens: MaxNewOpt = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    seed: SeedOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    full_precision: FullPrecisionOpt = False,
) -> None:
    """Chat with the model in the terminal; replies stream token by token.

    Type a message and Enter; `/reset` starts over, `/exit` (or Ctrl-D) leaves.
    """
    from nxd_finetune.serve import generate as gen

    config = gen.GenerationConfig(max_new_tokens, temperature, top_p, seed)
    template, kwargs = gen.load_template(chat_template), gen.load_template_kwargs(chat_template_kwargs)
    interactive = sys.stdin.isatty()
    with gen.load_model(adapter, base, device, dtype, template, kwargs, full_precision) as loaded:
        start = [{"role": "system", "content": system}] if system else []
        history = list(start)
        if interactive:
            typer.echo(f"chatting with {loaded.description}; /reset starts over, /exit leaves", err=True)
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                break
            text = line.strip()
            if text in ("/exit", "/quit"):
                break
            if text == "/reset":
                history = list(start)
                continue
            if not text:
                continue
            history.append({"role": "user", "content": text})
            pieces = []
            ids = gen.prompt_ids(loaded.tokenizer, history, chat_template=template, template_kwargs=kwargs)
            for piece in gen.stream(loaded, ids, config):
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
            history.append({"role": "assistant", "content": "".join(pieces)})


def eval_cmd(
    recipe: Annotated[Path, typer.Argument(help="YAML recipe file (its data.eval / eval_fraction is the set).",
                                           show_default=False)],
    overrides: Annotated[list[str] | None, typer.Argument(help="Overrides key.path=value.", show_default=False)] = None,
    adapter: Annotated[str | None, typer.Option(
        "--adapter", metavar="REF|DIR", show_default=False,
        help="What to score (default: <output.dir>/final): an adapter directory, REF or s3:// prefix, "
             "a merged / full-SFT checkpoint, or a built-in base (builtin:smollm2-135m-instruct).")] = None,
    nproc: Annotated[int | None, typer.Option("--nproc", help="Processes (sets parallel.nproc).")] = None,
    exact_match: Annotated[bool, typer.Option(
        "--generate/--no-generate",
        help="Also generate an answer for every eval conversation (greedy) and score exact match.")] = False,
    max_new_tokens: MaxNewOpt = 64,
    out: Annotated[Path | None, typer.Option(
        "--out", show_default=False, help="JSON file for the scores (default: <output.dir>/eval.json).")] = None,
    full_precision: FullPrecisionOpt = False,
) -> None:
    """Score a trained model on the recipe's eval set without training.

    Loss, perplexity and next-token accuracy over the answer tokens, computed by the training
    loop's own eval (same layout options, same numbers as the run's last eval); with `--generate`,
    also exact match of greedy generations against the reference answers. Prints a table and
    writes a JSON file.
    """
    from nxd_finetune.recipe import load_recipe
    from nxd_finetune.serve.evaluate import evaluate_recipe, print_scores

    loaded = load_recipe(recipe, [*(overrides or []), *([f"parallel.nproc={nproc}"] if nproc is not None else [])])
    scores = evaluate_recipe(loaded, adapter, exact_match=exact_match, max_new_tokens=max_new_tokens, out=out,
                             full_precision=full_precision)
    print_scores(scores)


def register(app: typer.Typer) -> None:
    """Mount the commands on the main app."""
    app.command("generate")(generate)
    app.command("chat")(chat)
    app.command("eval")(eval_cmd)

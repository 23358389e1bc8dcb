"""``nxd-finetune eval``: score a trained model on a recipe's eval set without training.

The numbers come from the training loop's own pieces: the recipe's data pipeline
(``data.loader.build_dataloaders``), the engine of the recipe's layout (``sft.engine.build_engine``,
tp / pp / dp as in training, ``--nproc`` workers started by ``parallel.launch.launch``) and
``sft.trainer.evaluate``. What is scored enters through the recipe, so every layout loads it the
way training does:

- an adapter (directory, registry REF, ``s3://`` prefix; ``base_and_adapter`` outputs: their
  ``adapter/``) becomes ``lora.init_from`` with the ``lora`` section taken from its
  ``adapter_config.json``, on the recipe's ``model.path``;
- an HF checkpoint (``merged`` or full-SFT outputs) becomes ``model.path`` with no ``lora`` (and
  no ``model.quantization``: a merged checkpoint is the full-precision model).

An adapter trained on a quantized base (its metadata records the settings) is scored on the base
quantized as it was trained: ``model.quantization`` becomes the recorded settings, whatever the
recipe says, unless ``full_precision`` (``--full-precision``) asks for the base unquantized; the
``--generate`` answers come from the same base.

An adapter scored on the recipe it was trained with therefore gives the run's last eval exactly
(the same batches, the same model, the same reductions). ``--generate`` adds exact match: the
reference answer (last assistant message of each ``messages`` row) against a greedy generation
(:mod:`nxd_finetune.serve.generate`, transformers + peft).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from nxd_finetune.assets import BUILTIN_PREFIX
from nxd_finetune.data.datasets import DataSpec, _split_eval, load_rows
from nxd_finetune.data.formats import load_chat_template, resolve_columns
from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.errors import DataError, NxdError
from nxd_finetune.lora import LoraConfig
from nxd_finetune.lora.quantized import QuantSpec, recorded_section, trained_quantization
from nxd_finetune.parallel.launch import in_launched_env, launch
from nxd_finetune.recipe import RecipeDict, recipe_from_dict
from nxd_finetune.registry.fetch import fetch_adapter
from nxd_finetune.serve import generate as gen
from nxd_finetune.serve.generate import ADAPTER_CONFIG
from nxd_finetune.sft.reference import attach_reference
from nxd_finetune.sft.setup import setup_rank
from nxd_finetune.sft.trainer import evaluate, prepare_shared

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe


class ExactMatch(TypedDict):
    """``--generate``'s scores: the share of exact answers, how many were generated, a few examples."""

    exact_match: float
    generated: int
    examples: list[dict[str, str]]


@contextlib.contextmanager
def _artefact(target: str) -> Iterator[tuple[str, Path, str]]:
    """``(kind, local path, description)`` with kind ``adapter`` or ``model``."""
    if target.startswith(BUILTIN_PREFIX):  # a built-in model (builtin:smollm2-135m-instruct): the base alone
        yield "model", resolve_model_dir(target), target
        return
    local = Path(target).expanduser()
    if "://" not in target and (local / "config.json").is_file() and not (local / ADAPTER_CONFIG).is_file():
        yield "model", local, target
        return
    if "://" not in target and (local / "adapter" / ADAPTER_CONFIG).is_file():
        target = str(local / "adapter")
    with fetch_adapter(target, "--adapter") as fetched:
        yield "adapter", fetched.path, fetched.lineage or target


def _recipe_for(recipe: Recipe, kind: str, path: Path, full_precision: bool = False) -> Recipe:
    """The recipe that scores ``path``: see the module docstring."""
    data = recipe.to_dict()
    if kind == "model":
        data["model"]["path"] = str(path)
        data["model"]["quantization"] = None
        data["lora"] = None
    else:
        cfg = LoraConfig.from_peft_dict(json.loads((path / ADAPTER_CONFIG).read_text()))
        data["lora"] = cfg.to_section(dropout=0.0, init_lora_weights="default", init_from=str(path))
        recorded = trained_quantization(path)
        if full_precision:
            data["model"]["quantization"] = None
        elif recorded is not None:
            QuantSpec.from_json(recorded, str(path))  # unreadable settings: one line naming the adapter
            data["model"]["quantization"] = recorded_section(recorded)
    return recipe_from_dict(data, "eval recipe")


def evaluate_recipe(recipe: Recipe, adapter: str | None = None, *, exact_match: bool = False, max_new_tokens: int = 64,
                    out: Path | None = None, full_precision: bool = False) -> dict[str, object]:
    """Score ``adapter`` (default ``<output.dir>/final``) on ``recipe``'s eval set; returns the
    scores (also written as JSON to ``out``, default ``<output.dir>/eval.json``). ``full_precision``:
    an adapter trained on a quantized base is scored on the base unquantized."""
    if recipe.data.eval is None and recipe.data.eval_fraction == 0:
        raise DataError("the recipe has no eval set; set data.eval or data.eval_fraction")
    target = adapter or str(Path(recipe.output.dir) / "final")
    if adapter is None and not Path(target).exists():
        raise NxdError(f"{target} does not exist (train first, or pass --adapter)")
    t0 = time.perf_counter()
    with _artefact(target) as (kind, path, description):
        scoring = _recipe_for(recipe, kind, path, full_precision)
        scores: dict[str, object] = {"scored": description,
                                     "model": recipe.model.path if kind == "adapter" else str(path),
                                     **_score(scoring, recipe)}
        if exact_match and _is_main():
            scores.update(generated_exact_match(scoring, str(path), max_new_tokens, full_precision=full_precision))
    scores["nproc"] = scoring.parallel.nproc
    scores["time_s"] = round(time.perf_counter() - t0, 2)
    if _is_main():
        dest = out or Path(recipe.output.dir) / "eval.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps(scores, indent=2))
        scores["written_to"] = str(dest)
    return scores


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _score(recipe: Recipe, run_recipe: Recipe) -> dict[str, float | int | None]:
    if in_launched_env():
        return eval_rank(recipe, run_recipe) or {}
    if recipe.parallel.nproc == 1:
        return eval_rank(recipe, run_recipe) or {}
    prepare_shared(recipe)
    return launch(_worker, recipe.parallel.nproc, recipe.to_dict(), run_recipe.to_dict())[0] or {}


def _worker(recipe_dict: RecipeDict, run_dict: RecipeDict) -> dict[str, float | int | None] | None:
    return eval_rank(recipe_from_dict(recipe_dict), recipe_from_dict(run_dict))


def eval_rank(recipe: Recipe, run_recipe: Recipe | None = None) -> dict[str, float | int | None] | None:
    """One process of the scoring (world size 1 included): the trainer's rank setup
    (:func:`~nxd_finetune.sft.setup.setup_rank`), then its eval. ``run_recipe``: the training
    recipe whose reference model preference scores are measured against. Collective; returns the
    scores on global rank 0."""
    rr = setup_rank(recipe, write_recipe=False)
    if rr.data.eval is None:
        raise DataError("the eval set is empty")
    # preference: the pairs' reference log-probs (the training run's reference, not the scored adapter)
    attach_reference(recipe, rr.engine, rr.data, rr.model_dir, run_recipe, splits=["eval"])
    scores = evaluate(rr.engine, rr.objective, iter(rr.data.eval), recipe.eval.max_batches, rr.runtime)
    if not rr.engine.is_logger:
        return None
    return {**scores, "eval_rows": rr.data.stats.get("eval", {}).get("samples")} if scores else {}


# ---------------------------------------------------------------- exact match


def _reference_rows(recipe: Recipe) -> list[tuple[list[dict[str, str]], str]]:
    """``(prompt messages, reference answer)`` of every eval conversation that ends with an
    assistant message, in the eval set's order."""
    spec = DataSpec.of(recipe.data)
    if spec.format != "messages":
        raise DataError(f"--generate scores conversations: it needs data.format messages, not {spec.format}")
    rows = load_rows(spec.eval) if spec.eval is not None else _split_eval(load_rows(spec.train or []),
                                                                           spec.eval_fraction)[1]
    columns = resolve_columns(list(rows.column_names), "messages", spec.fields)
    role, content = columns["role"], columns["content"]
    pairs = []
    for row in rows:
        messages = [{"role": m[role], "content": m[content]} for m in row[columns["messages"]]]
        if len(messages) > 1 and messages[-1]["role"] == "assistant":
            pairs.append((messages[:-1], messages[-1]["content"]))
    return pairs


def generated_exact_match(recipe: Recipe, target: str, max_new_tokens: int, batch_size: int = 16,
                          full_precision: bool = False) -> ExactMatch:
    """Greedy generations for the eval conversations against their reference answers (whitespace
    stripped): ``exact_match`` and a few examples. ``full_precision``: as :func:`gen.load_model`'s."""
    pairs = _reference_rows(recipe)
    if not pairs:
        raise DataError("no eval conversation ends with an assistant answer to compare against")
    template = load_chat_template(recipe.data.chat_template)
    device = "cuda" if recipe.training.device == "cuda" else "cpu"
    is_adapter = (Path(target) / ADAPTER_CONFIG).is_file()
    base = str(resolve_model_dir(recipe.model.path)) if is_adapter else None
    kwargs = recipe.data.chat_template_kwargs
    with gen.load_model(target, base, device, chat_template=template, template_kwargs=kwargs,
                        full_precision=full_precision) as loaded:
        prompts = [gen.prompt_ids(loaded.tokenizer, messages, chat_template=template, template_kwargs=kwargs)
                   for messages, _ in pairs]
        outputs = gen.generate_batch(loaded, prompts, gen.GenerationConfig(max_new_tokens), batch_size)
        answers = [gen.decode(loaded.tokenizer, ids).strip() for ids in outputs]
    hits = [a == ref.strip() for a, (_, ref) in zip(answers, pairs, strict=True)]
    examples = [{"prompt": m[-1]["content"], "reference": ref, "generated": a}
                for a, (m, ref) in list(zip(answers, pairs, strict=True))[:10]]
    return {"exact_match": sum(hits) / len(hits), "generated": len(hits), "examples": examples}


def print_scores(scores: Mapping[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"eval of {scores['scored']}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    rows = (("eval_loss", "loss", "{:.4f}"), ("eval_ppl", "perplexity", "{:.3f}"),
            ("eval_accuracy", "token accuracy", "{:.4f}"),
            ("eval_rewards/accuracies", "preference accuracy", "{:.4f}"),
            ("eval_rewards/margins", "reward margin", "{:.4f}"),
            ("exact_match", "exact match (generated)", "{:.4f}"),
            ("generated", "conversations generated", "{}"), ("nproc", "processes", "{}"), ("time_s", "time (s)", "{}"))
    for key, label, fmt in rows:
        value = scores.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            table.add_row(label, fmt.format(value))
    if "written_to" in scores:
        table.add_row("written to", str(scores["written_to"]))
    Console().print(table)

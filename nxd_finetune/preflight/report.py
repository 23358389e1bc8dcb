"""What ``nxd-finetune validate`` does after loading the recipe: :func:`run_checks` (data, model
files and weights, the model-dependent recipe rules, parameter counts, the memory estimate) and
the two ways of showing the result, :func:`print_report` (text) and :func:`report_json`."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from nxd_finetune.jsontypes import JsonObject
from nxd_finetune.models import DecoderConfig
from nxd_finetune.preflight.data import check_data, micro_batch_targets
from nxd_finetune.preflight.hardware import check_cpu_formats, check_device
from nxd_finetune.preflight.memory import estimate_memory, human_bytes
from nxd_finetune.preflight.model import (
    check_init_from_adapter,
    count_parameters,
    expert_parameters,
    find_model_dir,
)
from nxd_finetune.recipe import check_against_model

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe


@dataclasses.dataclass
class Preflight:
    """A recipe that passed every check, with what ``validate`` reports about it. ``memory``:
    estimated bytes per component on the busiest rank (:func:`estimate_memory`)."""

    recipe: Recipe
    model_dir: Path
    config: DecoderConfig
    total: int
    trainable: int
    targets: list[str]
    memory: dict[str, float]
    loss_targets: int | None = None  # the most target positions in one micro-batch (None: not counted)
    experts: tuple[int, int] = (0, 0)  # (expert parameters, those a token runs): .model.expert_parameters


def run_checks(recipe: Recipe) -> Preflight:
    """Check ``recipe`` without training: every local data file's first rows against the format,
    the model's config, tokenizer and checkpoint tensors, the model-dependent rules
    (:func:`nxd_finetune.recipe.check_against_model`), the LoRA targets and ``lora.init_from`` (as
    ``run`` checks it: :func:`.model.check_init_from_adapter`). Raises the one-line
    NxdError subclass of the first problem (DataError, ModelLoadError, RecipeError, AdapterError)."""
    for key in ("train", "eval"):
        spec = getattr(recipe.data, key)
        if spec is not None:
            check_data(recipe, key, spec)
    model_dir = find_model_dir(recipe)
    config = DecoderConfig.from_hf(model_dir)
    check_against_model(recipe, config)
    total, trainable, targets = count_parameters(recipe, config, model_dir)
    check_init_from_adapter(recipe, config, model_dir)
    loss_targets = micro_batch_targets(recipe, model_dir)
    memory = estimate_memory(recipe, config, total, trainable, loss_targets)
    check_device(recipe, required=False)  # what the device lacks for the recipe: one line
    check_cpu_formats(recipe)  # a warning line: bf16 on a CPU without bf16 instructions
    return Preflight(recipe, model_dir, config, total, trainable, targets, memory, loss_targets,
                     expert_parameters(config))


def layout(recipe: Recipe) -> JsonObject:
    """The resolved process layout and batch sizes of ``recipe``."""
    par, tr = recipe.parallel, recipe.training
    return {
        "nproc": par.nproc, "tp": par.tp, "pp": par.pp, "dp": par.dp, "ep": par.ep,
        "virtual_stages": par.virtual_stages,
        "pp_schedule": par.pp_schedule, "sequence_parallel": par.sequence_parallel, "zero1": par.zero1,
        "activation_checkpointing": par.activation_checkpointing, "micro_batch_size": tr.micro_batch_size,
        "grad_accum": recipe.grad_accum_steps, "global_batch_size": tr.global_batch(par.dp),
        "max_seq_len": recipe.data.max_seq_len, "precision": tr.precision,
    }


def report_json(result: Preflight) -> JsonObject:
    """``validate --json``: the layout, the model, the parameter counts and the memory estimate per
    rank (busiest rank; each part and the total, in bytes, rounded to whole bytes)."""
    cfg = result.config
    memory: JsonObject = {name: round(value) for name, value in result.memory.items()}
    memory["total"] = round(sum(result.memory.values()))
    return {
        "valid": True,
        "layout": layout(result.recipe),
        "model": {"path": str(result.model_dir), "architecture": cfg.architecture,
                  "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
                  "num_key_value_heads": cfg.num_key_value_heads},
        "parameters": {"total": result.total, "trainable": result.trainable, "lora_modules": len(result.targets),
                       "mode": "lora" if result.recipe.lora is not None else "full", **_expert_counts(result)},
        "max_targets_per_micro_batch": result.loss_targets,
        "memory_per_rank_bytes": memory,
    }


def _expert_counts(result: Preflight) -> dict[str, int]:
    """A mixture-of-experts model's ``experts`` (expert parameters) and ``active_per_token`` (the
    parameters one token runs: the dense ones and its top-k experts'); nothing for a dense model."""
    experts, active = result.experts
    return {"experts": experts, "active_per_token": result.total - experts + active} if experts else {}


def print_report(result: Preflight) -> None:
    """The text report of ``validate`` (after the resolved recipe): model, parameters, layout, the
    memory table, ``recipe is valid``."""
    from rich.console import Console
    from rich.table import Table

    recipe, config, total, trainable = result.recipe, result.config, result.total, result.trainable
    console = Console(highlight=False)
    par = recipe.parallel
    mode = f"LoRA on {len(result.targets)} modules" if recipe.lora is not None else "full SFT"
    console.print(f"model: {config.architecture}, {config.num_hidden_layers} layers, "
                  f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads ({mode})")
    console.print(f"parameters: total {total:,}  trainable {trainable:,} ({100 * trainable / total:.2f}%)")
    moe = _expert_counts(result)
    if moe:
        console.print(f"experts: {moe['experts']:,} parameters ({config.num_experts} per MoE layer, "
                      f"{config.num_experts_per_tok} per token); active per token {moe['active_per_token']:,}")
    console.print(f"layout: nproc={par.nproc} = tp {par.tp} x pp {par.pp} x dp {par.dp}; "
                  f"grad_accum {recipe.grad_accum_steps}, global batch {recipe.training.global_batch(par.dp)}")
    table = Table(title="memory per rank, estimate", title_justify="left")
    table.add_column("component")
    table.add_column("size", justify="right")
    for name, value in result.memory.items():
        table.add_row(name, human_bytes(value))
    table.add_row("total", human_bytes(sum(result.memory.values())), style="bold")
    console.print(table)
    targets = "every position" if result.loss_targets is None else f"at most {result.loss_targets:,} targets"
    recompute: str = par.activation_checkpointing
    if (recipe.model.quantization is not None and recompute == "full"
            and "activation_checkpointing" not in par.model_fields_set):
        recompute += " (the default with model.quantization)"
    console.print(f"(busiest rank; activations for micro_batch_size {recipe.training.micro_batch_size} x "
                  f"max_seq_len {recipe.data.max_seq_len}, checkpointing {recompute}; "
                  f"loss over {targets} per micro-batch; formulas: nxd_finetune.preflight.memory.estimate_memory)")
    if result.memory.get("allocator cache", 0.0) > 0:  # training on the CPU
        console.print("(on the CPU the peak can grow past this over a run's first steps, as micro-batches of other "
                      "shapes fragment glibc's heap: metrics.jsonl's peak_host_mb shows it; "
                      "MALLOC_MMAP_THRESHOLD_=4194304 in the environment lowers it at a cost in speed)")
    console.print("recipe is valid", style="green")

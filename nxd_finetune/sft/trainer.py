"""The training loop: one code path for every world size and parallel layout.

``run(recipe)`` with ``parallel.nproc > 1`` starts the workers itself through torch's elastic
launcher (or, under ``torchrun``, joins the group it describes); every process then runs
:func:`run_rank`: its :class:`~nxd_finetune.sft.engine.Engine` (model or pipeline stages, sharded
as the recipe says), the data of its data-parallel rank, and the loop: forward/backward of the
step's micro-batches, gradient reductions + clipping + optimizer step, logging, eval, final save.
Global rank 0 alone prints, writes metrics and the final artefact.

Loss normalisation: every micro-batch loss is a *sum* over its target tokens divided by the number
of target tokens of the whole optimizer step over all data-parallel ranks, so the step's gradient
is that of the token-mean over the global batch whatever the split into micro-batches and ranks;
the data-parallel reduction is therefore a sum.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nxd_finetune.checkpoint.run_state import TrainState
from nxd_finetune.checkpoint.training import TrainingCheckpoints
from nxd_finetune.data.datasets import DataSpec, prepare_datasets
from nxd_finetune.data.inputs import load_tokenizer, resolve_model_dir
from nxd_finetune.errors import NxdError, NxdWarning, show_warnings_as_lines
from nxd_finetune.export import ExportSpec, export_model
from nxd_finetune.lora.quantized import parameter_elements, quantization_metadata
from nxd_finetune.metrics import MetricsWriter, Progress
from nxd_finetune.models import DecoderConfig, resolve_dtype
from nxd_finetune.objective import Objective, add_stats, maxed_entries
from nxd_finetune.objectives import objective_record, run_reference, section_of
from nxd_finetune.parallel.clip import counts_on_rank, norm_axes
from nxd_finetune.parallel.launch import in_launched_env, launch
from nxd_finetune.parallel.placement import Placement, placement_map, placement_of
from nxd_finetune.preflight.hardware import check_cpu_formats, check_device
from nxd_finetune.recipe import RecipeDict, check_against_model, recipe_from_dict
from nxd_finetune.registry.publish import check_publish_target, publish_run
from nxd_finetune.runtime import HostValues, StepRuntime
from nxd_finetune.serve.samples import EvalSamples
from nxd_finetune.sft.curve import write_loss_curve
from nxd_finetune.sft.memory import gather_peak_memory, host_peak_mb, rank_memory
from nxd_finetune.sft.ref_source import LazyReference, ReferenceSource, lazy_reference
from nxd_finetune.sft.reference import Identity, reference_label
from nxd_finetune.sft.setup import SourceFactory, setup_rank
from nxd_finetune.sft.source import BatchSource, source_metrics
from nxd_finetune.sft.step import StepLog, divergence_hint, stop_if_diverged, train_step
from nxd_finetune.sft.summary import RunSummary, print_summary, save_summary
from nxd_finetune.trackers import check_trackers, open_trackers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.recipe import Recipe
    from nxd_finetune.sft.engine import Engine


def evaluate(engine: Engine, objective: Objective, batches: Iterator[dict[str, torch.Tensor]],
             max_batches: int | None, runtime: StepRuntime | None = None) -> dict[str, float]:
    """``objective``'s eval record over every dp rank's eval share (supervised: token-mean eval
    loss, perplexity and next-token accuracy over target tokens). Collective (every rank calls
    it; eval loaders give each rank as many batches).
    One host read at the end; on XLA one graph per batch (``runtime.sync()``)."""
    engine.train(False)
    stats = torch.zeros(objective.eval_width, device=engine.device)
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        stats += engine.eval_stats({k: v.to(engine.device) for k, v in batch.items()}, objective)
        if runtime is not None:
            runtime.sync()
    engine.train(True)
    return objective.eval_record(engine.dp_sum(stats).tolist())


def train(
    engine: Engine,
    source: BatchSource,
    total_steps: int,
    recipe: Recipe,
    metrics: MetricsWriter,
    eval_fn: Callable[[], dict[str, float]] | None,
    state: TrainState,
    show_progress: bool,
    runtime: StepRuntime | None = None,
    ckpt: TrainingCheckpoints | None = None,
    history: list[dict[str, float]] | None = None,
    *,
    objective: Objective,
) -> list[dict[str, float]]:
    """The optimizer-step loop of ``objective``. ``source`` (:mod:`nxd_finetune.sft.source`) gives, right before each
    optimizer step, this rank's micro-batches and their number of non-padding tokens (counted on
    the host). Returns the logged records (the same
    on every rank). Device values (token counts; loss and grad norm on logging steps) reach the
    host only through ``runtime.on_host`` (:mod:`nxd_finetune.runtime`): at once on eager devices, in
    a step closure after the step's graph ran on XLA, where ``runtime.end_step()`` is the step's one
    ``mark_step``. ``history``: a resumed run's records, appended to. ``ckpt``
    (:class:`~nxd_finetune.checkpoint.training.TrainingCheckpoints`) saves after a step's logging and
    eval, and raises ``TrainingStopped`` after SIGTERM / SIGINT. Every step's loss and gradient
    norm (and every eval record) are checked: the first NaN or infinity stops the run in one line
    (:func:`~nxd_finetune.sft.step.stop_if_diverged`) before it is logged or checkpointed."""
    runtime = runtime or StepRuntime(engine.device)
    log_every = recipe.logging.every_n_steps
    progress = Progress(total_steps, show_progress and engine.is_logger, start=state.step)
    history = [] if history is None else history
    log = StepLog(state, history)  # the counters, the records and their throughput window
    hint = divergence_hint(recipe)

    def on_values(step: int, lr: float, logging: bool, sourced: dict[str, float], v: HostValues) -> None:
        """Token accounting, the finiteness check and, on logging steps, the record; ``v`` holds
        host values, ``sourced`` the source's own metrics (GRPO: rewards, completion lengths)."""
        counts, loss, grad_norm, extra = v["counts"], v.get("loss"), v.get("grad_norm"), v.get("objective")
        assert isinstance(counts, list)  # [targets, inputs]
        log.count(counts)
        stop_if_diverged(step, {"loss": loss, "grad_norm": grad_norm}, hint)
        if not logging:
            progress.update(step)
            return
        assert isinstance(loss, float) and (grad_norm is None or isinstance(grad_norm, float))
        # the objective's own metrics (preference: rewards/...)
        own = None if extra is None else objective.train_record([extra] if isinstance(extra, float) else extra)
        aux = v.get("aux_loss")  # the router auxiliary loss (output_router_logits), mean over the window's steps
        aux_rec = {} if not isinstance(aux, float) else {"aux_loss": aux}
        rec = log.record(step, loss, lr, grad_norm, {**(own or {}), **sourced}, peak_host_mb=host_peak_mb(), **aux_rec)
        metrics.log(step, rec)
        shown = objective.progress_metric  # the objective's own metric, e.g. rewards/accuracies
        more = f"  {shown} {rec[shown]:.2f}" if shown is not None and shown in rec else ""
        info = f"loss {rec['train_loss']:.4f}  lr {rec['lr']:.2e}  {rec['tokens_per_s']:.0f} tok/s"
        progress.update(step, info + more)

    sums: torch.Tensor | None = None  # the objective's metric sums since the last logging step
    engine.train(True)
    logged_at = state.step  # the last logging step (the window's start)
    try:
        while state.step < total_steps:
            micro_batches, n_input = source.next_step(engine, state.step + 1)
            micro_batches = [{k: v.to(engine.device) for k, v in b.items()} for b in micro_batches]
            result = train_step(engine, micro_batches, n_input, objective=objective)
            sums = add_stats(sums, result.stats, maxed_entries(objective))
            state.step += 1
            # every step's loss reaches the host (checked), as its counts already do: no extra sync
            values: dict[str, torch.Tensor | float | None] = {
                "counts": result.counts, "loss": engine.dp_sum(result.loss), "grad_norm": result.grad_norm}
            logging = state.step % log_every == 0 or state.step == total_steps
            if logging:
                # summed since the last logging step: the record's metrics cover the whole window
                values["objective"] = None if sums is None else engine.dp_sum(sums, maxed_entries(objective))
                sums = None
                aux = engine.take_aux_loss()
                if aux is not None:
                    values["aux_loss"] = engine.dp_sum(aux) / (state.step - logged_at)
                logged_at = state.step
            lr = float(engine.scheduler.get_last_lr()[0])
            sourced = source_metrics(source) if logging else {}
            runtime.on_host(functools.partial(on_values, state.step, lr, logging, sourced), values)
            runtime.end_step()
            if eval_fn is not None and recipe.eval.every_n_steps and state.step % recipe.eval.every_n_steps == 0:
                rec = eval_fn()
                stop_if_diverged(state.step, rec, hint)
                if rec:
                    metrics.log(state.step, rec)
                    history.append({"step": state.step, **rec})
            if ckpt is not None:
                ckpt.after_step(state, history)
    finally:
        progress.close()
    return history


# ---------------------------------------------------------------------- processes


def run(recipe: Recipe, source: SourceFactory | None = None) -> RunSummary | None:
    """Train as the recipe says; returns the summary (also written to ``<output.dir>/summary.json``).
    ``source``: makes each rank's batch source (:mod:`nxd_finetune.sft.source`; None: the train
    loader's); with ``nproc > 1`` it must pickle (a function or class at module level).

    ``parallel.nproc > 1`` outside a launched environment: the model and the tokenized data are
    prepared here once, then ``nproc`` workers are started (elastic launcher, spawn) and rank 0's
    summary is returned. Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) this
    process is one worker: the world size must equal ``parallel.nproc`` (or nproc is left at 1,
    and then taken from the world). A worker's failure is one NxdError line naming the rank.
    """
    restarts = recipe.parallel.max_restarts
    if in_launched_env():
        if restarts and os.environ.get("RANK") == "0":
            warnings.warn(f"parallel.max_restarts={restarts} is ignored under torchrun: its own --max-restarts "
                          "decides", NxdWarning, stacklevel=2)
        return run_rank(_recipe_for_world(recipe, int(os.environ["WORLD_SIZE"])), source)
    _preflight(recipe)
    if recipe.parallel.nproc == 1:
        if restarts:
            warnings.warn(f"parallel.max_restarts={restarts} is ignored with one process: restarts need the "
                          "elastic launcher's workers (--nproc 2 or more)", NxdWarning, stacklevel=2)
        return run_rank(recipe, source)
    prepare_shared(recipe)
    results = launch(_worker, recipe.parallel.nproc, recipe.to_dict(), source,
                     max_restarts=recipe.parallel.max_restarts)
    return results[0]


def export_spec(recipe: Recipe, model_dir: Path, tokenizer: PreTrainedTokenizerBase | None,
                reference: Identity | None = None) -> ExportSpec:
    """What the run's final artefact is (:mod:`nxd_finetune.export`): the recipe's save mode (full
    SFT: ``full``), the tensors of merged / full-SFT outputs in the training dtype, and as the
    adapter's base the model path, or for a ``builtin:`` model the local directory it is
    materialised in (which peft and vLLM can load). ``reference``: the identity of the reference
    the run was measured against (:func:`attach_reference`'s; None: from the recipe)."""
    path = recipe.model.path
    dtype = torch.bfloat16 if recipe.training.precision == "bf16" else resolve_dtype(recipe.model.dtype)
    return ExportSpec(mode="full" if recipe.lora is None else recipe.checkpoint.save_mode, source_dir=model_dir,
                      base_name=str(model_dir) if path.startswith("builtin:") else path, dtype=dtype,
                      revision=recipe.model.revision, tokenizer=tokenizer,
                      metadata={**objective_metadata(recipe, reference),
                                **quantization_metadata(recipe.model.quantization)})


def objective_metadata(recipe: Recipe, reference: Identity | None = None) -> dict[str, str]:
    """What a preference-tuned adapter records of its training (safetensors metadata, where PEFT
    does not look): the objective, its loss type and which reference model it was measured against
    (``nxd_reference``: ``base``, ``init_from:<source>`` with the source resolved, e.g. the
    registry version pulled, or ``none``; ``reference``: the identity the run used, else the
    recipe's). Empty for SFT."""
    record = objective_record(recipe.objective)
    if record.metadata is None:
        return {}
    init_from = recipe.lora.init_from if recipe.lora else None
    kind = run_reference(recipe)
    return {"nxd_objective": recipe.objective,
            "nxd_reference": reference_label(reference) if reference is not None else "none" if kind is None else
            f"init_from:{init_from}" if kind == "init_from" else kind,
            **record.metadata(section_of(recipe, record), init_from)}


def _worker(recipe_dict: RecipeDict, source: SourceFactory | None = None) -> RunSummary | None:
    show_warnings_as_lines()  # a worker's warnings as one line too
    return run_rank(recipe_from_dict(recipe_dict), source)


def _recipe_for_world(recipe: Recipe, world: int) -> Recipe:
    if recipe.parallel.nproc == world:
        return recipe
    if recipe.parallel.nproc != 1:
        raise NxdError(f"parallel.nproc={recipe.parallel.nproc} but the launcher started {world} processes")

    data = recipe.to_dict()
    data["parallel"]["nproc"] = world
    return recipe_from_dict(data, "launched world")


def _preflight(recipe: Recipe) -> None:
    """Checks that need no model, before any worker starts."""
    check_trackers(recipe)  # a missing mlflow / wandb package: one line naming the extra

    check_against_model(recipe, DecoderConfig.from_hf(resolve_model_dir(recipe.model.path)))

    check_device(recipe, required=True)  # the device is here and has what the recipe needs: one line
    check_cpu_formats(recipe)  # a warning line: bf16 on a CPU without bf16 instructions
    if recipe.output.registry:
        check_publish_target(recipe.output.registry, None if recipe.lora is None else recipe.checkpoint.save_mode)


def prepare_shared(recipe: Recipe) -> None:
    """Build what workers would race to create: the builtin model and the tokenized-data cache."""
    model_dir = resolve_model_dir(recipe.model.path)
    prepare_datasets(DataSpec.from_recipe(recipe), load_tokenizer(recipe, model_dir))


def run_rank(recipe: Recipe, source: SourceFactory | None = None) -> RunSummary | None:
    """One process of the run (world size 1 included), its steps from ``source``'s batch source
    (None: the train loader's). Returns the summary on global rank 0."""
    t0 = time.perf_counter()
    par = recipe.parallel
    rr = setup_rank(recipe, checkpoints=True, source=source)
    engine, runtime, device, rank = rr.engine, rr.runtime, rr.device, rr.rank
    model_dir, tokenizer, data, total_steps = rr.model_dir, rr.tokenizer, rr.data, rr.total_steps
    out_dir = Path(recipe.output.dir)

    # --- after-training hooks: eval.prompts generations (serve/samples.py), trackers (trackers.py)

    samples = EvalSamples.for_run(recipe, engine, model_dir, tokenizer)
    lazy: LazyReference | None = None

    def eval_fn() -> dict[str, float]:
        if samples is not None:
            samples.log(metrics, state.step)  # collective; rank 0 logs
        if data.eval is None:
            return {}
        if lazy is not None:
            lazy.complete("eval")  # preference: the eval pairs' reference log-probs, at the first eval
        return evaluate(engine, rr.objective, iter(data.eval), recipe.eval.max_batches, runtime)

    batches, ckpt = rr.source, rr.checkpoints
    assert batches is not None and ckpt is not None  # setup_rank(checkpoints=True)
    # preference tuning with a reference model: a pair's reference log-probs at the step that first
    # uses it, stored (a resumed run: the reference it started with, whatever lora.init_from says now)
    reference, lazy = lazy_reference(recipe, engine, data, model_dir, started=ckpt.started_reference())
    ckpt.reference = reference  # saved with every checkpoint
    if lazy is not None:
        batches = ReferenceSource(batches, lazy)  # the checkpoints keep the inner source's state

    n_params = _count(engine, engine.parameters())
    n_trainable = _count(engine, engine.trainable())
    state = TrainState()
    resumed = ckpt.resume(state)  # before the metrics writer opens: cuts its files back to the checkpoint

    trackers = open_trackers(recipe, out_dir, resumed=resumed is not None) if engine.is_logger else []
    metrics = MetricsWriter(out_dir, recipe.logging.tensorboard, enabled=engine.is_logger, trackers=trackers)
    history = resumed.history if resumed else []
    before = resumed.eval_before if resumed else eval_fn() if recipe.eval.before else {}
    stop_if_diverged(0, before, "the starting model's scores are not finite: check its weights (and lora.init_from)")
    if before and not resumed:
        metrics.log(0, before)
        history.append({"step": 0, **before})  # checkpoints carry it with the history
    t_first = time.perf_counter() - t0
    tokens_before = state.input_tokens  # a resumed run's earlier tokens are not this run's throughput
    try:
        history = train(engine, batches, total_steps, recipe, metrics, eval_fn if data.eval is not None else None,
                        state, recipe.logging.progress, runtime, ckpt, history, objective=rr.objective)
        ckpt.finish(state, history)
    except BaseException:
        metrics.close()  # what was logged reaches its files (TensorBoard's buffered events too)
        raise
    finally:
        ckpt.close()
    batches.close()
    after = eval_fn()
    if after and not (history and history[-1].get("eval_loss") == after.get("eval_loss")):
        metrics.log(state.step, after)
    metrics.close()
    if engine.is_logger:
        write_loss_curve(metrics.path, out_dir / "loss_curve.svg", f"{recipe.model.path}: loss")
    train_time = time.perf_counter() - t0 - t_first
    train_peak = host_peak_mb()
    final_dir = out_dir / "final"

    runtime.wait()
    export_model(engine.rank_model, final_dir, export_spec(recipe, model_dir, tokenizer, reference),
                 config=engine.config, lora=engine.lora_config, lora_targets=engine.lora_targets,
                 pp_group=engine.state.host_group("pp"))
    memory = gather_peak_memory(rank_memory(rank, device, train_peak), rr.layout.host_group())
    if not engine.is_logger:
        return None
    losses = [h["train_loss"] for h in history if "train_loss" in h]
    history_steps = [int(h["step"]) for h in history if "train_loss" in h]
    summary: RunSummary = {
        "steps": state.step, "loss_tokens": state.tokens, "input_tokens": state.input_tokens,
        "parameters": n_params, "trainable_parameters": n_trainable,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "eval_before": before, "eval_after": after,
        "time_to_first_step_s": round(t_first, 2), "train_time_s": round(train_time, 2),
        "input_tokens_per_s": (round((state.input_tokens - tokens_before) / max(train_time, 1e-9), 1)
                               if state.input_tokens > tokens_before else None),
        "first_loss_step": history_steps[0] if history_steps else None,
        "data": data.stats, "output": str(final_dir), "save_mode": recipe.checkpoint.save_mode,
        "lora_targets": engine.lora_targets, "objective": recipe.objective,
        "reference": str(reference["reference"]) if reference is not None else None,
        "parallel": {"nproc": engine.state.world_size, "tp": par.tp, "pp": par.pp, "dp": par.dp, "ep": par.ep,
                     "zero1": par.zero1, "sequence_parallel": par.sequence_parallel},
        "history": [h for h in history if "train_loss" in h],
        "memory": memory,
        "checkpoints": ckpt.uri, "resumed_from": resumed.ref.uri if resumed else None,
        **runtime.report(),  # xla: graphs compiled / launched after each step
    }
    if recipe.output.registry:
        summary["registry_version"] = _publish(recipe, recipe.output.registry, engine, final_dir, summary)
    save_summary(out_dir, summary)
    metrics.finish(summary)  # trackers: the final artefact / registry ref, run ended
    print_summary(summary)
    return summary


def _count(engine: Engine, params: list[torch.nn.Parameter]) -> int:
    """Elements of the unsharded model among ``params`` (shards counted at their full size, once
    per pipeline stage). Collective over the axes of ``norm_axes`` (the engine's host groups: a CPU tensor)."""
    specs: dict[int, Placement] = {}
    for m in engine.modules:
        specs.update(placement_map(m))
    st = engine.state
    axes = norm_axes(st, [placement_of(p, specs) for p in params])
    counted = [p for p in params if counts_on_rank(placement_of(p, specs), st, axes)]
    skip = {id(p) for p in (engine.runner.not_counted_parameters() if engine.runner else [])}
    mine = sum(parameter_elements(p) for p in counted if id(p) not in skip)  # a 4-bit weight: its own shape
    total = torch.tensor(float(mine), dtype=torch.float64)
    for axis in axes:
        dist.all_reduce(total, group=st.host_group(axis))
    return int(total)


def _publish(recipe: Recipe, registry: str, engine: Engine, final_dir: Path, summary: RunSummary) -> int:
    metrics = {"steps": summary["steps"], "loss_tokens": summary["loss_tokens"], "first_loss": summary["first_loss"],
               "final_loss": summary["final_loss"], "eval_after": summary["eval_after"]}
    version = publish_run(final_dir, registry, recipe_dict=recipe.to_dict(),
                          metrics=metrics, parallel=summary["parallel"],
                          lineage=engine.lineage,
                          base_model={"name_or_path": recipe.model.path, "revision": recipe.model.revision})
    return version.version

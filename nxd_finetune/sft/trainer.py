"""The training loop: one code path for every world size (this version runs world size 1).

``run(recipe)`` builds the model (meta device -> HF weights -> LoRA), the data for this rank, the
optimizer and LR schedule, then loops: gradient accumulation over micro-batches, grad-norm
clipping, optimizer step, logging, eval, final save in the chosen mode.

Loss normalisation: every micro-batch loss is a *sum* over its target tokens divided by the number
of target tokens in the whole optimizer step, so the step's gradient is that of the token-mean over
the global batch whatever the split into micro-batches (and, later, over data-parallel ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from nxd_finetune.errors import NxdError
from nxd_finetune.sft.loss import IGNORE_INDEX, causal_lm_loss, shift_labels
from nxd_finetune.sft.metrics import MetricsWriter, Progress


@dataclasses.dataclass
class TrainState:
    """Counters that a checkpoint must carry to resume exactly."""

    step: int = 0
    tokens: int = 0  # target (loss-bearing) tokens consumed
    input_tokens: int = 0  # non-padding tokens consumed


def pick_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu. ``xla`` comes with the Trainium backend."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise NxdError("training.device=cuda but no CUDA device is visible")
    if name == "xla":
        raise NxdError("training.device=xla is not available in this version; use cpu or cuda")
    return torch.device(name)


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision in ("bf16", "bf16-mixed"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], n_targets: torch.Tensor,
               device: torch.device, precision: str) -> torch.Tensor:
    """Forward + backward of one micro-batch; returns its summed loss / ``n_targets`` (detached)."""
    with _autocast(device, precision):
        logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))
    loss = causal_lm_loss(logits, batch["labels"], reduction="sum") / n_targets
    loss.backward()
    return loss.detach()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterator[dict[str, torch.Tensor]], device: torch.device,
             precision: str, max_batches: int | None) -> dict[str, float]:
    """Token-mean eval loss, perplexity and next-token accuracy over target tokens."""
    model.eval()
    loss_sum, n, correct = 0.0, 0, 0
    for i, batch in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        with _autocast(device, precision):
            logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))
        targets = shift_labels(batch["labels"])
        mask = targets != IGNORE_INDEX
        loss_sum += causal_lm_loss(logits, batch["labels"], reduction="sum").item()
        correct += ((logits.argmax(-1) == targets) & mask).sum().item()
        n += int(mask.sum())
    model.train()
    if n == 0:
        return {}
    loss = loss_sum / n
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_accuracy": correct / n}


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    steps: Iterator[tuple[list[dict[str, torch.Tensor]], int]],
    total_steps: int,
    recipe: Any,
    device: torch.device,
    metrics: MetricsWriter,
    eval_fn: Any,
    state: TrainState,
    show_progress: bool,
) -> list[dict[str, Any]]:
    """The optimizer-step loop. ``steps`` yields, per optimizer step, the list of micro-batches and
    their number of non-padding tokens (counted on the host, so no device sync).
    Returns the logged records. ``.item()`` is called only on logging steps."""
    tcfg, log_every = recipe.training, recipe.logging.every_n_steps
    trainable = [p for p in model.parameters() if p.requires_grad]
    progress = Progress(total_steps, show_progress, start=state.step)
    history: list[dict[str, Any]] = []
    window_start, window_tokens = time.perf_counter(), 0
    model.train()
    try:
        while state.step < total_steps:
            micro_batches, n_input = next(steps)
            micro_batches = [{k: v.to(device) for k, v in b.items()} for b in micro_batches]
            n_targets = sum((shift_labels(b["labels"]) != IGNORE_INDEX).sum() for b in micro_batches)
            n_targets = n_targets.clamp(min=1)
            loss = sum(micro_step(model, b, n_targets, device, tcfg.precision) for b in micro_batches)
            grad_norm = (torch.nn.utils.clip_grad_norm_(trainable, tcfg.grad_clip)
                         if tcfg.grad_clip else None)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.input_tokens += n_input
            window_tokens += n_input
            state.tokens += int(n_targets)
            if state.step % log_every == 0 or state.step == total_steps:
                elapsed = time.perf_counter() - window_start
                rec = {"train_loss": float(loss), "lr": scheduler.get_last_lr()[0],
                       "tokens_per_s": window_tokens / max(elapsed, 1e-9), "tokens": state.tokens}
                if grad_norm is not None:
                    rec["grad_norm"] = float(grad_norm)
                window_start, window_tokens = time.perf_counter(), 0
                metrics.log(state.step, rec)
                history.append({"step": state.step, **rec})
                progress.update(state.step, f"loss {rec['train_loss']:.4f}  lr {rec['lr']:.2e}  "
                                            f"{rec['tokens_per_s']:.0f} tok/s")
            else:
                progress.update(state.step)
            if eval_fn is not None and recipe.eval.every_n_steps and state.step % recipe.eval.every_n_steps == 0:
                rec = eval_fn()
                if rec:
                    metrics.log(state.step, rec)
                    history.append({"step": state.step, **rec})
    finally:
        progress.close()
    return history


def save_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _step_batches(
    train_loader: Any, grad_accum: int, packing: bool
) -> Iterator[tuple[list[dict[str, torch.Tensor]], int]]:
    """Group the endless micro-batch stream into optimizer steps. Unpacked rows hold one sample
    each and are right-padded, so causal attention alone already keeps tokens off the padding:
    their segment ids are dropped to keep the fast ``is_causal`` attention path."""
    it = iter(train_loader)
    while True:
        step, n_tokens = [], 0
        for _ in range(grad_accum):
            batch = next(it)
            n_tokens += int((batch["segment_ids"] > 0).sum())
            if not packing:
                batch = {k: v for k, v in batch.items() if k != "segment_ids"}
            step.append(batch)
        yield step, n_tokens


def run(recipe: Any) -> dict[str, Any]:
    """Train as the recipe says; returns the summary (also written to ``<output.dir>/summary.json``)."""
    from nxd_finetune.sft.build import build_optimizer, build_training_model, load_tokenizer, resolve_model_dir
    from nxd_finetune.sft.loader import build_dataloaders

    if recipe.parallel.nproc != 1:
        raise NxdError(f"parallel.nproc={recipe.parallel.nproc}: multi-process runs are not available in this "
                       "version; use parallel.nproc=1")
    t0 = time.perf_counter()
    out_dir = Path(recipe.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "recipe.yaml").write_text(recipe.to_yaml())
    tcfg = recipe.training
    device = pick_device(tcfg.device)
    if device.type == "cpu":
        # Adam's second moments and tiny gradients reach subnormal floats, which x86 CPUs handle
        # ~100x slower; flushing them to zero changes no result at the loss's precision.
        torch.set_flush_denormal(True)
    torch.manual_seed(tcfg.seed)

    model_dir = resolve_model_dir(recipe.model.path)
    tokenizer = load_tokenizer(recipe, model_dir)
    built = build_training_model(recipe, model_dir, device)
    model = built.model
    data = build_dataloaders(recipe.data, tokenizer, micro_batch_size=tcfg.micro_batch_size,
                             seed=tcfg.seed, fixed_shape=False)
    grad_accum = recipe.grad_accum_steps
    if tcfg.max_steps:
        total_steps = tcfg.max_steps
    else:
        total_steps = max(1, math.ceil((tcfg.epochs or 1.0) * data.train.batches_per_epoch / grad_accum))
    optimizer, scheduler = build_optimizer(model, recipe, total_steps)

    def eval_fn() -> dict[str, float]:
        if data.eval is None:
            return {}
        return evaluate(model, iter(data.eval), device, tcfg.precision, recipe.eval.max_batches)

    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    metrics = MetricsWriter(out_dir, recipe.logging.tensorboard)
    before = eval_fn()
    if before:
        metrics.log(0, before)
    state = TrainState()
    t_first = time.perf_counter() - t0
    history = train(model, optimizer, scheduler, _step_batches(data.train, grad_accum, recipe.data.packing),
                    total_steps, recipe, device, metrics, eval_fn if data.eval is not None else None, state,
                    recipe.logging.progress)
    after = eval_fn()
    if after and not (history and history[-1].get("eval_loss") == after.get("eval_loss")):
        metrics.log(state.step, after)
    metrics.close()
    train_time = time.perf_counter() - t0 - t_first
    final_dir = out_dir / "final"
    _save_final(recipe, built, tokenizer, model_dir, final_dir)
    losses = [h["train_loss"] for h in history if "train_loss" in h]
    summary = {
        "steps": state.step, "tokens": state.tokens, "input_tokens": state.input_tokens,
        "parameters": n_params, "trainable_parameters": n_trainable,
        "first_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "eval_before": before, "eval_after": after,
        "time_to_first_step_s": round(t_first, 2), "train_time_s": round(train_time, 2),
        "tokens_per_s": round(state.input_tokens / max(train_time, 1e-9), 1),
        "data": data.stats, "output": str(final_dir), "save_mode": recipe.checkpoint.save_mode,
        "lora_targets": built.lora_targets,
    }
    save_summary(out_dir, summary)
    print_summary(summary)
    return summary


def _save_final(recipe: Any, built: Any, tokenizer: Any, model_dir: Path, final_dir: Path) -> None:
    """Write the end-of-run artefact: LoRA in the recipe's save mode, or a full HF checkpoint."""
    if built.lora_config is not None:
        from nxd_finetune.lora import save_model

        save_model(built.model, built.lora_config, final_dir, recipe.checkpoint.save_mode,
                   base_model_name_or_path=recipe.model.path, base_config=built.config,
                   tokenizer=tokenizer, revision=recipe.model.revision)
        return
    from nxd_finetune.models import save_pretrained

    save_pretrained(built.config, built.model.state_dict().items(), final_dir)
    tokenizer.save_pretrained(final_dir)


def print_summary(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="nxd-finetune run", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")

    def fmt(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)

    for key in ("steps", "tokens", "parameters", "trainable_parameters", "first_loss", "final_loss",
                "time_to_first_step_s", "train_time_s", "tokens_per_s"):
        table.add_row(key.replace("_", " "), fmt(summary[key]))
    for when in ("before", "after"):
        ev = summary[f"eval_{when}"]
        if ev:
            table.add_row(f"eval {when}", f"loss {ev['eval_loss']:.4f}  ppl {ev['eval_ppl']:.2f}  "
                                          f"token acc {ev['eval_accuracy']:.3f}")
    table.add_row("saved", f"{summary['output']} ({summary['save_mode']})")
    Console(stderr=True).print(table)

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
    steps: Iterator[list[dict[str, torch.Tensor]]],
    total_steps: int,
    recipe: Any,
    device: torch.device,
    metrics: MetricsWriter,
    eval_fn: Any,
    state: TrainState,
    show_progress: bool,
) -> list[dict[str, Any]]:
    """The optimizer-step loop. ``steps`` yields, per optimizer step, the list of micro-batches.
    Returns the logged records. ``.item()`` is called only on logging steps."""
    tcfg, log_every = recipe.training, recipe.logging.every_n_steps
    trainable = [p for p in model.parameters() if p.requires_grad]
    progress = Progress(total_steps, show_progress, start=state.step)
    history: list[dict[str, Any]] = []
    window_start, window_tokens = time.perf_counter(), 0
    model.train()
    try:
        while state.step < total_steps:
            micro_batches = next(steps)
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
            n_input = _non_pad_tokens(micro_batches)
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


def _non_pad_tokens(micro_batches: list[dict[str, torch.Tensor]]) -> int:
    """Tokens that are not padding: the data pipeline marks padding with ``attention_mask`` = 0
    when it provides one, else every position counts."""
    total = 0
    for b in micro_batches:
        if "attention_mask" in b:
            total += int(b["attention_mask"].sum())
        else:
            total += b["input_ids"].numel()
    return total


def save_summary(out_dir: Path, summary: dict[str, Any]) -> None:
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))

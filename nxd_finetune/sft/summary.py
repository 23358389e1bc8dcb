"""The end-of-run summary: ``summary.json`` and the table printed for people.

Names say what they count: ``loss_tokens`` are the target tokens the loss was taken over (answers,
end-of-turn), ``input_tokens`` every non-padding token fed to the model; ``input_tokens_per_s`` is
the training throughput over input tokens of this process's steps (a resumed run's earlier steps
are not counted; None when it ran no step). ``first_loss`` is the train loss logged at
``first_loss_step``. ``memory`` holds each rank's measured peak host memory (over the run and
up to the end of training) and, on CUDA, its peak device memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from nxd_finetune.runtime import RuntimeReport

if TYPE_CHECKING:
    from nxd_finetune.sft.memory import RankMemory


class LayoutSummary(TypedDict):
    """The run's process layout."""

    nproc: int
    tp: int
    pp: int
    dp: int
    ep: int
    zero1: bool
    sequence_parallel: bool


class _Published(TypedDict, total=False):
    registry_version: int  # the version pushed (output.registry)


class RunSummary(RuntimeReport, _Published):
    """``summary.json`` (see the module docstring); ``history``: the logged training records,
    ``data``: the datasets' statistics per split, ``checkpoints`` / ``resumed_from``: URIs."""

    steps: int
    loss_tokens: int
    input_tokens: int
    parameters: int
    trainable_parameters: int
    first_loss: float | None
    final_loss: float | None
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    time_to_first_step_s: float
    train_time_s: float
    input_tokens_per_s: float | None
    first_loss_step: int | None
    data: dict[str, dict[str, Any]]
    output: str
    save_mode: str
    lora_targets: list[str]
    objective: str
    reference: str | None
    parallel: LayoutSummary
    history: list[dict[str, float]]
    memory: list[RankMemory]
    checkpoints: str
    resumed_from: str | None


def save_summary(out_dir: Path, summary: RunSummary) -> None:
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:,.2f} s"


def _loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _peak(ranks: list[RankMemory]) -> str:
    top = max(ranks, key=lambda r: r["peak_host_mb"])
    text = f"{top['peak_host_mb'] / 1024:,.2f} GiB"
    if len(ranks) > 1:
        text += f" (rank {top['rank']}, the highest of {len(ranks)})"
    device = [mb for r in ranks if (mb := r.get("peak_device_mb")) is not None]
    return text + (f"; device {max(device) / 1024:,.2f} GiB" if device else "")


def summary_rows(summary: RunSummary) -> list[tuple[str, str]]:
    """The printed table's rows (label, value), numbers formatted for people."""
    p = summary["parallel"]
    rows = [
        ("steps", _count(summary["steps"])),
        ("loss tokens (trained)", _count(summary["loss_tokens"])),
        ("input tokens", _count(summary["input_tokens"])),
        ("parameters", f"{_count(summary['trainable_parameters'])} trainable of {_count(summary['parameters'])}"),
        (f"first loss (step {summary.get('first_loss_step') or '-'})", _loss(summary["first_loss"])),
        (f"final loss (step {summary['steps']})", _loss(summary["final_loss"])),
        ("time to first step", _seconds(summary["time_to_first_step_s"])),
        ("training time", _seconds(summary["train_time_s"])),
        ("throughput", "-" if summary["input_tokens_per_s"] is None
                       else f"{summary['input_tokens_per_s']:,.0f} input tokens/s"),
        ("layout", f"{p['nproc']} process(es): tp {p['tp']} x pp {p['pp']} x dp {p['dp']}"
                   + ("  zero1" if p["zero1"] else "") + ("  sp" if p["sequence_parallel"] else "")),
    ]
    if summary.get("memory"):
        rows.append(("peak host memory", _peak(summary["memory"])))
    for when, ev in (("before", summary["eval_before"]), ("after", summary["eval_after"])):
        if ev and "eval_ppl" in ev:
            rows.append((f"eval {when}", f"loss {ev['eval_loss']:.4f}  ppl {ev['eval_ppl']:.2f}  "
                                         f"token acc {ev['eval_accuracy']:.3f}"))
        elif ev and "eval_rewards/accuracies" in ev:  # a preference objective
            acc, margin = ev["eval_rewards/accuracies"], ev["eval_rewards/margins"]
            rows.append((f"eval {when}", f"loss {ev['eval_loss']:.4f}  preference acc {acc:.3f}  margin {margin:.4f}"))
        elif ev:  # another objective: its eval record as it is
            rows.append((f"eval {when}", "  ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in ev.items())))
    rows.append(("saved", f"{summary['output']} ({summary['save_mode']})"))
    if "registry_version" in summary:
        rows.append(("published", f"{summary['registry_version']}"))
    return rows


def print_summary(summary: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="nxd-finetune run", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    Console(stderr=True).print(table)

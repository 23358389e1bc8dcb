"""Run metrics: a JSONL file (one object per logged step), optional TensorBoard scalars, the
experiment trackers of :mod:`nxd_finetune.trackers` (MLflow, W&B), and the rich progress bar.
Only rank 0 of a run writes.

A resume cuts the JSONL file and TensorBoard back to the checkpoint's step (:func:`truncate_metrics`,
:func:`purge_tensorboard`, called by ``checkpoint.training``), so no step is logged twice; the
loss-curve picture drawn from the JSONL file at the end of a run is the trainer's
(:mod:`nxd_finetune.sft.curve`)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nxd_finetune.errors import NxdError

if TYPE_CHECKING:
    from nxd_finetune.trackers import Sample, Tracker

METRICS_FILE = "metrics.jsonl"
SAMPLES = "eval_samples"  # a record key holding [{"prompt", "completion"}, ...] (eval.prompts), not a number


class MetricsWriter:
    """Appends ``{"step": ..., <name>: value}`` lines to ``<dir>/metrics.jsonl`` and, when asked,
    scalars to ``<dir>/tensorboard`` and to ``trackers`` (:mod:`nxd_finetune.trackers`). Values
    must already be Python numbers (callers convert once per logged step, never per micro-batch),
    except :data:`SAMPLES`, a list of generations: a TensorBoard text table and a tracker table."""

    def __init__(self, out_dir: Path, tensorboard: bool, enabled: bool = True,
                 trackers: Sequence[Tracker] = ()) -> None:
        self.enabled = enabled
        self.path = out_dir / METRICS_FILE
        self.trackers = list(trackers) if enabled else []
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise NxdError(
                    "logging.tensorboard=true needs the tensorboard package: pip install 'nxd-finetune[tensorboard]'"
                ) from None
            self._tb = SummaryWriter(str(out_dir / "tensorboard"))
        if enabled:
            out_dir.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")

    def log(self, step: int, values: Mapping[str, float | Sequence[Sample]]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        found = values.get(SAMPLES)
        samples = found if isinstance(found, Sequence) else None  # the value of SAMPLES: a list of rows
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k.replace("_", "/", 1) if k.startswith(("train_", "eval_")) else k, v, step)
            if samples:
                self._tb.add_text("eval/samples", _markdown_table(samples), step)
        for tracker in self.trackers:
            if numbers:
                tracker.log(step, numbers)
            if samples:
                tracker.log_samples(step, samples)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    def finish(self, summary: Mapping[str, object] | None) -> None:
        """End the tracker runs: the final artefact from ``summary`` (None: the run failed)."""
        for tracker in self.trackers:
            tracker.finish(summary)
        self.trackers = []


def _markdown_table(rows: Sequence[Mapping[str, str]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| prompt | completion |", "| --- | --- |"]
    lines += [f"| {cell(r['prompt'])} | {cell(r['completion'])} |" for r in rows]
    return "\n".join(lines)


def truncate_metrics(out_dir: Path, size: int | None) -> None:
    """Cut ``metrics.jsonl`` back to ``size`` bytes (its size when the checkpoint was taken), so
    steps after the checkpoint are not logged twice; ``None`` (a fresh start) empties it."""
    path = out_dir / METRICS_FILE
    if not path.exists():
        return
    if size is None or path.stat().st_size > size:
        with open(path, "r+b") as f:
            f.truncate(size or 0)


def purge_tensorboard(out_dir: Path, step: int) -> None:
    """Hide TensorBoard events of steps after ``step`` written by the interrupted run (the
    ``purge_step`` mechanism of ``SummaryWriter``: a session-start event at ``step + 1``)."""
    log_dir = out_dir / "tensorboard"
    if not log_dir.is_dir():
        return
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    from torch.utils.tensorboard.writer import FileWriter

    writer = FileWriter(str(log_dir))
    writer.add_event(Event(step=step + 1, file_version="brain.Event:2"))
    writer.add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
    writer.close()


class Progress:
    """A rich progress bar over optimizer steps showing loss, lr and tokens/s; a no-op when
    disabled (non-zero ranks, ``logging.progress: false``)."""

    def __init__(self, total: int, enabled: bool, start: int = 0) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TimeRemainingColumn(), transient=False,
        )
        self._task = self._bar.add_task("train", total=total, completed=start, info="")
        self._bar.start()

    def update(self, step: int, info: str = "") -> None:
        if self.enabled:
            self._bar.update(self._task, completed=step, info=info)

    def close(self) -> None:
        if self.enabled:
            self._bar.stop()

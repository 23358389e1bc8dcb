"""Run metrics: a JSONL file (one object per logged step), optional TensorBoard scalars, and the
rich progress bar. Only rank 0 of a run writes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nxd_finetune.errors import NxdError


class MetricsWriter:
    """Appends ``{"step": ..., <name>: value}`` lines to ``<dir>/metrics.jsonl`` and, when asked,
    scalars to ``<dir>/tensorboard``. Values must already be Python numbers (callers convert once
    per logged step, never per micro-batch)."""

    def __init__(self, out_dir: Path, tensorboard: bool, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
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

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3), **values}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k.replace("_", "/", 1) if k.startswith(("train_", "eval_")) else k, v, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()


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

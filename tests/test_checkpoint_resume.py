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
import re
import signal
import threading
import time
import xml.etree.ElementTree as ET

import pytest
import torch
from cli_run import QUICKSTART, RUN, STEPS, curve, env, finish, records, resumed_from, signal_when_logged, start  # noqa: F401

from nxd_finetune.checkpoint.format import decode_extra, dumps, encode_extra
from nxd_finetune.checkpoint.training import StopSignals, rng_state, set_rng_state
from nxd_finetune.metrics import purge_tensorboard, truncate_metrics
from nxd_finetune.sft.curve import read_series, write_loss_curve

pytestmark = pytest.mark.usefixtures("one_thread_and_tmpdir")


def test_rng_state_survives_the_extra_encoding():
    torch.manual_seed(3)
    random.seed(4)
    torch.rand(5)
    saved = rng_state()
    data, tensors = encode_extra({"rng": saved})
    restored = decode_extra(json.loads(dumps(data)), tensors)["rng"]
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


# ----------------------------------------------------------------------------- end to end: the CLI


def test_cli_killed_with_sigkill_resumes_to_identical_adapter_and_curve(env, tmp_path):  # noqa: F811
    ref_out, out = tmp_path / "uninterrupted", tmp_path / "interrupted"
    reference = start(env, ref_out)  # runs beside the interrupted runs (two cores)
    ckpts = out / "checkpoints"
    # 1. SIGKILL during the save of step 4: its files are written, its manifest is not
    code, log = finish(start(env, out, failpoint="before-manifest:4"))
    assert code == -signal.SIGKILL, log
    assert (ckpts / "step-00000004" / "state-pp00.safetensors").exists()
    assert not (ckpts / "step-00000004" / "manifest.json").exists()
    # 2. resumes from step 2 (step 4 is incomplete), saving in the background this time; SIGKILL
    #    from outside once step 5 is logged (run 1 logged step 4 already: not a sign of run 2)
    proc = start(env, out, "checkpoint.async_save=true")
    signal_when_logged(proc, out, 5)
    code, log = finish(proc)
    assert code == -signal.SIGKILL and resumed_from(log) == 2, log
    # 3. resumes from the newest complete checkpoint (4; 6 if the kill came late) and finishes
    code, log = finish(start(env, out))
    assert code == 0 and resumed_from(log) in (4, 6), log
    code, log = finish(reference)
    assert code == 0, log

    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / "final" / name).read_bytes() == (ref_out / "final" / name).read_bytes(), name
    assert curve(out) == curve(ref_out)  # train and eval losses, exactly, in the same order
    assert [r["step"] for r in records(out) if "train_loss" in r] == list(range(1, STEPS + 1))  # each step once
    assert [r["step"] for r in records(out) if "eval_loss" in r] == [0, 3, 6]
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (out, ref_out))

    def losses(s: dict) -> list[tuple]:
        return [(h["step"], h["train_loss"], h["lr"], h["tokens"]) for h in s["history"]]

    assert losses(summary) == losses(ref_summary) and summary["loss_tokens"] == ref_summary["loss_tokens"]
    assert summary["eval_before"] == ref_summary["eval_before"] and summary["eval_after"] == ref_summary["eval_after"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000004", "step-00000006"]  # keep_last=2
    svg = ET.parse(out / "loss_curve.svg").getroot()
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 2
    assert summary["input_tokens"] == ref_summary["input_tokens"] and summary["input_tokens_per_s"] > 0
    # 4. the same command once more: the run is finished, no step runs, so there is no throughput
    #    (not the earlier runs' tokens over this run's zero training time)
    code, log = finish(start(env, out))
    again = json.loads((out / "summary.json").read_text())
    assert code == 0 and again["steps"] == STEPS and again["input_tokens_per_s"] is None, log
    assert re.search(r"throughput\s+│ -\s", log), log


def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(env, tmp_path, monkeypatch):  # noqa: F811
    from nxd_finetune.checkpoint.training import TrainingStopped
    from nxd_finetune.recipe import load_recipe
    from nxd_finetune.sft import trainer

    monkeypatch.setenv("NXD_FINETUNE_CACHE", env["NXD_FINETUNE_CACHE"])
    out = tmp_path / "out"
    recipe = load_recipe(QUICKSTART, [*RUN, f"output.dir={out}", "checkpoint.every_n_steps=100"])

    def send_when_logged() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            path = out / "metrics.jsonl"
            if path.exists() and '"step": 2,' in path.read_text():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.005)

    before = signal.getsignal(signal.SIGTERM)
    sender = threading.Thread(target=send_when_logged)
    sender.start()
    with pytest.raises(TrainingStopped) as stopped:
        trainer.run(recipe)
    sender.join()
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert str(stopped.value) == (f"stopped by SIGTERM after step {step}; checkpoint saved to {out / 'checkpoints'}. "
                                  "Resume: run the same command again (same recipe and output.dir), or add "
                                  f"--resume {out / 'checkpoints'}/step-{step:08d}")
    assert stopped.value.exit_code == 143 and 2 <= step < STEPS
    manifest = json.loads((out / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
    assert manifest["step"] == step and not (out / "final").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_a_signal_to_the_launcher_reads_as_a_stop_with_the_resume_hint(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from nxd_finetune.checkpoint.training import TrainingStopped, as_training_stopped
    from nxd_finetune.recipe import load_recipe

    recipe = load_recipe(QUICKSTART, [f"output.dir={tmp_path}"])
    stopped = as_training_stopped(SignalException("got signal", sigval=signal.SIGTERM), recipe)
    assert stopped.exit_code == 143 and str(stopped).startswith(
        f"stopped by SIGTERM; the workers saved a checkpoint to {tmp_path / 'checkpoints'}")
    own = TrainingStopped("x", signal.SIGINT)
    assert as_training_stopped(own, recipe) is own and own.exit_code == 130
    assert as_training_stopped(ValueError("no"), recipe) is None


@pytest.mark.parametrize("where", ["local", "s3"])
def test_training_hooks_save_every_n_resume_a_given_step_and_drop_later_ones(tmp_path, capsys, request, where):
    """``TrainingCheckpoints`` on real pieces (tiny model, AdamW, LambdaLR, the resumable sampler)
    without the trainer: saves every 2 steps and at the end, resumes an earlier step by path;
    ``checkpoint.dir`` local or ``s3://`` (moto over HTTP)."""
    from types import SimpleNamespace

    from checkpoint_helpers import make_run, train, trainable

    from nxd_finetune.checkpoint.training import TrainingCheckpoints
    from nxd_finetune.data.sampler import ResumableSampler
    from nxd_finetune.parallel import Layout, ParallelState
    from nxd_finetune.recipe import load_recipe
    from nxd_finetune.sft.trainer import TrainState

    def pieces(resume: str | None):
        model, opt, sched = make_run(seed=7)
        recipe = load_recipe(QUICKSTART, [f"output.dir={tmp_path}", f"checkpoint.dir={ckpt_dir}",
                                          "checkpoint.keep_last=3", "checkpoint.every_n_steps=2",
                                          f"checkpoint.resume={resume}"])
        engine = SimpleNamespace(state=ParallelState(Layout.of()), modules=[model], optimizer=opt, scheduler=sched,
                                 device=torch.device("cpu"))
        sampler = ResumableSampler(50, 4, seed=1)
        return TrainingCheckpoints(recipe, engine, tmp_path, sampler), engine, sampler, model

    ckpt_dir = tmp_path / "checkpoints" if where == "local" else "s3://nxd-test/hooks"
    if where == "s3":
        request.getfixturevalue("moto_s3")
    metrics, snapshots = tmp_path / "metrics.jsonl", {}
    ckpt, engine, sampler, model = pieces("latest")
    state, history = TrainState(), []
    assert ckpt.resume(state) is None
    batches = iter(sampler)
    try:
        for _ in range(5):
            next(batches)
            train(model, engine.optimizer, engine.scheduler, 1)
            state.step, state.tokens = state.step + 1, state.tokens + 10
            history.append({"step": state.step, "train_loss": 1.0 / state.step})
            with metrics.open("a") as f:
                f.write(json.dumps(history[-1]) + "\n")
            snapshots[state.step] = (trainable(model), sampler.state_dict())
            ckpt.after_step(state, history)
        ckpt.finish(state, history)
    finally:
        ckpt.close()
    assert ckpt.manager.steps() == [2, 4, 5]

    ckpt, engine, sampler, model = pieces(f"{ckpt_dir}/step-00000002")
    state = TrainState()
    resumed = ckpt.resume(state)
    ckpt.close()
    assert (state.step, state.tokens) == (2, 20) and resumed.history == history[:2]
    assert sampler.state_dict() == snapshots[2][1]
    assert all(torch.equal(p, snapshots[2][0][n]) for n, p in trainable(model).items())
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2]
    assert ckpt.manager.steps() == [2] and ckpt.last_saved == 2  # 4 and 5 belong to the abandoned future
    assert "removing checkpoint(s) [4, 5]" in capsys.readouterr().out

    ckpt, *_ = pieces("null")  # --no-resume: a fresh start empties the metrics and drops every checkpoint
    assert ckpt.resume(TrainState()) is None
    ckpt.close()
    assert ckpt.manager.steps() == [] and metrics.read_text() == ""

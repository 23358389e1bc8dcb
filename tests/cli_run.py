"""The shortened quickstart run as a CLI subprocess, for the kill-and-resume tests: its environment
(a private cache holding the tiny model, one thread), start / finish, and what it logged; and
:func:`run_cli`, a command run in this process."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nxd_finetune.checkpoint.writer import FAILPOINT_ENV

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
STEPS = 6
# the quickstart, shortened; LoRA dropout on, so the RNG state must be restored too
RUN = ["data.max_seq_len=64", f"training.max_steps={STEPS}", "training.micro_batch_size=4", "training.warmup_steps=1",
       "logging.progress=false", "logging.every_n_steps=1", "eval.max_batches=1", "eval.every_n_steps=3",
       "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "lora.dropout=0.1"]
PHASES = ["after-step", "sync-save", "async-save", "stage-write"]
SAVE_STEPS = [s for s in range(1, STEPS + 1) if s % 2 == 0]  # checkpoint.every_n_steps=2 in RUN


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``nxd-finetune ARGV`` in this process: (exit code, stdout, stderr)."""
    from nxd_finetune.cli import main

    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1  # sys.exit(None): success
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def trial(seed: int, save_steps: list[int] = SAVE_STEPS) -> tuple[str, int, bool]:
    """(failpoint phase, step, async save) of trial ``seed``; ``save_steps``: the steps the run
    checkpoints at (``RUN``'s by default)."""
    rng = random.Random(seed)
    phase = PHASES[seed % len(PHASES)]  # every phase within any 4 consecutive seeds
    if phase == "after-step":
        return "after-step", rng.randint(1, STEPS), False
    if phase == "stage-write":
        return "stage-written", rng.choice(save_steps), rng.random() < 0.5
    return "before-manifest", rng.choice(save_steps), phase == "async-save"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment of the CLI subprocesses: a private cache holding the tiny model, one thread."""
    cache = tmp_path_factory.mktemp("nxd-cache")
    env = {**os.environ, "NXD_FINETUNE_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(cache)}
    env.pop(FAILPOINT_ENV, None)
    subprocess.run([sys.executable, "-c", "from nxd_finetune.quickstart import ensure_tiny_model as e; e()"],
                   env=env, check=True, capture_output=True, timeout=300)
    return env


def start(env: dict, out: Path, *extra: str, failpoint: str | None = None, recipe: Path = QUICKSTART,
          run: list[str] = RUN) -> subprocess.Popen:
    """``nxd-finetune run recipe`` with ``run`` then ``extra`` overrides, writing to ``out``."""
    env = {**env, FAILPOINT_ENV: failpoint} if failpoint else env
    return subprocess.Popen([sys.executable, "-m", "nxd_finetune", "run", str(recipe), *run, f"output.dir={out}",
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    output, _ = proc.communicate(timeout=300)
    return proc.returncode, output


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(out: Path) -> list[tuple]:
    """(step, kind, value) of every loss logged, in file order."""
    return [(r["step"], k, r[k]) for r in records(out) for k in ("train_loss", "eval_loss") if k in r]


def signal_when_logged(proc: subprocess.Popen, out: Path, step: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``proc`` from outside as soon as its metrics show ``step`` (wherever it then is)."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and f'"step": {step},' in path.read_text():
            proc.send_signal(sig)
            return
        time.sleep(0.01)


def resumed_from(log: str) -> int:
    match = re.search(r"resumed from \S+ \(step (\d+)\)", log)
    assert match, log
    return int(match.group(1))

"""Randomized SIGKILL: a run killed at a random step and phase, then resumed, ends with the adapter
files byte-identical to an uninterrupted run's and the same loss curve, each step logged once.

Phases: right after an optimizer step (before any save of that step), during a synchronous save
(files written, manifest not), during an asynchronous save, and while a state file is still a temp
file (written, not yet renamed to its name). No temp file survives the resumed run, in the output
or in the temp directory. Trials come from a fixed seed list:
5 in ``make test``, 20 with ``NXD_FINETUNE_SOAK_TRIALS=20`` (``make test-soak``).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from cli_run import STEPS, curve, env, finish, records, resumed_from, start, trial  # noqa: F401

TRIALS = int(os.environ.get("NXD_FINETUNE_SOAK_TRIALS", "5"))


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("uninterrupted")
    code, log = finish(start(env, out))
    assert code == 0, log
    return out


@pytest.mark.parametrize("seed", range(1000, 1000 + TRIALS))
def test_killed_at_a_random_point_resumes_byte_identical(env, reference, tmp_path, seed):  # noqa: F811
    point, step, async_save = trial(seed)
    out = tmp_path / "run"
    extra = ["checkpoint.async_save=true"] if async_save else []
    code, log = finish(start(env, out, *extra, failpoint=f"{point}:{step}"))
    assert code == -signal.SIGKILL, (seed, point, step, log[-2000:])
    code, log = finish(start(env, out, *extra))
    assert code == 0, (seed, log[-2000:])
    if step > 2:  # step 2's checkpoint was complete before the kill: the run resumed, not started over
        assert resumed_from(log) >= 2, (seed, log[-2000:])
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / "final" / name).read_bytes() == (reference / "final" / name).read_bytes(), (seed, name)
    assert curve(out) == curve(reference), seed
    assert [r["step"] for r in records(out) if "train_loss" in r] == list(range(1, STEPS + 1)), seed
    assert [p for p in out.rglob(".nxdtmp-*")] == [], seed  # nothing half-written left in the output
    assert [p for p in Path(env["TMPDIR"]).glob("nxd-ckpt-*")] == [], seed  # nor in the temp directory



def test_killed_while_replacing_final_leaves_a_complete_final(env, tmp_path):  # noqa: F811
    """A re-run that extends a finished run replaces its ``final/``; killed with the new directory
    written but not yet swapped in, or swapped in but the old one not yet removed, ``final/`` is a
    whole adapter (the old or the new one), and the next run ends as an uninterrupted extension."""
    names = ("adapter_model.safetensors", "adapter_config.json")
    first = tmp_path / "first"
    code, log = finish(start(env, first, f"training.max_steps={STEPS - 2}"))
    assert code == 0, log[-2000:]
    old = {n: (first / "final" / n).read_bytes() for n in names}
    clean = tmp_path / "clean"
    shutil.copytree(first, clean)
    code, log = finish(start(env, clean))
    assert code == 0, log[-2000:]
    new = {n: (clean / "final" / n).read_bytes() for n in names}
    assert old != new
    for point in ("final-written", "final-swapped"):
        out = tmp_path / point
        shutil.copytree(first, out)
        code, log = finish(start(env, out, failpoint=f"{point}:0"))
        assert code == -signal.SIGKILL, (point, log[-2000:])
        now = {n: (out / "final" / n).read_bytes() for n in names}
        assert now == (old if point == "final-written" else new), point
        code, log = finish(start(env, out))
        assert code == 0, log[-2000:]
        assert {n: (out / "final" / n).read_bytes() for n in names} == new, point
        assert [p.name for p in out.iterdir() if p.name.startswith(".final")] == [], point  # the killed copy

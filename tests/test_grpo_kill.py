"""Randomized SIGKILL on a GRPO run (``objective: grpo``, LoRA, ``num_iterations: 2``, ``beta`` >
0) through ``nxd-finetune run``: killed at a random step and phase (those of
tests/test_kill_soak.py, ``tests/cli_run.py``'s ``trial``), then resumed, it ends with the adapter
files byte-identical to an uninterrupted run's and the same metrics curve (every logged value but
the timings), each step logged once. Every step is checkpointed, so a kill after an even step's
checkpoint was begun resumes from the odd step before it: between the two steps of one generation,
the completions to reuse read back from the checkpoint; a kill after an odd step resumes from the
even step before it and samples the same completions again (sampling seeded per step). Trials from
a fixed seed list: 4 in ``make test`` (both kinds of resume, every phase), more with
``NXD_FINETUNE_SOAK_TRIALS``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml
from cli_run import STEPS, env, finish, records, resumed_from, start, trial  # noqa: F401

from tests.conftest import build_tiny_hf, tiny_hf_config
from tests.rl_helpers import grpo_recipe

pytestmark = pytest.mark.slow  # end-to-end CLI runs, killed and resumed

TRIALS = min(int(os.environ.get("NXD_FINETUNE_SOAK_TRIALS", "4")), 20)
# every step checkpointed (two kept), logged every step
RUN = ["checkpoint.every_n_steps=1", "checkpoint.keep_last=2", "logging.every_n_steps=1"]
SAVE_STEPS = list(range(1, STEPS + 1))
WALL = frozenset({"time", "tokens_per_s", "peak_host_mb"})  # measured, not computed


@pytest.fixture(scope="module")
def grpo_yaml(tmp_path_factory) -> Path:
    """The GRPO recipe of ``tests/rl_helpers.py`` on a tiny llama, ``STEPS`` steps, as a file."""
    root = tmp_path_factory.mktemp("grpo-inputs")
    build_tiny_hf(tiny_hf_config("llama"), root / "model")
    recipe = grpo_recipe(root, root / "model", root / "out", STEPS)
    assert recipe["rl"]["num_iterations"] == 2 and recipe["rl"]["beta"] > 0 and "lora" in recipe
    path = root / "grpo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def grpo(env: dict, out: Path, recipe: Path, *extra: str, failpoint: str | None = None) -> tuple[int, str]:  # noqa: F811
    return finish(start(env, out, *extra, failpoint=failpoint, recipe=recipe, run=RUN))


def grpo_curve(out: Path) -> list[tuple]:
    """(step, key, value) of every value logged but the clock's and the host's, in file order."""
    return [(r["step"], k, v) for r in records(out) for k, v in r.items()
            if k not in WALL and not k.startswith("time/")]


@pytest.fixture(scope="module")
def uninterrupted(env, grpo_yaml, tmp_path_factory) -> Path:  # noqa: F811
    out = tmp_path_factory.mktemp("grpo-uninterrupted") / "run"
    code, log = grpo(env, out, grpo_yaml)
    assert code == 0, log[-2000:]
    logged = records(out)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert all(r["kl"] > 0 for r in logged[1:])  # beta > 0: the KL term is live once the adapter moved
    assert ["reward" in r for r in logged] == [s % 2 == 1 for s in range(1, STEPS + 1)]  # one generation, 2 steps
    return out


@pytest.mark.parametrize("seed", range(3000, 3000 + TRIALS))
def test_killed_grpo_run_resumes_byte_identical(env, grpo_yaml, uninterrupted, tmp_path, seed):  # noqa: F811
    point, step, async_save = trial(seed, SAVE_STEPS)
    out = tmp_path / "run"
    extra = ["checkpoint.async_save=true"] if async_save else []
    code, log = grpo(env, out, grpo_yaml, *extra, failpoint=f"{point}:{step}")
    assert code == -signal.SIGKILL, (seed, point, step, log[-2000:])
    code, log = grpo(env, out, grpo_yaml, *extra)
    assert code == 0, (seed, log[-2000:])
    if step > 1:  # step - 1's checkpoint was complete before the kill: the run resumed from it
        assert resumed_from(log) == step - 1, (seed, point, step, log[-2000:])
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / "final" / name).read_bytes() == (uninterrupted / "final" / name).read_bytes(), (seed, name)
    assert grpo_curve(out) == grpo_curve(uninterrupted), seed
    assert [r["step"] for r in records(out)] == list(range(1, STEPS + 1)), seed
    assert [p for p in out.rglob(".nxdtmp-*")] == [], seed
    assert [p for p in Path(env["TMPDIR"]).glob("nxd-ckpt-*")] == [], seed

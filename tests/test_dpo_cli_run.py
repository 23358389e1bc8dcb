"""A DPO run through ``nxd-finetune run`` (the quickstart DPO recipe, shortened).

Randomized SIGKILL: killed at a random step and phase (the phases of
tests/test_kill_soak.py), then resumed, it ends with the adapter files byte-identical to an
uninterrupted DPO run's, the same loss and reward curve, and the reference log-probs it stored
before its first step intact (the same file bytes as the uninterrupted run's). The DPO run starts
from a short SFT quickstart run's adapter (the reference, ``lora.init_from``) on a small slice of
the quickstart preference pairs, each run with its own data cache. Trials from a fixed seed list:
3 in ``make test``, more with ``NXD_FINETUNE_SOAK_TRIALS``.

The uninterrupted run also logs to TensorBoard and a local MLflow store and shows its progress bar:
the reward metrics reach both trackers, and the bar shows the reward accuracy. Its adapter, pushed
to a registry, is shown with the objective and reference it was trained with.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from cli_run import ROOT, RUN, STEPS, env, finish, records, resumed_from, start, trial  # noqa: F401
from safetensors import safe_open
from typer.testing import CliRunner

from nxd_finetune.data.ref_store import REF_FILE
from nxd_finetune.registry.cli import adapters_app

TRIALS = min(int(os.environ.get("NXD_FINETUNE_SOAK_TRIALS", "3")), 20)
DPO = ROOT / "recipes" / "quickstart-dpo.yaml"
ASSETS = ROOT / "nxd_finetune" / "assets" / "quickstart"
KEYS = ("train_loss", "eval_loss", "rewards/margins", "rewards/accuracies", "eval_rewards/margins")


@pytest.fixture(scope="module")
def dpo_run(env, tmp_path_factory):  # noqa: F811
    """The DPO overrides: a 6-step SFT run's adapter as the starting point, 32 train / 8 eval pairs."""
    root = tmp_path_factory.mktemp("dpo-inputs")
    code, log = finish(start(env, root / "sft"))
    assert code == 0, log[-2000:]
    for split, n in (("train", 32), ("eval", 8)):
        lines = (ASSETS / f"preference_{split}.jsonl").read_text().splitlines(keepends=True)
        (root / f"{split}.jsonl").write_text("".join(lines[:n]))
    return [*RUN, f"lora.init_from={root / 'sft' / 'final'}", f"data.train={root / 'train.jsonl'}",
            f"data.eval={root / 'eval.jsonl'}", "training.lr=1.0e-3"]


def dpo(env: dict, out: Path, run: list[str], *extra: str, failpoint: str | None = None) -> tuple[int, str]:  # noqa: F811
    """One DPO run into ``out``, its data cache (the stored reference log-probs) beside it."""
    cache = f"data.cache_dir={out.parent / (out.name + '-cache')}"
    env = {**env, "COLUMNS": "200"}  # the progress bar's last line, uncropped
    return finish(start(env, out, cache, *extra, failpoint=failpoint, recipe=DPO, run=run))


def stored_reference(out: Path) -> bytes:
    (path,) = (out.parent / (out.name + "-cache")).rglob(REF_FILE)
    return path.read_bytes()


def dpo_curve(out: Path) -> list[tuple]:
    return [(r["step"], k, r[k]) for r in records(out) for k in KEYS if k in r]


@pytest.fixture(scope="module")
def uninterrupted(env, dpo_run, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("dpo-uninterrupted") / "run"
    trackers = ["logging.progress=true", "logging.tensorboard=true",
                f"logging.mlflow={{tracking_uri: {out.parent / 'mlruns'}}}"]
    code, log = dpo(env, out, dpo_run, *trackers)
    assert code == 0, log[-2000:]
    return out, log


def test_reward_metrics_reach_the_trackers_and_the_progress_bar(uninterrupted):
    import mlflow
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, log = uninterrupted
    keys = ("rewards/accuracies", "rewards/margins", "eval_rewards/accuracies", "eval_rewards/margins")
    want = {k: [(r["step"], r[k]) for r in records(out) if k in r] for k in keys}
    assert [s for s, _ in want["rewards/accuracies"]] == list(range(1, STEPS + 1))
    assert [s for s, _ in want["eval_rewards/margins"]] == [0, 3, 6]  # before training, every 3 steps
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out.parent / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("nxd-finetune").experiment_id])
    tb = EventAccumulator(str(out / "tensorboard"))
    tb.Reload()
    for k in keys:
        assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) == want[k], k
        tag = k.replace("eval_", "eval/", 1)
        assert [(e.step, e.value) for e in tb.Scalars(tag)] == [(s, pytest.approx(v, rel=1e-6)) for s, v in want[k]]
    last = want["rewards/accuracies"][-1][1]
    assert f"rewards/accuracies {last:.2f}" in log  # the progress bar's last line


def test_shown_adapter_names_its_objective_and_reference(uninterrupted, dpo_run, tmp_path):
    out, _ = uninterrupted
    with safe_open(str(out / "final" / "adapter_model.safetensors"), framework="pt") as f:
        reference = f.metadata()["nxd_reference"]
    init_from = next(a for a in dpo_run if a.startswith("lora.init_from=")).split("=", 1)[1]
    assert reference == f"init_from:{init_from}"
    cli, reg = CliRunner(), tmp_path / "reg"
    sft = Path(init_from)
    for src, name in ((out / "final", "dpo"), (sft, "sft")):
        result = cli.invoke(adapters_app, ["push", str(src), f"{reg}/{name}"])
        assert result.exit_code == 0, result.output
    shown = cli.invoke(adapters_app, ["show", f"{reg}/dpo:1"])
    assert shown.exit_code == 0, shown.output
    assert shown.output.splitlines()[1] == f"objective: dpo (loss sigmoid)  reference: {reference}"
    shown = cli.invoke(adapters_app, ["show", f"{reg}/sft:1"])
    assert shown.exit_code == 0, shown.output
    assert not any(line.startswith("objective:") for line in shown.output.splitlines())  # SFT: none recorded


@pytest.mark.parametrize("seed", range(2000, 2000 + TRIALS))
def test_killed_dpo_run_resumes_byte_identical(env, dpo_run, uninterrupted, tmp_path, seed):  # noqa: F811
    uninterrupted, _ = uninterrupted
    point, step, async_save = trial(seed)
    out = tmp_path / "run"
    extra = ["checkpoint.async_save=true"] if async_save else []
    code, log = dpo(env, out, dpo_run, *extra, failpoint=f"{point}:{step}")
    assert code == -signal.SIGKILL, (seed, point, step, log[-2000:])
    stored = stored_reference(out)  # written before the first step, so present at any kill point
    assert stored == stored_reference(uninterrupted), seed
    code, log = dpo(env, out, dpo_run, *extra)
    assert code == 0, (seed, log[-2000:])
    if step > 2:  # step 2's checkpoint was complete before the kill: the run resumed, not started over
        assert resumed_from(log) >= 2, (seed, log[-2000:])
    assert stored_reference(out) == stored, seed  # read back, not recomputed with trained weights
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / "final" / name).read_bytes() == (uninterrupted / "final" / name).read_bytes(), (seed, name)
    assert dpo_curve(out) == dpo_curve(uninterrupted), seed
    assert [r["step"] for r in records(out) if "train_loss" in r] == list(range(1, STEPS + 1)), seed
    assert [p for p in out.rglob(".nxdtmp-*")] == [], seed

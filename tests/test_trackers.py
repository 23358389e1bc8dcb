"""MLflow and W&B trackers, read back with the libraries' own readers from the files the
``trained_quickstart`` run wrote (tests/conftest.py: killed after step 20, resumed from step 16):
an MLflow local store through ``mlflow.MlflowClient``, W&B's offline ``.wandb`` files through
``wandb leet inspect --json``. Every metric at its step with the values of ``metrics.jsonl``, the
recipe as parameters, the final adapter as tag and artefact, the ``eval.prompts`` generations, and
the resumed run continuing the same tracker run. A tiny DPO run's preference metrics reach MLflow
and W&B the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nxd_finetune.cli import main
from tests.conftest import TRAINED_STEPS
from tests.preference_helpers import dpo_recipe, dpo_setup

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_STEP = 16  # the resume point of the fixture's run


def metrics_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def logged(out: Path, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in metrics_records(out) if key in r]


def test_mlflow_run_read_back(trained_quickstart):
    import mlflow

    out, _ = trained_quickstart
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("nxd-finetune")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resumed process continued the run of the killed one
    run = runs[0]
    assert run.info.run_id == json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run.info.status == "FINISHED"
    for key in ("train_loss", "lr", "grad_norm", "eval_loss", "eval_accuracy"):
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(history) == logged(out, key), key  # every step once, the same values
    assert [s for s, _ in logged(out, "train_loss")] == list(range(4, TRAINED_STEPS + 1, 4))
    params = run.data.params
    assert params["lora.rank"] == "16" and params["training.max_steps"] == str(TRAINED_STEPS)
    assert params["model.path"] == "builtin:tiny-llama"
    assert json.loads(params["eval.prompts"]) == ["Is 4321 even or odd?", "Is 1234 even or odd?"]
    assert run.data.tags["nxd_finetune.output"] == str((out / "final").resolve())
    assert run.data.tags["nxd_finetune.registry_ref"] == f"{out.parent / 'reg'}/quickstart:1"
    files = {a.path for a in client.list_artifacts(run.info.run_id, "final")}
    assert {"final/adapter_config.json", "final/adapter_model.safetensors"} <= files
    local = client.download_artifacts(run.info.run_id, "final/adapter_model.safetensors", str(out.parent / "dl"))
    assert Path(local).read_bytes() == (out / "final" / "adapter_model.safetensors").read_bytes()
    samples = sorted(a.path for a in client.list_artifacts(run.info.run_id, "eval_samples"))
    assert samples == [f"eval_samples/step-{s:08d}.json" for s in (0, 32, 64)]
    last = json.loads(Path(client.download_artifacts(run.info.run_id, samples[-1], str(out.parent / "dl"))).read_text())
    jsonl = [r["eval_samples"] for r in metrics_records(out) if "eval_samples" in r]
    assert last == jsonl[-1] and {r["completion"] for r in last} <= {"even", "odd"}  # the answer format learned


def wandb_records(run_file: Path) -> list[dict]:
    """The records of a ``.wandb`` transaction log, read by W&B's own reader."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    text = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run_file)], capture_output=True,
                          text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_wandb_offline_files_read_back(trained_quickstart):
    out, _ = trained_quickstart
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["run_id"]
    dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(dirs) == 2 and all(d.name.endswith(run_id) for d in dirs)  # killed process, resumed process
    killed, resumed = (wandb_records(d / f"run-{run_id}.wandb") for d in dirs)
    for records in (killed, resumed):
        runs = [r["run"] for r in records if r["type"] == "run"]
        # SIGKILL may lose what the killed process had not flushed yet, its run record included
        assert (runs or records is killed) and all(r["run_id"] == run_id for r in runs)
        if runs:
            config = runs[-1]["config"]["update"]
            assert config["lora"]["rank"] == 16 and config["training"]["max_steps"] == TRAINED_STEPS
    expected = {(r["step"], k): r[k] for r in metrics_records(out) for k in ("train_loss", "eval_loss") if k in r}
    seen: dict[tuple[int, str], float] = {}
    for records in (killed, resumed):
        for r in records:
            if r["type"] == "history":
                item = r["history"]["item"]
                seen.update({(item["_step"], k): item[k] for k in ("train_loss", "eval_loss") if k in item})
    assert all(expected[k] == v for k, v in seen.items())  # the values of metrics.jsonl at their steps
    # the resumed process logged every step after the checkpoint (a SIGKILL may lose the last unsynced records)
    assert {k for k in expected if k[0] > CHECKPOINT_STEP + 4} <= set(seen)
    if any(r["type"] == "history" for r in killed):  # unless the SIGKILL took all the killed process's records
        assert (0, "eval_loss") in seen
    summary: dict = {}
    for r in resumed:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    assert summary["nxd_finetune.output"] == str((out / "final").resolve())
    assert summary["nxd_finetune.registry_ref"] == f"{out.parent / 'reg'}/quickstart:1"
    assert [r["exit"]["exit_code"] for r in resumed if r["type"] == "exit"] == [0]
    assert any(r["type"] == "artifact" and r["artifact"]["type"] == "model" for r in resumed)
    tables = sorted((dirs[1] / "files" / "media" / "table").glob("eval_samples_*.table.json"))
    assert tables
    final = json.loads(tables[-1].read_text())
    assert final["columns"] == ["prompt", "completion"]
    jsonl = [r["eval_samples"] for r in metrics_records(out) if "eval_samples" in r]
    assert final["data"] == [[r["prompt"], r["completion"]] for r in jsonl[-1]]


PREFERENCE_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                   "logps/rejected")


def test_dpo_preference_metrics_reach_mlflow_and_wandb(make_tiny_hf, tmp_path):
    """``nxd-finetune run`` of a tiny DPO recipe (4 steps, eval before and every 2 steps) with MLflow
    and offline W&B: TRL's preference metrics and their ``eval_`` forms reach both at every step
    they were logged, with the values of ``metrics.jsonl``."""
    import mlflow

    setup = {**dpo_setup(make_tiny_hf, tmp_path, 8, seed=11), "train_eval": True}
    out = tmp_path / "run"
    trackers = {"mlflow": {"tracking_uri": str(tmp_path / "mlruns")}, "wandb": {"mode": "offline"}}
    recipe = dpo_recipe(setup, out, 0.1, {"micro_batch_size": 2, "max_steps": 4, "lr": 5e-3},
                        eval={"before": True, "every_n_steps": 2}, logging={"progress": False, **trackers})
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "nxd_finetune", "run", str(tmp_path / "dpo.yaml")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    keys = (*PREFERENCE_KEYS, *(f"eval_{k}" for k in PREFERENCE_KEYS))
    want = {k: logged(out, k) for k in keys}
    assert all([s for s, _ in want[k]] == [1, 2, 3, 4] for k in PREFERENCE_KEYS)
    assert all([s for s, _ in want[f"eval_{k}"]] == [0, 2, 4] for k in PREFERENCE_KEYS)
    assert len({v for _, v in want["rewards/margins"]}) == 4  # it trained: the metrics move

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("nxd-finetune").experiment_id])
    for k in keys:
        assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)) == want[k], k

    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["run_id"]
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    seen = {(r["history"]["item"]["_step"], k): r["history"]["item"][k]
            for r in wandb_records(run_dir / f"run-{run_id}.wandb") if r["type"] == "history"
            for k in keys if k in r["history"]["item"]}
    assert seen == {(s, k): v for k in keys for s, v in want[k]}


def test_tensorboard_text_of_eval_prompts(trained_quickstart):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = trained_quickstart
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    steps = sorted({e.step for e in acc.Tensors("eval/samples/text_summary")})
    assert steps == [0, 32, 64]


@pytest.mark.parametrize("package", ["mlflow", "wandb"])
def test_missing_extra_is_one_line(package, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, package, None)  # the package is not importable
    with pytest.raises(SystemExit) as exc:
        main(["run", str(ROOT / "recipes" / "quickstart.yaml"), f"output.dir={tmp_path}", f"logging.{package}={{}}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err == f"error: logging.{package} needs the {package} package: pip install 'nxd-finetune[{package}]'\n"

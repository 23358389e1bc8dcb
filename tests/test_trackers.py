"""MLflow and W&B trackers, read back with the libraries' own readers from the files the
``trained_quickstart`` run wrote (tests/conftest.py: killed after step 20, resumed from step 16):
an MLflow local store through ``mlflow.MlflowClient``, W&B's offline ``.wandb`` files through
``wandb leet inspect --json``. Every metric at its step with the values of ``metrics.jsonl``, the
recipe as parameters, the final adapter as tag and artefact, the ``eval.prompts`` generations, and
the resumed run continuing the same tracker run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nxd_finetune.cli import main
from tests.conftest import TRAINED_STEPS

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

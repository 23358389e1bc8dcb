"""Experiment trackers: MLflow (``logging.mlflow``) and Weights & Biases (``logging.wandb``).

The run's :class:`~nxd_finetune.metrics.MetricsWriter` (global rank 0 only) hands every logged
record to the trackers opened here: numbers as metrics at their optimizer step, the
``eval.prompts`` generations as a text table. A tracker run gets the resolved recipe as its
parameters / config when it starts, and the final artefact when the run ends (the output
directory and the registry REF as tags, an adapter's files as an artifact).

Resume: the tracker run ids are kept in ``<output.dir>/trackers.json``; a resumed training run
(a checkpoint was loaded) continues those runs, a fresh one starts new ones. A resumed MLflow run
skips the values it already holds (a step is logged once per metric); W&B drops steps below its
current one itself.

Both packages are optional extras (``pip install 'nxd-finetune[mlflow]'`` / ``[wandb]``); a recipe
that asks for a missing one fails before training with one line naming the extra.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nxd_finetune.errors import NxdError
from nxd_finetune.jsontypes import JsonObject, json_object, json_str

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe

STATE_FILE = "trackers.json"
Sample = Mapping[str, str]


class Tracker(Protocol):
    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None: ...

    def finish(self, summary: Mapping[str, object] | None) -> None: ...


def _require(package: str, key: str) -> Any:  # the optional package's module
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise NxdError(f"logging.{key} needs the {package} package: pip install 'nxd-finetune[{key}]'") from None


def check_trackers(recipe: Recipe) -> None:
    """Fail early (one line naming the extra) when a tracker's package is missing."""
    if recipe.logging.mlflow is not None:
        _require("mlflow", "mlflow")
    if recipe.logging.wandb is not None:
        _require("wandb", "wandb")


def flatten(tree: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """``{"lora": {"rank": 16}}`` -> ``{"lora.rank": "16"}`` (values as JSON text, strings as is)."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def _artefact_tags(recipe: Recipe, summary: Mapping[str, object]) -> dict[str, str]:
    tags = {"nxd_finetune.output": str(Path(str(summary["output"])).resolve())}
    if "registry_version" in summary:
        tags["nxd_finetune.registry_ref"] = f"{recipe.output.registry}:{summary['registry_version']}"
    return tags


def _adapter_dir(recipe: Recipe, summary: Mapping[str, object]) -> Path | None:
    """The final directory when it is an adapter alone (small enough to attach to a run)."""
    if recipe.lora is None or recipe.checkpoint.save_mode != "adapter":
        return None
    path = Path(str(summary["output"]))
    return path if path.is_dir() else None


# ---------------------------------------------------------------- MLflow


def _mlflow_store(uri: str) -> tuple[str, str | None]:
    """(tracking URI, artifact location for a new experiment). A URI with a scheme is MLflow's; a
    plain directory is a local store: ``sqlite:///<dir>/mlflow.db`` and ``<dir>/artifacts``."""
    if "://" in uri or uri.startswith(("databricks", "file:", "sqlite:")):
        return uri, None
    root = Path(uri).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


class MlflowTracker:
    """One MLflow run, written through ``mlflow.MlflowClient`` (no global active run)."""

    def __init__(self, recipe: Recipe, out_dir: Path, run_id: str | None) -> None:
        _require("mlflow", "mlflow")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        section = recipe.logging.mlflow
        assert section is not None, "open_trackers opens MLflow only when logging.mlflow is set"
        self.recipe, self.section = recipe, section
        uri, artifacts = _mlflow_store(section.tracking_uri)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self._seen: dict[str, int] = {}
            if run_id is not None:
                self.run_id = run_id
                self.client.update_run(run_id, status="RUNNING")
                for key in self.client.get_run(run_id).data.metrics:
                    self._seen[key] = max(m.step for m in self.client.get_metric_history(run_id, key))
                return
            experiment = self.client.get_experiment_by_name(section.experiment)
            exp_id = (experiment.experiment_id if experiment is not None
                      else self.client.create_experiment(section.experiment, artifact_location=artifacts))
            run = self.client.create_run(exp_id, run_name=section.run_name or Path(out_dir).resolve().name,
                                         tags={"nxd_finetune.model": recipe.model.path})
            self.run_id = run.info.run_id
            # MLflow keys: letters, digits and _ - . / space (data.fields maps user column names)
            params = [Param(re.sub(r"[^\w\-./ ]", "_", k)[:250], v[:6000])
                      for k, v in flatten(recipe.to_dict()).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i:i + 100])
        except NxdError:
            raise
        except Exception as e:  # MlflowException, connection errors: one line
            raise NxdError(f"logging.mlflow ({uri}): {type(e).__name__}: {str(e).splitlines()[0]}") from None
        self.uri = uri

    def state(self) -> dict[str, str]:
        return {"run_id": self.run_id, "tracking_uri": self.section.tracking_uri}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items() if step > self._seen.get(k, -1)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        table: Any = [dict(r) for r in rows]  # mlflow writes any JSON-serialisable value
        self.client.log_dict(self.run_id, table, f"eval_samples/step-{step:08d}.json")

    def finish(self, summary: Mapping[str, object] | None) -> None:
        if summary is not None:
            for key, value in _artefact_tags(self.recipe, summary).items():
                self.client.set_tag(self.run_id, key, value)
            adapter = _adapter_dir(self.recipe, summary)
            if adapter is not None:
                self.client.log_artifacts(self.run_id, str(adapter), "final")
        self.client.set_terminated(self.run_id, "FINISHED" if summary is not None else "FAILED")


# ---------------------------------------------------------------- Weights & Biases


class WandbTracker:
    """One W&B run (``wandb.init``; ``mode: offline`` writes only local files, synced later with
    ``wandb sync``)."""

    def __init__(self, recipe: Recipe, out_dir: Path, run_id: str | None) -> None:
        wandb = _require("wandb", "wandb")
        section = recipe.logging.wandb
        assert section is not None, "open_trackers opens W&B only when logging.wandb is set"
        self.recipe, self.section = recipe, section
        root = Path(section.dir or out_dir)
        root.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=section.project, entity=section.entity, name=section.name,
                                  mode=section.mode, dir=str(root), id=run_id, resume="allow" if run_id else None,
                                  config=recipe.to_dict(), reinit="create_new",
                                  settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # auth / network / usage errors: one line
            raise NxdError(f"logging.wandb: {type(e).__name__}: {str(e).splitlines()[0]}") from None
        self._wandb = wandb

    def state(self) -> dict[str, str]:
        return {"run_id": self.run.id, "project": self.section.project}

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def log_samples(self, step: int, rows: Sequence[Sample]) -> None:
        table = self._wandb.Table(columns=["prompt", "completion"], data=[[r["prompt"], r["completion"]] for r in rows])
        self.run.log({"eval_samples": table}, step=step)

    def finish(self, summary: Mapping[str, object] | None) -> None:
        if summary is not None:
            for key, value in _artefact_tags(self.recipe, summary).items():
                self.run.summary[key] = value
            adapter = _adapter_dir(self.recipe, summary)
            if adapter is not None:
                artifact = self._wandb.Artifact(f"adapter-{self.run.id}", type="model")
                artifact.add_dir(str(adapter))
                self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if summary is not None else 1)


# ---------------------------------------------------------------- opening


def open_trackers(recipe: Recipe, out_dir: Path, resumed: bool) -> list[Tracker]:
    """The trackers the recipe asks for; a ``resumed`` run continues the runs named in
    ``<out_dir>/trackers.json``, a fresh one starts new runs and rewrites that file."""
    path = Path(out_dir) / STATE_FILE
    saved: JsonObject = {}
    if resumed and path.is_file():
        saved = json_object(json.loads(path.read_text()))
    opened: dict[str, MlflowTracker | WandbTracker] = {}
    if recipe.logging.mlflow is not None:
        opened["mlflow"] = MlflowTracker(recipe, out_dir, _run_id(saved, "mlflow"))
    if recipe.logging.wandb is not None:
        opened["wandb"] = WandbTracker(recipe, out_dir, _run_id(saved, "wandb"))
    if opened:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({k: t.state() for k, t in opened.items()}, indent=2))
    return list(opened.values())


def _run_id(saved: JsonObject, tracker: str) -> str | None:
    """The run id ``trackers.json`` holds for ``tracker`` (None: start a new run)."""
    return json_str(json_object(saved.get(tracker)).get("run_id"))

"""The reference log-probs a DPO run stores with its tokenized data (``ref-<key>/``), through
``nxd-finetune run`` (a CLI subprocess) on the tiny Llama with a random starting adapter.

- the store is checked on every load against the integrity record written with it: a valid file
  with shifted values, a truncated one, one that is no safetensors file, NaN values (with or
  without a matching record) each give one ``warning:`` line naming the file, then the entries are
  recomputed from the reference model: the run's curve equals an undisturbed run's;
- the key is the resolved ``lora.init_from`` (the registry version pulled and the adapter's bytes),
  so a run from ``REG/sft`` after a new push measures against the new version (step 1: rewards 0);
- a resumed run keeps the reference it started with: another ``lora.init_from`` (or none) on
  resume leaves the curve the uninterrupted run's, and where the stored reference is gone and the
  adapter now named is another one, the resume is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from nxd_finetune.data.ref_store import RECORD_FILE, REF_FILE
from nxd_finetune.registry.cli import adapters_app
from tests.conftest import build_tiny_hf, tiny_hf_config
from tests.preference_helpers import dpo_recipe, dpo_setup

STEPS = 4
KEYS = ("train_loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "eval_loss", "eval_rewards/margins")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo-ref")
    made = root / "model"
    build_tiny_hf(tiny_hf_config("llama"), made)
    data = dpo_setup(lambda family, **config: (None, made), root, STEPS * 2, seed=11)
    return {**data, "train_eval": True, "root": root}


def cli_run(setup: dict, out: Path, *overrides: str, steps: int = STEPS) -> tuple[int, str]:
    """``nxd-finetune run`` of the DPO recipe into ``out`` (its data cache: ``out``'s sibling ``cache``)."""
    rec = dpo_recipe(setup, out, 0.1, {"micro_batch_size": 2, "max_steps": steps, "lr": 1.0e-2},
                     logging={"progress": False, "every_n_steps": 1}, checkpoint={"every_n_steps": 2})
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(rec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "nxd_finetune", "run", str(path), *overrides], env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(out: Path) -> list[tuple]:
    return [(r["step"], k, r[k]) for r in records(out) for k in KEYS if k in r]


def store(cache: Path) -> Path:
    (path,) = cache.rglob(REF_FILE)
    return path


@pytest.fixture(scope="module")
def undisturbed(setup):
    out = setup["root"] / "undisturbed" / "run"
    code, log = cli_run(setup, out)
    assert code == 0, log[-3000:]
    return out


def shifted(path: Path) -> None:
    save_file({k: v + 3.0 for k, v in load_file(str(path)).items()}, str(path))


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def not_safetensors(path: Path) -> None:
    path.write_bytes(b"\x00" * 64)


def nan(path: Path) -> None:
    values = load_file(str(path))
    values["train"][1] = float("nan")
    save_file(values, str(path))


def nan_signed(path: Path) -> None:
    """NaN values under an integrity record that matches them (the record's sha256 rewritten)."""
    nan(path)
    record = path.parent / RECORD_FILE
    meta = json.loads(record.read_text())
    meta["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    record.write_text(json.dumps(meta))


@pytest.mark.parametrize(("damage", "what"), [
    (shifted, "does not match its integrity record"), (truncated, "does not match its integrity record"),
    (not_safetensors, "does not match its integrity record"), (nan, "does not match its integrity record"),
    (nan_signed, "holds NaN or inf"),
])
def test_a_changed_or_damaged_store_is_named_and_recomputed(setup, undisturbed, tmp_path, damage, what):
    out = tmp_path / "run"
    shutil.copytree(undisturbed.parent / "cache", tmp_path / "cache")
    path = store(tmp_path / "cache")
    damage(path)
    code, log = cli_run(setup, out)
    assert code == 0, log[-3000:]
    lines = [line for line in log.splitlines() if str(path) in line]
    assert len(lines) == 1 and lines[0].startswith("warning: ") and what in lines[0], log[-3000:]
    assert "recomputing" in lines[0] and "Traceback" not in log
    assert curve(out) == curve(undisturbed)
    assert path.read_bytes() == store(undisturbed.parent / "cache").read_bytes()  # stored again, verified


def test_a_store_without_an_integrity_record_is_recomputed(setup, undisturbed, tmp_path):
    shutil.copytree(undisturbed.parent / "cache", tmp_path / "cache")
    path = store(tmp_path / "cache")
    (path.parent / RECORD_FILE).unlink()
    shifted(path)
    code, log = cli_run(setup, tmp_path / "run")
    assert code == 0, log[-3000:]
    assert [line for line in log.splitlines() if str(path) in line] == [
        f"warning: reference log-probs {path}: no integrity record ({RECORD_FILE}); recomputing them from the "
        "reference model"]
    assert curve(tmp_path / "run") == curve(undisturbed)


def other_adapter(src: Path, dest: Path) -> Path:
    """``src``'s adapter with every factor doubled: another starting point."""
    shutil.copytree(src, dest)
    weights = dest / "adapter_model.safetensors"
    save_file({k: v * 2.0 for k, v in load_file(str(weights)).items()}, str(weights))
    return dest


def test_registry_latest_after_a_new_push_gets_its_own_reference(setup, tmp_path):
    reg, cli = tmp_path / "reg", CliRunner()

    def push(src: Path) -> None:
        result = cli.invoke(adapters_app, ["push", str(src), f"{reg}/sft"])
        assert result.exit_code == 0, result.output

    def step1(out: Path) -> dict:
        code, log = cli_run(setup, out, f"lora.init_from={reg}/sft", steps=1)
        assert code == 0, log[-3000:]
        return next(r for r in records(out) if "rewards/chosen" in r)

    push(setup["adapter"])
    first = step1(tmp_path / "v1")
    push(other_adapter(setup["adapter"], tmp_path / "v2-adapter"))
    second = step1(tmp_path / "v2")  # the same data cache: version 1's reference is stored there
    # the reference is the policy at step 1 (the starting adapter): its rewards are exactly 0
    assert (first["rewards/chosen"], first["rewards/rejected"]) == (0.0, 0.0)
    assert (second["rewards/chosen"], second["rewards/rejected"]) == (0.0, 0.0)
    assert len(list((tmp_path / "cache").rglob(REF_FILE))) == 2
    with (tmp_path / "v2" / "final" / "adapter_model.safetensors").open("rb") as f:
        header = f.read(8 + int.from_bytes(f.read(8), "little"))
    assert f"init_from:{reg}/sft:2".encode() in header  # the adapter records the version it was measured against


@pytest.fixture(scope="module")
def half(setup):
    """The DPO run stopped after step 2 (its checkpoint), to resume."""
    out = setup["root"] / "half" / "run"
    code, log = cli_run(setup, out, steps=2)
    assert code == 0, log[-3000:]
    return out


@pytest.mark.parametrize("init_from", ["other", "null"])
def test_resume_with_another_init_from_keeps_the_reference_it_started_with(setup, undisturbed, half, tmp_path,
                                                                           init_from):
    out = tmp_path / "half" / "run"
    shutil.copytree(half.parent, tmp_path / "half")
    other = other_adapter(setup["adapter"], tmp_path / "other") if init_from == "other" else None
    code, log = cli_run(setup, out, f"lora.init_from={other or 'null'}")
    assert code == 0, log[-3000:]
    assert "resumed from" in log and "ignored (only a fresh start reads them): lora.init_from" in log, log[-3000:]
    assert curve(out) == curve(undisturbed)
    assert len(list((tmp_path / "half" / "cache").rglob(REF_FILE))) == 1  # no entries from another adapter
    if init_from == "null":
        with (out / "final" / "adapter_model.safetensors").open("rb") as f:
            header = f.read(8 + int.from_bytes(f.read(8), "little"))
        assert f"init_from:{setup['adapter']}".encode() in header  # still the reference it started with


def test_resume_without_its_stored_reference_and_another_init_from_is_refused(setup, half, tmp_path):
    out = tmp_path / "half" / "run"
    shutil.copytree(half.parent, tmp_path / "half")
    shutil.rmtree(store(tmp_path / "half" / "cache").parent)
    other = other_adapter(setup["adapter"], tmp_path / "other")
    code, log = cli_run(setup, out, f"lora.init_from={other}")
    assert code != 0 and "Traceback" not in log, log[-3000:]
    (line,) = [line for line in log.splitlines() if line.startswith("error:")]
    assert "cannot resume" in line and f"lora.init_from={setup['adapter']}" in line, line
    assert list((tmp_path / "half" / "cache").rglob(REF_FILE)) == []  # nothing computed from the other adapter

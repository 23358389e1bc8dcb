"""The training path on a device that is neither cpu nor cuda: ``testnpu``, the suite's PrivateUse1
backend on CPU kernels (tests/device: a small C++ extension built once and cached, registered
through torch's ``torch.backends`` entry points in every process, as TorchNeuron's ``neuron``).

Each run is ``nxd-finetune run`` in a subprocess whose ``import torch`` loads the device. The
quickstart, a tp2 run, a save killed and resumed, the exported adapter and ``model.compile`` (the
aot_eager backend: dynamo + AOT autograd over the device's own kernels) on ``testnpu`` equal the
CPU run: the same loss curve and adapter within float rounding (the CPU's attention takes packed
rows sample by sample, an accelerator's the mask; the numbers agree to ~1e-6 per step). What the
device lacks is one line at validate time (no process-group backend for two processes, inductor),
and a device without memory statistics runs with none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nxd_finetune.checkpoint.writer import FAILPOINT_ENV

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
sys.path.insert(0, str(ROOT / "tests" / "device"))
import testnpu_device  # noqa: E402

RUN = ["data.max_seq_len=64", "training.max_steps=4", "training.micro_batch_size=4", "training.warmup_steps=1",
       "logging.progress=false", "logging.every_n_steps=1", "eval.max_batches=1", "eval.every_n_steps=2",
       "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "lora.dropout=0.1"]
TOL = dict(rtol=0, atol=2e-5)  # per-step losses; adapters after 4 Adam steps: ADAPTER_TOL
ADAPTER_TOL = dict(rtol=0, atol=2e-3)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Subprocess environment: the device loaded at ``import torch`` (its extension built once,
    under the user cache, in this process first), a private cache with the tiny model, one thread."""
    root = tmp_path_factory.mktemp("testnpu")
    subprocess.run([sys.executable, str(ROOT / "tests" / "device" / "testnpu_device.py")], check=True,
                   capture_output=True, timeout=900)  # build (or find) the extension
    auto = testnpu_device.autoload_dir(root / "autoload")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(auto), os.environ.get("PYTHONPATH")])),
           "NXD_FINETUNE_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(root)}
    env.pop(FAILPOINT_ENV, None)
    subprocess.run([sys.executable, "-c", "from nxd_finetune.quickstart import ensure_tiny_model as e; e()"],
                   env=env, check=True, capture_output=True, timeout=300)
    return env


def cli(env: dict[str, str], *argv: str, failpoint: str | None = None) -> subprocess.CompletedProcess[str]:
    run_env = {**env, FAILPOINT_ENV: failpoint} if failpoint else env
    return subprocess.run([sys.executable, "-m", "nxd_finetune", *argv], env=run_env, capture_output=True, text=True,
                          timeout=900)


def train(env: dict[str, str], out: Path, *extra: str) -> dict:
    proc = cli(env, "run", str(QUICKSTART), *RUN, f"output.dir={out}", *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r] + [r["eval_loss"] for r in rows if "eval_loss" in r]


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter_model.safetensors")


def assert_same_run(got: Path, ref: Path) -> None:
    torch.testing.assert_close(torch.tensor(losses(got)), torch.tensor(losses(ref)), **TOL)
    a, b = adapter(got), adapter(ref)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **ADAPTER_TOL, msg=k)


@pytest.fixture(scope="module")
def cpu_run(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cpu") / "out"
    summary = train(env, out, "training.device=cpu")
    assert summary["memory"][0]["peak_device_mb"] is None  # the CPU keeps no device statistics
    return out


def test_the_device_is_registered_as_a_third_party_device(env):
    code = ("import torch, torch.distributed as d; from nxd_finetune import device as v; "
            "print(torch.accelerator.current_accelerator().type, v.resolve_device_name('auto'), "
            "d.get_default_backend_for_device('testnpu'), v.device_for('auto', 1), "
            "torch.get_device_module('testnpu').device_count())")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["testnpu", "testnpu", "testnpu_ccl", "testnpu:1", "8"], proc.stderr[-2000:]


def test_quickstart_on_the_device_equals_the_cpu_run(env, cpu_run, tmp_path):
    summary = train(env, tmp_path / "dev", "training.device=testnpu")
    assert summary["memory"][0]["peak_device_mb"] > 0  # the device module's max_memory_allocated
    assert_same_run(tmp_path / "dev", cpu_run)


def test_tp2_on_the_device_equals_the_cpu_run(env, cpu_run, tmp_path):
    summary = train(env, tmp_path / "tp2", "training.device=testnpu", "parallel.nproc=2", "parallel.tp=2")
    assert summary["parallel"]["tp"] == 2 and len(summary["memory"]) == 2
    assert_same_run(tmp_path / "tp2", cpu_run)


def test_a_killed_run_resumes_on_the_device_to_the_same_result(env, cpu_run, tmp_path):
    """SIGKILL after step 3, resume from the step-2 checkpoint (the device's RNG state included:
    LoRA dropout is on): the end equals the CPU run's."""
    out = tmp_path / "resumed"
    argv = ["run", str(QUICKSTART), *RUN, f"output.dir={out}", "training.device=testnpu"]
    first = cli(env, *argv, failpoint="after-step:3")
    assert first.returncode == -9, first.stdout[-2000:] + first.stderr[-2000:]
    second = cli(env, *argv)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] is not None
    ref = adapter(cpu_run)
    for k, v in adapter(out).items():
        torch.testing.assert_close(v, ref[k], **ADAPTER_TOL, msg=k)


def test_compiled_run_on_the_device_equals_the_eager_run(env, cpu_run, tmp_path):
    """model.compile names the backend: aot_eager (dynamo + AOT autograd on the device's kernels)
    runs there; inductor, which generates no code for the device, is one line at validate."""
    train(env, tmp_path / "compiled", "training.device=testnpu", "model.compile=aot_eager")
    assert_same_run(tmp_path / "compiled", cpu_run)
    proc = cli(env, "validate", str(QUICKSTART), "training.device=testnpu", "model.compile=true")
    assert proc.returncode == 2 and proc.stderr.count("error:") == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: model.compile=inductor: inductor generates no code for device testnpu; name the device's own "
        "torch.compile backend (model.compile=neuron on TorchNeuron) or leave model.compile=false")


def test_what_the_device_lacks_is_one_line(env, tmp_path):
    """Without a process-group backend: two processes fail validate and run in one line; without
    memory statistics a run reports none."""
    bare = {**env, "TESTNPU_NO_CCL": "1", "TESTNPU_NO_MEMORY_STATS": "1"}
    line = ("error: device testnpu has no process-group backend registered with torch.distributed "
            "(torch.distributed.Backend.register_backend(..., devices=['testnpu'])); a run of more than one process "
            "needs one")
    for command in ("validate", "run"):
        proc = cli(bare, command, str(QUICKSTART), "training.device=testnpu", "--nproc", "2", "parallel.tp=2",
                   f"output.dir={tmp_path / command}")
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-2000:]
    summary = train(bare, tmp_path / "no-stats", "training.device=testnpu", "training.max_steps=1",
                    "checkpoint.every_n_steps=null", "eval.every_n_steps=null")
    assert summary["memory"][0]["peak_device_mb"] is None

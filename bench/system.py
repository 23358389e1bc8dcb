"""Machine-side measurements for the benchmark: fp32 matmul peak, CPU load, CLI start-up times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT


def matmul_peak(n: int = 2048, reps: int = 8, threads: int | None = None) -> dict[str, Any]:
    """Best fp32 ``torch.matmul`` FLOP/s of an ``n x n`` by ``n x n`` product with ``threads``
    threads (None: torch's default): per second of wall time (``flops_per_s``) and per second of
    process CPU time (``flops_per_cpu_s``, i.e. per busy core, which other processes on the machine
    barely change). The best of ``reps``."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.matmul(a, b)
        best, best_cpu = float("inf"), float("inf")
        for _ in range(reps):
            t, c = time.perf_counter(), time.process_time()
            torch.matmul(a, b)
            best, best_cpu = min(best, time.perf_counter() - t), min(best_cpu, time.process_time() - c)
        flops = 2 * n**3
        return {"n": n, "threads": torch.get_num_threads(), "flops_per_s": flops / best,
                "flops_per_cpu_s": flops / best_cpu}
    finally:
        torch.set_num_threads(before)


def cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def busy_cores(seconds: float = 2.0) -> float:
    """Cores kept busy (by anything) over the next ``seconds``."""
    b0, _ = cpu_busy()
    time.sleep(seconds)
    b1, _ = cpu_busy()
    return (b1 - b0) / os.sysconf("SC_CLK_TCK") / seconds


def wait_quiet(max_busy: float, max_wait_s: float) -> dict[str, float]:
    """Wait (up to ``max_wait_s``) until the machine's other work keeps < ``max_busy`` cores busy;
    returns what was seen (the 1-minute load average includes our own previous configuration, so the
    instantaneous busy-core count is the better gate between configurations)."""
    t0 = time.perf_counter()
    while True:
        busy = busy_cores()
        if busy < max_busy or time.perf_counter() - t0 > max_wait_s:
            return {"busy_cores_before": round(busy, 2), "load1_before": round(os.getloadavg()[0], 2),
                    "waited_s": round(time.perf_counter() - t0, 1)}
        time.sleep(5)


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``cmd``; also returns the CPU its process tree used and what *other* processes used meanwhile
    (machine busy time minus the child's), in cores."""
    b0, _ = cpu_busy()
    c0 = os.times()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    b1, _ = cpu_busy()
    c1 = os.times()
    child = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    machine = (b1 - b0) / os.sysconf("SC_CLK_TCK")
    return proc, {"wall_s": wall, "child_cores": child / wall, "other_cores": max(0.0, (machine - child) / wall),
                  "load1_after": os.getloadavg()[0]}


def run_worker(script: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Run a benchmark worker (``python <script> '<json spec>'``, one configuration in its own
    process) and return the dict of its ``RESULT {...}`` line, with the load measured meanwhile
    (:func:`run_measured`) and ``tokens_per_s`` / ``tokens_per_cpu_s`` from its ``tokens``,
    ``time_s`` and ``cpu_s``. A failed worker ends the benchmark with its stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc, usage = run_measured([sys.executable, str(script), json.dumps(spec)], env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"worker failed: {spec}\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(line[len("RESULT "):])
    result.update({k: round(v, 2) for k, v in usage.items()})
    result["tokens_per_s"] = result["tokens"] / result["time_s"]
    result["tokens_per_cpu_s"] = result["tokens"] / result["cpu_s"]
    return result


def cli_help_time(reps: int = 3) -> dict[str, Any]:
    """Wall time of ``nxd-finetune --help`` (median of ``reps``; the first warms the OS file cache)."""
    exe = str(Path(sys.executable).with_name("nxd-finetune"))
    subprocess.run([exe, "--help"], capture_output=True, cwd=ROOT)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        subprocess.run([exe, "--help"], capture_output=True, check=True, cwd=ROOT)
        times.append(time.perf_counter() - t)
    return {"median_s": sorted(times)[len(times) // 2], "all_s": times}


def quickstart_first_step() -> dict[str, Any]:
    """``nxd-finetune run recipes/quickstart.yaml`` stopped after one step (model and data caches
    warm): the trainer's own ``time_to_first_step_s`` (from ``run()`` entry to the first step,
    including the pre-training eval) and the process wall time (imports, one step, saving)."""
    exe = str(Path(sys.executable).with_name("nxd-finetune"))
    with tempfile.TemporaryDirectory() as out:
        cmd = [exe, "run", "recipes/quickstart.yaml", "training.max_steps=1",
            "training.warmup_steps=0", f"output.dir={out}",
               "logging.progress=false"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        subprocess.run(cmd, capture_output=True, env=env, cwd=ROOT)  # warm caches (model, tokenized data)
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            return {"error": proc.stderr[-2000:]}
        summary = json.loads((Path(out) / "summary.json").read_text())
    return {"time_to_first_step_s": summary["time_to_first_step_s"], "one_step_run_wall_s": round(wall, 2)}

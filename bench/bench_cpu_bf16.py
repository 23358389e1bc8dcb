"""16-bit formats on this CPU: matmul GFLOP/s in fp32, bf16 and fp16 at transformer shapes, and the
quickstart's training speed at ``training.precision`` fp32 against bf16-mixed, as ``nxd-finetune
run`` runs it. Shows what ``run`` / ``validate`` warn about on CPUs without native bf16 (no
AVX512-BF16 / AMX): there torch's bf16 matmuls take a slow fallback path.

    python bench/bench_cpu_bf16.py         # about 3-5 minutes on 2 AVX2 cores

Results: ``bench/results/cpu_bf16.{json,md}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
from bench.report import cpu_model  # noqa: E402

SHAPES = [(512, 2048, 2048), (512, 2048, 8192), (128, 256, 1024)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype, budget_s: float = 20.0) -> float:
    """Best GFLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` over up to 5 repeats (fewer when one
    repeat takes long: at most ``budget_s`` in all)."""
    torch.manual_seed(0)
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    best, spent = float("inf"), 0.0
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
        if spent > budget_s:
            break
    return 2 * m * k * n / best / 1e9


def quickstart_run(precision: str, steps: int) -> dict[str, float]:
    """``nxd-finetune run recipes/quickstart.yaml`` for ``steps`` steps at ``precision``."""
    with tempfile.TemporaryDirectory(prefix="nxd-bench-bf16-") as tmp:
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "nxd_finetune", "run", str(ROOT / "recipes" / "quickstart.yaml"),
               f"training.precision={precision}", f"training.max_steps={steps}", "eval.before=false",
               "eval.every_n_steps=null", "logging.progress=false", "checkpoint.every_n_steps=null",
               f"output.dir={out}"]
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        s = json.loads((out / "summary.json").read_text())
        return {"steps": steps, "train_time_s": s["train_time_s"], "input_tokens_per_s": s["input_tokens_per_s"]}


def main() -> None:
    meta = {"command": "python bench/bench_cpu_bf16.py", "cpu": cpu_model(), "cores": os.cpu_count(),
            "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "native_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
            "native_fp16": bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()), "date": time.strftime("%Y-%m-%d %H:%M")}
    rows = []
    for shape in SHAPES:
        row = {"shape": "x".join(map(str, shape))}
        for name, dtype in DTYPES.items():
            row[name] = round(matmul_gflops(*shape, dtype), 2)
        rows.append(row)
        print(row, flush=True)
    runs = {p: quickstart_run(p, 3) for p in ("fp32", "bf16-mixed")}
    print(runs, flush=True)
    (BENCH / "results" / "cpu_bf16.json").write_text(json.dumps({"meta": meta, "matmul": rows, "runs": runs}, indent=2))
    md = ["# 16-bit formats on this CPU", "",
          f"`{meta['command']}` on {meta['cpu']} ({meta['cores']} cores, torch {meta['torch']}, capability "
          f"{meta['capability']}; native bf16: {meta['native_bf16']}, native fp16: {meta['native_fp16']}), "
          f"{meta['date']}.", "", "Matmul `[m, k] @ [k, n]`, best GFLOP/s:", "",
          "| m x k x n | fp32 | bf16 | fp16 | bf16 / fp32 |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['shape']} | {r['fp32']} | {r['bf16']} | {r['fp16']} | {r['bf16'] / r['fp32']:.3f}x |")
    md += ["", "The quickstart (`recipes/quickstart.yaml`, 3 steps, eval off) as `nxd-finetune run` trains it:", "",
           "| training.precision | train time s | input tokens/s |", "|---|---:|---:|"]
    for p, r in runs.items():
        md.append(f"| {p} | {r['train_time_s']:.1f} | {r['input_tokens_per_s']:,.0f} |")
    md.append("")
    (BENCH / "results" / "cpu_bf16.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

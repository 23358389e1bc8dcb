"""Memory that torch's fused CPU attention keeps per sequence length, and what padding packed runs
to ``models.attention.RUN_MULTIPLE`` tokens does about it.

Packed SFT rows run attention once per sample ("run"), so a long training run calls
``scaled_dot_product_attention`` with every sample length its data holds. Each variant below runs,
in its own fresh process, forward + backward of causal GQA attention (32 query heads, 8 kv heads,
head_dim 64: the Llama-3.2-1B shape) over every run length 1..``--max-len``, in a shuffled order,
through ``models.attention._run_attention`` with ``RUN_MULTIPLE`` as given (1 = no padding, the
behaviour before), and records glibc's in-use heap bytes (``mallinfo2``) after each 64 lengths
and the total time. Writes ``bench/results/attention_lengths.{json,md}``.

    python bench/bench_attention_lengths.py              # bf16 and fp32, lengths 1..512, ~1 min
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _in_use_mb() -> float:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def worker(dtype_name: str, multiple: int, max_len: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from nxd_finetune.models import attention

    attention.RUN_MULTIPLE = multiple
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    lengths = list(range(1, max_len + 1))
    random.Random(0).shuffle(lengths)

    def one(n: int) -> None:
        q = torch.randn(1, n, 32, 64, dtype=dtype, requires_grad=True)
        k = torch.randn(1, n, 8, 64, dtype=dtype, requires_grad=True)
        v = torch.randn(1, n, 8, 64, dtype=dtype, requires_grad=True)
        attention._run_attention(q, k, v, [n]).sum().backward()

    one(64)  # the first call's one-off allocations (thread pools, kernels for this length)
    base, curve = _in_use_mb(), []
    t0 = time.perf_counter()
    for i, n in enumerate(lengths, 1):
        one(n)
        if i % 64 == 0 or i == len(lengths):
            curve.append([i, round(_in_use_mb() - base, 1)])
    return {"dtype": dtype_name, "run_multiple": multiple, "lengths": len(lengths), "max_len": max_len,
            "growth_mb": curve, "seconds": round(time.perf_counter() - t0, 2)}


def render(meta: dict, rows: list[dict]) -> str:
    lines = ["# Fused CPU attention: memory kept per sequence length", "",
             f"`{meta['command']}` on {meta['machine']}, torch {meta['torch']}, {meta['date']}.", "",
             "Forward + backward of causal GQA attention (32 / 8 heads, head_dim 64) once per run length "
             f"1..{rows[0]['max_len']} in a shuffled order, each variant in a fresh process; glibc in-use heap "
             "growth after the lengths (`mallinfo2`).", "",
             "| dtype | runs padded to | heap growth after 64 / 256 / all lengths (MB) | time s |",
             "|---|---:|---|---:|"]
    for r in rows:
        at = dict((n, mb) for n, mb in r["growth_mb"])
        picks = [at.get(64), at.get(256), r["growth_mb"][-1][1]]
        growth = " / ".join(f"{p:,.1f}" for p in picks if p is not None)
        lines.append(f"| {r['dtype']} | {r['run_multiple']} | {growth} | {r['seconds']:.1f} |")
    lines += ["", "Runs padded to 1 = every length reaches the kernel (the behaviour before "
              "`RUN_MULTIPLE`); 64 = the default.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), int(args.worker[2]))))
        return
    import torch

    rows = []
    for dtype in ("bf16", "fp32"):
        for multiple in (1, 64):
            out = subprocess.run([sys.executable, __file__, "--worker", dtype, str(multiple), str(args.max_len)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{dtype} runs padded to {multiple}: +{r['growth_mb'][-1][1]:,.1f} MB, {r['seconds']:.1f} s",
                  flush=True)
    meta = {"command": "python bench/bench_attention_lengths.py", "torch": torch.__version__,
            "machine": f"{platform.processor() or platform.machine()}", "date": time.strftime("%Y-%m-%d %H:%M")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "attention_lengths.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (RESULTS / "attention_lengths.md").write_text(render(meta, rows))
    print(render(meta, rows))


if __name__ == "__main__":
    main()

"""Data preparation at scale: tokenizing a 200,000-conversation messages set, 1 process against
every core (``data.num_proc``), with samples/s, tokens/s and peak memory, and whether memory grows
with the number of samples beyond the tokenized arrays.

    python bench/bench_tokenize.py            # 200k conversations, ~5 min on 2 cores
    python bench/bench_tokenize.py --quick    # 20k conversations

The set is generated here (fixed seed; under ``bench/.cache/``, not committed): multi-turn
conversations (a quarter two turns, 30% with a system message) of 20-600 words drawn from the
quickstart corpus's sentences, log-uniform lengths. The tokenizer is the quickstart's BPE with its
chat template (built locally). Each measurement runs :func:`nxd_finetune.data.datasets.tokenize_rows` in
a fresh process on rows loaded with ``datasets`` (memory-mapped Arrow), and reports the main
process's peak resident memory (``VmHWM``), the workers' (``RUSAGE_CHILDREN``: the largest one)
and the bytes of the resulting arrays. Results: ``bench/results/tokenize.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CACHE = BENCH / ".cache" / "tokenize"
SYSTEM = "You are a helpful assistant. Answer in plain sentences."


def make_data(n: int) -> Path:
    out = CACHE / f"conversations-{n}.jsonl"
    if out.is_file():
        return out
    sys.path.insert(0, str(ROOT))
    from nxd_finetune.quickstart import CORPUS

    words = CORPUS.read_text().split()
    rng = random.Random(20241124)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for _ in range(n):
            total = int(math.exp(rng.uniform(math.log(20), math.log(600))))
            turns = 2 if rng.random() < 0.25 and total >= 60 else 1
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
            for _ in range(turns):
                share = total // turns
                prompt = max(1, int(share * rng.uniform(0.2, 0.8)))
                for role, k in (("user", prompt), ("assistant", max(1, share - prompt))):
                    start = rng.randrange(len(words) - k)
                    messages.append({"role": role, "content": " ".join(words[start:start + k])})
            f.write(json.dumps({"messages": messages}) + "\n")
    tmp.rename(out)
    return out


def _status_mb(key: str = "VmHWM") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _hwm_mb() -> float:
    return _status_mb("VmHWM")


def measure(path: str, rows: int, num_proc: int) -> dict:
    """One measurement (in this fresh process)."""
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from nxd_finetune.data.datasets import DataSpec, load_rows, tokenize_rows
    from nxd_finetune.quickstart import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    data = load_rows(path)
    if rows < len(data):
        data = data.select(range(rows))
    before, file_before = _hwm_mb(), _status_mb("RssFile")
    t0 = time.perf_counter()
    result = tokenize_rows(data, DataSpec(train=path, format="messages", max_seq_len=4096, num_proc=num_proc), tok)
    seconds = time.perf_counter() - t0
    arrays = sum(t.numel() * t.element_size() for t in (result.input_ids, result.labels, result.offsets))
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"rows": rows, "num_proc": num_proc, "seconds": round(seconds, 2),
            "samples_per_s": round(rows / seconds), "tokens_per_s": round(result.stats["tokens"] / seconds),
            "tokens": result.stats["tokens"], "arrays_mb": round(arrays / 2**20, 1),
            "hwm_before_mb": round(before, 1), "peak_main_mb": round(_hwm_mb(), 1),
            "peak_worker_mb": round(children, 1) if num_proc > 1 else None,
            "growth_mb": round(_hwm_mb() - before - arrays / 2**20, 1),
            "mapped_input_mb": round(_status_mb("RssFile") - file_before, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", nargs=3, metavar=("PATH", "ROWS", "PROCS"), help=argparse.SUPPRESS)
    ap.add_argument("--note", action="append", default=[])
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), int(args.one[2]))))
        return
    n = 20_000 if args.quick else 200_000
    path = make_data(n)
    runs = [(n, 1), (n, 2)] + [(n * k // 4, 1) for k in (1, 2)]
    results = []
    for rows, procs in runs:
        out = subprocess.run([sys.executable, __file__, "--one", str(path), str(rows), str(procs)], capture_output=True,
                             text=True, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    name = "tokenize_quick" if args.quick else "tokenize"
    meta = {"command": f"python bench/bench_tokenize.py{' --quick' if args.quick else ''}",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M"),
            "file_mb": round(path.stat().st_size / 2**20, 1), "notes": args.note}
    (BENCH / "results" / f"{name}.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=2))
    md = [f"# Tokenizing {n:,} conversations", "",
          f"`{meta['command']}` on {meta['machine']}, {meta['date']}: a {meta['file_mb']} MB messages JSONL, the "
          "quickstart BPE tokenizer and chat template, `max_seq_len` 4096, each run in a fresh process.", "",
          "| rows | processes | seconds | samples/s | tokens/s | arrays MB | peak main MB | peak worker MB "
          "| main peak - start - arrays MB | of which mapped input MB |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(results, key=lambda r: (r["num_proc"], r["rows"])):
        md.append(f"| {r['rows']:,} | {r['num_proc']} | {r['seconds']} | {r['samples_per_s']:,} "
                  f"| {r['tokens_per_s']:,} | {r['arrays_mb']} | {r['peak_main_mb']} "
                  f"| {r['peak_worker_mb'] or '-'} | {r['growth_mb']} | {r['mapped_input_mb']} |")
    md += ["", "- *main peak - start - arrays*: the main process's peak beyond what it had before tokenizing "
           "and the tokenized arrays themselves. *mapped input*: the part of it that is pages of the rows' "
           "memory-mapped Arrow file (clean page cache the kernel can drop, but counted in resident memory).",
           *(f"- {x}" for x in meta["notes"]), ""]
    (BENCH / "results" / f"{name}.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Peak host memory of the loss: full-vocabulary cross entropy against the chunked one.

Each configuration runs in a fresh process: hidden states ``[tokens, hidden]`` at the target
positions and an output layer ``[vocab, hidden]`` (fp32, the trainable case), then forward +
backward of the summed cross entropy, either over the whole ``[tokens, vocab]`` logits
(``F.cross_entropy``, what a plain trainer does) or through ``nxd_finetune.loss.chunked_ce_sum``
(``training.loss_chunk_tokens: auto``). Reported: the peak RSS during the loss minus the RSS
before it (inputs allocated), and the time of forward + backward. The loss's memory is its
logits, softmax and logit gradient, all ``tokens x vocab``: the hidden size only sets the
matmul time, so the default keeps it small to finish in a minute on 2 cores.

    python bench/bench_loss_memory.py                       # 128256 vocab, 8192 tokens, hidden 256
    python bench/bench_loss_memory.py --tokens 2048 8192 --hidden 2048

Writes ``bench/results/loss_memory.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _one(mode: str, tokens: int, hidden: int, vocab: int) -> dict:
    import torch
    import torch.nn.functional as F

    from nxd_finetune.loss import chunk_rows, chunked_ce_sum

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, requires_grad=True)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    targets = torch.randint(0, vocab, (tokens,))
    base = _rss_mb()
    t0 = time.perf_counter()
    if mode == "plain":
        loss = F.cross_entropy(head(h).float(), targets, reduction="sum")
    else:
        loss = chunked_ce_sum(h, head, targets, chunk_rows(vocab, "auto"))
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "tokens": tokens, "hidden": hidden, "vocab": vocab, "loss": float(loss),
            "rows_per_chunk": None if mode == "plain" else chunk_rows(vocab, "auto"),
            "peak_mb": round(peak - base, 1), "seconds": round(seconds, 2),
            "logits_fp32_mb": round(tokens * vocab * 4 / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        mode, tokens, hidden, vocab = args.one
        print(json.dumps(_one(mode, int(tokens), int(hidden), int(vocab))))
        return
    rows = []
    for tokens in args.tokens:
        for mode in ("plain", "chunked"):
            out = subprocess.run([sys.executable, __file__, "--one", mode, str(tokens), str(args.hidden),
                                  str(args.vocab)], capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "loss_memory.json").write_text(json.dumps(rows, indent=2))
    lines = ["# Loss peak memory: full-vocabulary vs chunked cross entropy", "",
             f"`python bench/bench_loss_memory.py --tokens {' '.join(map(str, args.tokens))} --hidden {args.hidden} "
             f"--vocab {args.vocab}`; forward + backward, fp32, each row in a fresh process; peak RSS above "
             "the inputs.", "",
             "| tokens | vocab | loss | rows per chunk | peak MB | fp32 logits MB | time s | loss value |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['vocab']} | {r['mode']} | {r['rows_per_chunk'] or '-'} | "
                     f"{r['peak_mb']:,.0f} | {r['logits_fp32_mb']:,.0f} | {r['seconds']} | {r['loss']:.2f} |")
    for tokens in args.tokens:
        plain, chunked = (next(r for r in rows if r["tokens"] == tokens and r["mode"] == m)
                          for m in ("plain", "chunked"))
        lines.append("")
        lines.append(f"At {tokens} tokens the chunked loss peaks at {chunked['peak_mb']:,.0f} MB against "
                     f"{plain['peak_mb']:,.0f} MB: {plain['peak_mb'] / max(chunked['peak_mb'], 1):.1f}x less.")
    (RESULTS / "loss_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

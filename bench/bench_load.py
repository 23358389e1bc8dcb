"""Time to load a real-size checkpoint against the time to read its bytes.

Builds (once, under ``bench/.cache/models/``) a Llama-3.2-1B-shaped checkpoint: hidden 2048, 16
layers, 32/8 heads, ffn 8192, vocab 128256, tied embeddings, llama3 rope scaling, random init, bf16,
1 GB safetensors shards (3.0 GB: transformers writes the tied head too). Then, each in a fresh
process, alternating, ``--reps`` times:

- *read*: every shard file read start to end in 64 MiB blocks (what loading must at least do);
- *load*: what a 1-process ``nxd-finetune run`` does to get the weights: the model built on the
  meta device, then ``models.materialize`` of every tensor in bf16 (plus ``DecoderConfig`` parsing).

Both read through the page cache; the first ``read`` after the build warms it, and the table
reports the medians. Writes ``bench/results/load_time.{json,md}``.

    python bench/bench_load.py            # ~3 min the first time (building the checkpoint), then ~1 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
MODEL = ROOT / ".cache" / "models" / "llama-3.2-1b-shape-bf16"
RESULTS = ROOT / "results"
CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
              num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
              rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def build() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (MODEL / "config.json").is_file():
        return
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG, dtype="bfloat16"))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(MODEL, max_shard_size="1GB")


def read_once() -> float:
    t0 = time.perf_counter()
    for f in sorted(MODEL.glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    return time.perf_counter() - t0


def load_once() -> float:
    import torch

    from nxd_finetune.models import DecoderConfig, build_model, materialize

    t0 = time.perf_counter()
    config = DecoderConfig.from_hf(MODEL)
    model = build_model(config)
    materialize(model, MODEL, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t0
    assert sum(p.numel() for p in model.parameters()) > 1.2e9
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--one", choices=["read", "load"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps({"seconds": read_once() if args.one == "read" else load_once()}))
        return
    build()
    size = sum(f.stat().st_size for f in MODEL.glob("*.safetensors"))
    read_once()  # warm the page cache
    times: dict[str, list[float]] = {"read": [], "load": []}
    for _ in range(args.reps):
        for what in ("read", "load"):
            out = subprocess.run([sys.executable, __file__, "--one", what], capture_output=True, text=True, check=True)
            times[what].append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"bytes": size, "times": times, "median_s": med, "ratio": med["load"] / med["read"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load_time.json").write_text(json.dumps(result, indent=2))
    md = ["# Checkpoint load time against reading its bytes", "",
          f"`python bench/bench_load.py --reps {args.reps}`: Llama-3.2-1B shape, bf16, {size / 1e9:.2f} GB in "
          f"{len(list(MODEL.glob('*.safetensors')))} safetensors files, page cache warm, each timing in a fresh "
          "process, medians.", "",
          "| what | median s | GB/s | all runs (s) |", "| --- | ---: | ---: | --- |"]
    for k in ("read", "load"):
        md.append(f"| {k} | {med[k]:.2f} | {size / 1e9 / med[k]:.2f} | {', '.join(f'{t:.2f}' for t in times[k])} |")
    md += ["", f"Load / read: {result['ratio']:.2f}x."]
    (RESULTS / "load_time.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""LoRA SFT throughput and memory: nxd-finetune vs HF transformers + peft (eager), side by side.

    python bench/bench_lora.py            # full run (both shapes), ~15 min on 2 CPU cores
    python bench/bench_lora.py --quick    # smoke run: small shape, 64 samples
    make bench

For each model shape (bench/common.py) it runs, each in its own subprocess (bench/worker.py):

- ``ours/packed``: nxd-finetune with packing (best-fit rows of 512 tokens), our trainer's loop;
- ``ours/padded``: nxd-finetune with packing off: the *same* padded micro-batches as HF's;
- ``hf/padded``: ``LlamaForCausalLM`` + ``get_peft_model``, micro-batches padded to the longest
  sample (``DataCollatorForSeq2Seq``), a plain loop with the same AdamW, schedule and clipping.

The data is ``bench/data/sft.jsonl`` (``bench/make_data.py``). Every configuration excludes its warmup
steps and then times one pass over the same training samples, so they process the same non-padding
tokens. Results go to ``bench/results/lora_cpu[_quick].{json,md}`` (bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report, system  # noqa: E402
from bench.common import BENCH, CACHE, MAX_SEQ_LEN, SEED, SHAPES, ensure_model, recipe_dict, train_flops  # noqa: E402

PADDED_MBS, PACKED_MBS, GRAD_ACCUM = 4, 1, 2  # ~1180 vs ~1000 non-padding tokens per optimizer step


def prepare_data(shape: str, max_samples: int | None, warmup: int) -> tuple[Path, list[int]]:
    """Tokenize once (fills the data cache the ``ours`` workers read) and write HF's optimizer
    steps: the padded micro-batches our loader yields with packing off (same samples, same order).
    Returns the batches file and the sample lengths (for the FLOP count)."""
    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft.build import load_tokenizer
    from nxd_finetune.sft.loader import build_dataloaders

    recipe = recipe_from_dict(recipe_dict(shape, False, PADDED_MBS, GRAD_ACCUM, max_samples))
    tok = load_tokenizer(recipe, Path(recipe.model.path))
    data = build_dataloaders(recipe.data, tok, micro_batch_size=PADDED_MBS, seed=SEED)
    ds, sampler = data.train.dataset, data.train.sampler
    batches = [[ds[i] for row in b for i in data.train.rows[row]] for b in sampler.rank_batches(0)]
    steps = [batches[i : i + GRAD_ACCUM] for i in range(0, len(batches) - GRAD_ACCUM + 1, GRAD_ACCUM)]
    out = CACHE / f"hf_batches_{shape}_{max_samples}.json"
    out.write_text(json.dumps({"warmup": steps[:warmup], "timed": steps}))
    return out, ds.lengths.tolist()


def run_config(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    gate = system.wait_quiet(args.max_busy, args.max_wait)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc, usage = system.run_measured([sys.executable, str(BENCH / "worker.py"), json.dumps(spec)], env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"worker failed: {spec}\n{proc.stderr[-4000:]}")
    result = json.loads(line[len("RESULT "):])
    result.update(gate, **{k: round(v, 2) for k, v in usage.items()})
    print(f"  {spec['framework']:4s} {'packed' if spec.get('packing') else 'padded'}: "
          f"{result['tokens'] / result['time_s']:.0f} tok/s, step {result['step_s_mean']:.3f}s, "
          f"peak RSS {result['peak_rss_mb']:.0f} MB, other load {usage['other_cores']:.2f} cores", flush=True)
    return result


def bench_shape(shape: str, args: argparse.Namespace, peak: float) -> list[dict[str, Any]]:
    max_samples = args.max_samples or (64 if args.quick else {"small": None, "large": 128}[shape])
    warmup = 1 if args.quick else 2
    model_dir = ensure_model(shape)
    batches, lengths = prepare_data(shape, max_samples, warmup)
    config = json.loads((model_dir / "config.json").read_text())
    flops_per_token = train_flops(config, 16, lengths) / sum(lengths)
    base = dict(shape=shape, grad_accum=GRAD_ACCUM, warmup_steps=warmup, max_samples=max_samples,
                flush_denormal=True)
    specs = [
        dict(base, framework="ours", packing=True, micro_batch_size=PACKED_MBS),
        dict(base, framework="ours", packing=False, micro_batch_size=PADDED_MBS),
        dict(base, framework="hf", micro_batch_size=PADDED_MBS, batches=str(batches)),
    ]
    if args.hf_no_flush:
        specs.append(dict(specs[-1], flush_denormal=False))
    rows = []
    print(f"{shape}: {config['hidden_size']}h x {config['num_hidden_layers']}L, vocab {config['vocab_size']}, "
          f"{len(lengths)} samples", flush=True)
    for spec in specs:
        r = run_config(spec, args)
        r["tokens_per_s"] = r["tokens"] / r["time_s"]
        r["flops_per_s"] = r["tokens_per_s"] * flops_per_token
        r["mfu"] = r["flops_per_s"] / peak
        r["shape_config"] = {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "intermediate_size", "vocab_size")}
        r["flops_per_token"] = flops_per_token
        rows.append(r)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short smoke run (small shape, 64 samples)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: small large (quick: small)")
    ap.add_argument("--max-samples", type=int, default=None, help="training samples per shape")
    ap.add_argument("--max-busy", type=float, default=0.4,
                    help="before each configuration wait until other processes keep fewer cores busy")
    ap.add_argument("--max-wait", type=float, default=120.0, help="... but at most this many seconds")
    ap.add_argument("--hf-no-flush", action="store_true", help="also run HF without set_flush_denormal")
    ap.add_argument("--skip-cli", action="store_true", help="skip the --help / quickstart timings")
    ap.add_argument("--out", default=None, help="results basename (default lora_cpu[_quick])")
    args = ap.parse_args()
    shapes = args.shapes or (["small"] if args.quick else ["small", "large"])

    import torch
    import transformers

    try:
        import peft
        peft_version = peft.__version__
    except ImportError:
        raise SystemExit("the benchmark needs peft: pip install -e '.[dev]'") from None
    t0 = time.time()
    peak = system.matmul_peak()
    print(f"fp32 matmul peak: {peak['flops_per_s'] / 1e9:.1f} GFLOP/s ({peak['threads']} threads)", flush=True)
    rows = []
    for shape in shapes:
        rows += bench_shape(shape, args, peak["flops_per_s"])
    cli = {} if args.skip_cli else {"help": system.cli_help_time(), "quickstart": system.quickstart_first_step()}
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "duration_s": round(time.time() - t0),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "cpu_model": report.cpu_model(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "peft": peft_version,
                    "python": platform.python_version()},
        "matmul_peak": peak, "max_seq_len": MAX_SEQ_LEN, "grad_accum": GRAD_ACCUM,
        "micro_batch": {"packed_rows": PACKED_MBS, "padded_samples": PADDED_MBS},
        "cli": cli, "runs": rows, "quick": args.quick,
    }
    name = args.out or ("lora_cpu_quick" if args.quick else "lora_cpu")
    out = BENCH / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    md = report.markdown(results)
    (out / f"{name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

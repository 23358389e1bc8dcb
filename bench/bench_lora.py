"""LoRA SFT throughput and memory: nxd-finetune vs HF transformers + peft (eager), side by side.

    python bench/bench_lora.py                 # both shapes, 3 interleaved repeats, 1 thread (~30 min)
    python bench/bench_lora.py --quick         # smoke run: small shape, 64 samples, 1 repeat
    python bench/bench_lora.py --threads 2     # torch threads per worker (default 1)
    make bench

For each model shape (bench/common.py) five configurations run, each in its own subprocess
(bench/worker.py; TRL's in bench/trl_sft_worker.py), on the same training samples
(bench/data/sft.jsonl, variable length):

- ``ours/packed``: nxd-finetune with packing (best-fit rows of 512 tokens), the trainer's loop;
- ``ours/padded``: nxd-finetune with packing off: the *same* padded micro-batches as ``hf/padded``;
- ``hf/padded``: ``LlamaForCausalLM`` + ``get_peft_model``, micro-batches of 4 samples padded to the
  longest (``DataCollatorForSeq2Seq``), a plain loop with the same AdamW, schedule and clipping;
- ``hf/packed``: the same micro-batches flattened without padding (``DataCollatorWithFlattening``,
  HF's padding-free packing; sdpa attention then masks across samples from the position ids);
- ``trl/packed``: TRL's ``SFTTrainer`` + peft on the raw messages, ``packing=True`` (best-fit rows of
  512 tokens, padding-free), ``assistant_only_loss=True``, 1 row per micro-batch as ours packed.

Fair under contention (the machine may be shared): the configurations are interleaved -- repeat
``r`` runs them in an order rotated by ``r`` -- and each row reports the median over repeats of
tokens per second of process CPU time (robust to other processes taking cores when ``--threads 1``)
as well as of wall time, with the other processes' core usage measured during each run.
Results go to ``bench/results/<out>.{json,md}`` (bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report, system  # noqa: E402
from bench.common import BENCH, CACHE, MAX_SEQ_LEN, SEED, SHAPES, ensure_model, recipe_dict, train_flops  # noqa: E402

PADDED_MBS, PACKED_MBS, GRAD_ACCUM = 4, 1, 2  # ~1180 vs ~1000 non-padding tokens per optimizer step
CONFIGS = (("ours", True), ("hf", False), ("ours", False), ("hf", True), ("trl", True))  # ours / others alternate
COMPILED = ("ours-compile", True)  # --compile: ours packed with model.compile (after 3 warm-up steps)
WORKERS = {"ours": "worker.py", "ours-compile": "worker.py", "hf": "worker.py", "trl": "trl_sft_worker.py"}


def prepare_data(shape: str, max_samples: int | None, warmup: int) -> tuple[Path, list[int]]:
    """Tokenize once (fills the data cache the ``ours`` workers read) and write HF's optimizer
    steps: the padded micro-batches our loader yields with packing off (same samples, same order).
    Returns the batches file and the sample lengths (for the FLOP count)."""
    from nxd_finetune.data.inputs import load_tokenizer
    from nxd_finetune.data.loader import build_dataloaders
    from nxd_finetune.recipe import recipe_from_dict

    recipe = recipe_from_dict(recipe_dict(shape, False, PADDED_MBS, GRAD_ACCUM, max_samples))
    tok = load_tokenizer(recipe, Path(recipe.model.path))
    data = build_dataloaders(recipe.data, tok, micro_batch_size=PADDED_MBS, seed=SEED)
    ds, rows, sampler = data.train.batch_of.dataset, data.train.batch_of.rows, data.train.sampler
    batches = [[ds[i] for row in b for i in rows[row]] for b in sampler.rank_batches(0)]
    steps = [batches[i : i + GRAD_ACCUM] for i in range(0, len(batches) - GRAD_ACCUM + 1, GRAD_ACCUM)]
    out = CACHE / f"hf_batches_{shape}_{max_samples}.json"
    out.write_text(json.dumps({"warmup": steps[:warmup], "timed": steps}))
    return out, ds.lengths.tolist()


def run_config(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    gate = system.wait_quiet(args.max_busy, args.max_wait)
    result = {**system.run_worker(BENCH / WORKERS[spec["framework"]], spec), **gate}
    print(f"  {spec['framework']:4s} {'packed' if spec['packing'] else 'padded'}: "
          f"{result['tokens_per_cpu_s']:.0f} tok/CPU-s, {result['tokens_per_s']:.0f} tok/s wall, "
          f"step {result['step_s_median']:.3f}s, peak RSS {result['peak_rss_mb']:.0f} MB, "
          f"other load {result['other_cores']:.2f} cores", flush=True)
    return result


def summarise(runs: list[dict[str, Any]], flops_per_token: float, peak: dict[str, Any]) -> dict[str, Any]:
    """Medians over the repeats of one configuration (the runs themselves are kept in the JSON)."""

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    cpu_tps, wall_tps = med("tokens_per_cpu_s"), med("tokens_per_s")
    return {
        "spec": runs[0]["spec"], "repeats": len(runs), "threads": runs[0]["threads"],
        "tokens": runs[0]["tokens"], "slots": runs[0]["slots"], "steps": runs[0]["steps"],
        "tokens_per_cpu_s": cpu_tps, "tokens_per_s": wall_tps,
        "tokens_per_s_range": [min(r["tokens_per_s"] for r in runs), max(r["tokens_per_s"] for r in runs)],
        "tokens_per_cpu_s_range": [min(r["tokens_per_cpu_s"] for r in runs),
                                   max(r["tokens_per_cpu_s"] for r in runs)],
        "step_s_median": med("step_s_median"), "peak_rss_mb": med("peak_rss_mb"),
        # useful FLOPs per CPU-second (per busy core) against the matmul peak per CPU-second
        "flops_per_cpu_s": cpu_tps * flops_per_token, "flops_per_s": wall_tps * flops_per_token,
        "mfu_cpu": cpu_tps * flops_per_token / peak["flops_per_cpu_s"],
        "mfu_wall": wall_tps * flops_per_token / peak["flops_per_s"],
        "first_loss": runs[0]["first_loss"], "other_cores": med("other_cores"), "load1_before": med("load1_before"),
    }


def bench_shape(shape: str, args: argparse.Namespace, peaks: dict[int, dict[str, Any]]) -> dict[str, Any]:
    max_samples = args.max_samples or (64 if args.quick else {"small": 256, "large": 48}[shape])
    warmup = 1
    model_dir = ensure_model(shape)
    batches, lengths = prepare_data(shape, max_samples, warmup)
    config = json.loads((model_dir / "config.json").read_text())
    flops_per_token = train_flops(config, 16, lengths) / sum(lengths)
    base = dict(shape=shape, grad_accum=GRAD_ACCUM, warmup_steps=warmup, max_samples=max_samples,
                threads=args.threads)
    configs = CONFIGS + ((COMPILED,) if args.compile else ())
    specs = {(fw, packing): dict(base, framework=fw, packing=packing,
                                 micro_batch_size=PACKED_MBS if fw != "hf" and packing else PADDED_MBS,
                                 **({"batches": str(batches)} if fw == "hf" else {}),
                                 **({"warmup_steps": 3} if fw == "ours-compile" else {}))
             for fw, packing in configs}
    print(f"{shape}: {config['hidden_size']}h x {config['num_hidden_layers']}L, vocab {config['vocab_size']}, "
          f"{len(lengths)} samples, {sum(lengths)} tokens", flush=True)
    runs: dict[tuple[str, bool], list[dict[str, Any]]] = {k: [] for k in specs}
    for rep in range(args.reps):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        print(f" repeat {rep + 1}/{args.reps}", flush=True)
        for key in order:
            runs[key].append(run_config(specs[key], args))
    peak = peaks[args.threads or os.cpu_count() or 1]
    rows = [summarise(runs[k], flops_per_token, peak) for k in configs]
    return {"shape": shape, "shape_config": {k: config[k] for k in (
                "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size")},
            "samples": len(lengths), "tokens": sum(lengths), "flops_per_token": flops_per_token,
            "rows": rows, "runs": [r for k in configs for r in runs[k]]}


def measure_peaks(before: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """fp32 matmul peaks with 1 thread and with all cores; with ``before``, the better of each."""
    peaks = [system.matmul_peak(threads=n) for n in sorted({1, os.cpu_count() or 1})]
    if before:
        peaks = [{k: max(a[k], b[k]) if k.startswith("flops") else a[k] for k in a}
                 for a, b in zip(peaks, before, strict=True)]
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: small shape, 64 samples, 1 repeat")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="default: small large (quick: small)")
    ap.add_argument("--max-samples", type=int, default=None, help="training samples (default: small 256, large 48)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repeats of every configuration (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker; 0 = torch's default")
    ap.add_argument("--max-busy", type=float, default=0.5,
                    help="before each configuration wait until other processes keep fewer cores busy")
    ap.add_argument("--max-wait", type=float, default=10.0, help="... but at most this many seconds")
    ap.add_argument("--compile", action="store_true",
                    help="also run ours packed with model.compile (3 warm-up steps: the compile is not timed)")
    ap.add_argument("--skip-cli", action="store_true", help="skip the --help / quickstart timings")
    ap.add_argument("--out", default=None, help="results basename (default lora_cpu[_quick])")
    args = ap.parse_args()
    args.threads = args.threads or None
    args.reps = args.reps or (1 if args.quick else 3)
    shapes = args.shapes or (["small"] if args.quick else ["small", "large"])

    import torch
    import transformers

    try:
        import peft
        import trl
    except ImportError:
        raise SystemExit("the benchmark needs peft and trl: pip install -e '.[dev]'") from None
    t0 = time.time()
    peaks_info = measure_peaks()
    peaks = {p["threads"]: p for p in peaks_info}
    print("fp32 matmul peak: " + ", ".join(f"{p['flops_per_s'] / 1e9:.1f} GFLOP/s wall, "
                                           f"{p['flops_per_cpu_s'] / 1e9:.1f} per CPU-s ({p['threads']} threads)"
                                           for p in peaks_info), flush=True)
    shape_results = [bench_shape(shape, args, peaks) for shape in shapes]
    peaks_info = measure_peaks(peaks_info)  # again at the end: the best of both counts
    peak = {p["threads"]: p for p in peaks_info}[args.threads or os.cpu_count() or 1]
    for result in shape_results:  # % peak against the final peaks
        for row in result["rows"]:
            row["mfu_cpu"] = row["flops_per_cpu_s"] / peak["flops_per_cpu_s"]
            row["mfu_wall"] = row["flops_per_s"] / peak["flops_per_s"]
    cli = {} if args.skip_cli else {"help": system.cli_help_time(), "quickstart": system.quickstart_first_step()}
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "duration_s": round(time.time() - t0),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "cpu_model": report.cpu_model(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "peft": peft.__version__, "trl": trl.__version__,
                    "python": platform.python_version()},
        "matmul_peak": peaks_info, "threads": args.threads, "reps": args.reps, "max_seq_len": MAX_SEQ_LEN,
        "grad_accum": GRAD_ACCUM, "micro_batch": {"packed_rows": PACKED_MBS, "padded_samples": PADDED_MBS},
        "cli": cli, "shapes": shape_results, "quick": args.quick,
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

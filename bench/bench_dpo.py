"""DPO throughput and memory: nxd-finetune vs TRL ``DPOTrainer`` + peft, side by side.

    python bench/bench_dpo.py                  # large shape, 12 pairs, 2 interleaved repeats (~5-8 min)
    python bench/bench_dpo.py --quick          # smoke run: small shape, 8 pairs, 1 repeat
    python bench/bench_dpo.py --pairs 32 --reps 3 --threads 2

The model is the LoRA bench's random-init Llama (bench/common.py; ``large``: hidden 1024, 8 layers,
vocab 32000), the data ``bench/.cache/dpo_pairs.jsonl``: 256 preference pairs (prompt / chosen /
rejected strings of quickstart-corpus sentences, prompt 60-200 tokens, completions 40-200),
generated deterministically here; a run uses the first ``--pairs``. Each configuration runs in its
own process (bench/dpo_worker.py): DPO (sigmoid, beta 0.1), LoRA r16 alpha 32 on every linear,
fp32, 2 pairs per optimizer step, reference = the base model, its log-probs precomputed (both
sides), one warm-up step not timed. Repeat ``r`` runs ours then TRL, or TRL then ours (alternating).
Results: ``bench/results/<out>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report, system  # noqa: E402
from bench.common import BENCH, CACHE, SHAPES, ensure_model  # noqa: E402
from bench.make_data import _sentences, _text  # noqa: E402

DATA = CACHE / "dpo_pairs.jsonl"
N_PAIRS, DATA_SEED = 256, 20261126
FRAMEWORKS = ("ours", "trl")
LABELS = {"ours": "nxd-finetune (dpo)", "trl": "TRL DPOTrainer + peft"}


def make_pairs() -> Path:
    """``DATA``: N_PAIRS pairs; deterministic (fixed seed, the quickstart corpus and tokenizer)."""
    if DATA.is_file() and sum(1 for _ in DATA.open()) == N_PAIRS:
        return DATA
    from transformers import AutoTokenizer

    from nxd_finetune.quickstart import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    rng, sentences = random.Random(DATA_SEED), _sentences()
    rows = [{"prompt": _text(rng, sentences, rng.randint(60, 200), count) + "\n",
             "chosen": _text(rng, sentences, rng.randint(40, 200), count),
             "rejected": _text(rng, sentences, rng.randint(40, 200), count)} for _ in range(N_PAIRS)]
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DATA


def run_config(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    gate = system.wait_quiet(args.max_busy, args.max_wait)
    with tempfile.TemporaryDirectory(dir=CACHE) as work:  # fresh data cache: tokenize + reference pass
        result = {**system.run_worker(BENCH / "dpo_worker.py", {**spec, "work": work}), **gate}
    print(f"  {spec['framework']:4s}: {result['tokens_per_s']:.0f} tok/s wall, {result['tokens_per_cpu_s']:.0f} "
          f"tok/CPU-s, step {result['step_s_median']:.2f}s, reference pass {result['reference_pass_s']:.1f}s, "
          f"peak RSS {result['peak_rss_mb']:.0f} MB, step-1 loss {result['first_loss']:.4f}, "
          f"other load {result['other_cores']:.2f} cores", flush=True)
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {"framework": runs[0]["spec"]["framework"], "repeats": len(runs), "tokens": runs[0]["tokens"],
            "steps": runs[0]["steps"], "tokens_per_s": med("tokens_per_s"),
            "tokens_per_s_range": [min(r["tokens_per_s"] for r in runs), max(r["tokens_per_s"] for r in runs)],
            "tokens_per_cpu_s": med("tokens_per_cpu_s"), "step_s_median": med("step_s_median"),
            "reference_pass_s": med("reference_pass_s"), "wall_s": med("wall_s"), "peak_rss_mb": med("peak_rss_mb"),
            "first_loss": runs[0]["first_loss"], "other_cores": med("other_cores")}


def markdown(res: dict[str, Any]) -> str:
    m, rows = res["machine"], {r["framework"]: r for r in res["rows"]}
    trl = rows["trl"]
    lines = [f"# DPO, LoRA r16 all-linear, fp32 CPU: nxd-finetune vs TRL DPOTrainer + peft ({res['date']})", "",
             f"{m['cpu_model']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
             f"trl {m['trl']}, peft {m['peft']}; {res['threads'] or 'default'} torch thread(s) per run, "
             f"{res['reps']} interleaved repeat(s), medians. Shape `{res['shape']}` "
             f"({res['shape_config']}); {res['pairs']} pairs, {res['pairs_per_step']} per step, "
             f"{res['warmup_steps']} warm-up step(s) untimed. Run took {res['duration_s']} s.", "",
             "| framework | tok/s wall [min-max] | vs TRL | tok/s per CPU-s | vs TRL | step (s) | timed tokens | "
             "reference pass (s) | process wall (s) | peak RSS (MB) | RSS vs TRL | step-1 loss | other cores |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fw in FRAMEWORKS:
        r = rows[fw]
        lo, hi = r["tokens_per_s_range"]
        lines.append(f"| {LABELS[fw]} | {r['tokens_per_s']:.0f} [{lo:.0f}-{hi:.0f}] | "
                     f"{r['tokens_per_s'] / trl['tokens_per_s']:.2f}x | {r['tokens_per_cpu_s']:.0f} | "
                     f"{r['tokens_per_cpu_s'] / trl['tokens_per_cpu_s']:.2f}x | {r['step_s_median']:.2f} | "
                     f"{r['tokens']} | {r['reference_pass_s']:.1f} | {r['wall_s']:.0f} | {r['peak_rss_mb']:.0f} | "
                     f"{r['peak_rss_mb'] / trl['peak_rss_mb']:.2f}x | {r['first_loss']:.4f} | "
                     f"{r['other_cores']:.2f} |")
    shared = max(r["other_cores"] for r in res["runs"]) >= 0.1
    lines += ["", "Tokens: non-padding tokens of the chosen and rejected rows of the timed steps. *other cores*: "
              "CPU time other processes used during the run, in cores (" +
              ("the machine was shared)." if shared else "the machine was otherwise idle).")]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: small shape, 8 pairs, 1 repeat")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default large (quick: small)")
    ap.add_argument("--pairs", type=int, default=None, help="pairs trained on (default 12; quick 8)")
    ap.add_argument("--pairs-per-step", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="interleaved repeats (default 2; quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker; 0 = torch's default")
    ap.add_argument("--max-busy", type=float, default=0.5, help="wait before each run until others use fewer cores")
    ap.add_argument("--max-wait", type=float, default=10.0, help="... but at most this many seconds")
    ap.add_argument("--out", default=None, help="results basename (default dpo_cpu[_quick])")
    args = ap.parse_args()
    shape = args.shape or ("small" if args.quick else "large")
    pairs, reps = args.pairs or (8 if args.quick else 12), args.reps or (1 if args.quick else 2)

    import peft
    import torch
    import transformers
    import trl

    t0 = time.time()
    model_dir, data = ensure_model(shape), make_pairs()
    spec = dict(shape=shape, data=str(data), pairs=pairs, pairs_per_step=args.pairs_per_step, warmup_steps=1,
                threads=args.threads or None)
    runs: dict[str, list[dict[str, Any]]] = {fw: [] for fw in FRAMEWORKS}
    for rep in range(reps):
        print(f" repeat {rep + 1}/{reps}", flush=True)
        for fw in (FRAMEWORKS if rep % 2 == 0 else FRAMEWORKS[::-1]):
            runs[fw].append(run_config(dict(spec, framework=fw), args))
    config = json.loads((model_dir / "config.json").read_text())
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "duration_s": round(time.time() - t0), "shape": shape,
        "shape_config": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                "vocab_size")},
        "machine": {"cpu_model": report.cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "trl": trl.__version__, "peft": peft.__version__,
                    "python": platform.python_version(), "load1_at_end": os.getloadavg()[0]},
        "threads": args.threads or None, "reps": reps, "pairs": pairs, "pairs_per_step": args.pairs_per_step,
        "warmup_steps": 1, "rows": [summarise(runs[fw]) for fw in FRAMEWORKS],
        "runs": [r for fw in FRAMEWORKS for r in runs[fw]],
    }
    name = args.out or ("dpo_cpu_quick" if args.quick else "dpo_cpu")
    out = BENCH / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / f"{name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

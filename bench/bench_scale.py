"""Real model sizes on one machine: per-rank peak memory against ``validate``'s estimate, tokens/s
and time to first step, for the parallel layouts, a sequence-length sweep and full SFT.

    python bench/bench_scale.py            # Llama-3.2-1B shape; about an hour on 2 cores
    python bench/bench_scale.py --quick    # a 30M shape, same rows, a few minutes
    python bench/bench_scale.py --report   # redraw the table and plots from the stored results,
                                           # with the estimates recomputed by today's `validate`
    python bench/bench_scale.py --precision fp32   # fp32 weights and compute (results *_fp32.*)

``--precision auto`` (the default) trains in bf16-mixed on a CPU with native bf16 matrix
instructions (AVX512-BF16 / AMX) and in fp32 elsewhere, as ``validate`` advises there: on an
AVX2-only CPU torch's bf16 matmuls take a fallback ~100x slower than fp32. fp32 results are written
beside the bf16 ones, under their own names.

Every row is what a user runs: ``nxd-finetune validate RECIPE --json`` for the estimate, then
``nxd-finetune run RECIPE --nproc N`` in its own processes; the measured numbers come from the
run's ``summary.json`` (each rank's peak resident memory, ``VmHWM``: anonymous memory plus the
checkpoint pages it maps; input tokens/s; time to the first step). A row whose estimate does not fit
in the machine's available memory is skipped and says so.

Rows (LoRA r16 all-linear, bf16-mixed or fp32, packed rows of ``bench/data/sft.jsonl``, eval off), each
run for 8 optimizer steps (3 at the longest sequence): glibc keeps freed tensors for reuse, and
micro-batches of different layouts fragment that cache, so a run's peak grows over its first steps
before it settles. The table shows the peak after the first step beside the run's peak.

- layouts at max_seq_len 512, micro-batch 1 x grad_accum 2: 1 process, tp2, pp2, dp2 + ZeRO-1;
- sequence sweep at 1 process, micro-batch 1 x grad_accum 2: 512 / 2048 / 8192 tokens x
  activation checkpointing none / selective / full;
- full SFT at 1 process and tp2 on the 1B widths with 4 layers (16 bytes per trained parameter:
  the 16-layer model's 20 GB of weights, gradients and AdamW states do not fit in 24 GiB).

The 1B-shaped checkpoint is hidden 2048, 16 layers, 32/8 heads, ffn 8192, vocab 128256, tied
embeddings, llama3 rope scaling, random init, bf16 (built once under ``bench/.cache/models/``, with
the quickstart tokenizer: the data only uses its ids, the model computes all 128256 logits).
Results: ``bench/results/scale[_quick].{json,md}`` and ``scale[_quick]_*.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
MODELS = BENCH / ".cache" / "models"
RESULTS = BENCH / "results"
MiB = 2**20

SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SHAPE_QUICK = dict(SHAPE_1B, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, vocab_size=32000, rope_scaling=None, max_position_embeddings=8192)
SETTINGS = {
    False: dict(name="scale", lora=("llama-3.2-1b-shape", SHAPE_1B), sft=("llama-3.2-1b-shape-4l",
                dict(SHAPE_1B, num_hidden_layers=4)), base_seq=512, seqs=(512, 2048, 8192)),
    True: dict(name="scale_quick", lora=("scale-quick", SHAPE_QUICK), sft=("scale-quick",
               SHAPE_QUICK), base_seq=256, seqs=(256, 1024, 4096)),
}
STEPS, STEPS_LONG = 8, 3  # optimizer steps per row; the longest sequence's rows take ~3 min a step
LAYOUTS = [("1 process", 1, []), ("tp2", 2, ["parallel.tp=2"]), ("pp2", 2, ["parallel.pp=2"]),
           ("dp2 + ZeRO-1", 2, ["parallel.zero1=true"])]
RECIPE = """\
model: {{path: {model}, dtype: {dtype}}}
data: {{train: {data}, format: messages, max_seq_len: 512, packing: true}}
lora: {{rank: 16, alpha: 32, dropout: 0.0, target_modules: all-linear}}
training: {{micro_batch_size: 1, grad_accum: 2, max_steps: 2, lr: 1.0e-4, warmup_steps: 0,
           precision: {precision}, device: cpu, seed: 0}}
eval: {{before: false}}
checkpoint: {{every_n_steps: null, save_mode: adapter}}
logging: {{every_n_steps: 1, progress: false}}
output: {{dir: {out}}}
"""


def build_model(name: str, shape: dict[str, Any]) -> Path:
    """``bench/.cache/models/<name>``: a random-init (seed 0) bf16 LlamaForCausalLM in 1 GB shards,
    with the quickstart tokenizer next to it. Built once."""
    out = MODELS / name
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nxd_finetune.quickstart import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                 pad_token_id=tok.pad_token_id, dtype="bfloat16"))
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="1GB")
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def steps_for(seq: int, quick: bool, steps: int | None = None) -> int:
    """Optimizer steps per row: enough for the heap to reach (nearly) its steady size. glibc keeps
    freed activations for reuse, and micro-batches of different layouts fragment them: a run's
    peak grows over its first steps (``bench/README.md``). ``steps`` (``--steps``) replaces
    :data:`STEPS`, and caps :data:`STEPS_LONG`."""
    if seq >= SETTINGS[quick]["seqs"][-1]:
        return min(STEPS_LONG, steps or STEPS_LONG)
    return steps or STEPS


def pick_precision(name: str) -> str:
    """``--precision``: ``bf16`` / ``fp32`` as given; ``auto``: bf16 where this CPU has native bf16
    matrix instructions, else fp32 (``validate``'s advice on such a CPU)."""
    if name != "auto":
        return name
    from nxd_finetune.preflight.hardware import cpu_supports

    return "bf16" if cpu_supports("bf16") else "fp32"


def rows_for(quick: bool, steps: int | None = None) -> list[dict[str, Any]]:
    s = SETTINGS[quick]
    base = [f"data.max_seq_len={s['base_seq']}", f"training.max_steps={steps_for(s['base_seq'], quick, steps)}"]
    rows = []
    for name, nproc, extra in LAYOUTS:
        rows.append(dict(group="layout", label=f"LoRA {name}", model="lora", nproc=nproc, seq=s["base_seq"],
                         ac="none", overrides=[*base, *extra]))
    for seq in s["seqs"]:
        for ac in ("none", "selective", "full"):
            rows.append(dict(group="seq", label=f"LoRA {seq} tokens, AC {ac}", model="lora", nproc=1, seq=seq, ac=ac,
                             overrides=[f"data.max_seq_len={seq}", f"parallel.activation_checkpointing={ac}",
                                        "training.grad_accum=2", f"training.max_steps={steps_for(seq, quick, steps)}"]))
    for name, nproc, extra in LAYOUTS[:2]:
        rows.append(dict(group="sft", label=f"full SFT {name}", model="sft", nproc=nproc, seq=s["base_seq"],
                         ac="none", overrides=[*base, "lora=null", "model.dtype=fp32", "training.lr=1e-5", *extra]))
    return rows


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "nxd_finetune", *args], capture_output=True, text=True, env=env,
                          check=check)


def estimate(recipe: Path, row: dict[str, Any]) -> dict[str, Any]:
    out = _cli("validate", str(recipe), f"parallel.nproc={row['nproc']}", *row["overrides"], "--json")
    return json.loads(out.stdout)["memory_per_rank_bytes"]


def available_mb() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] / 1024


def run_row(recipe: Path, row: dict[str, Any], work: Path) -> dict[str, Any]:
    est = estimate(recipe, row)
    result: dict[str, Any] = dict(row, estimate=est)
    need = est["total"] / MiB * row["nproc"]
    if need > available_mb():
        result["skipped"] = f"estimate {need / 1024:.1f} GiB > the {available_mb() / 1024:.1f} GiB available"
        return result
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    proc = _cli("run", str(recipe), "--nproc", str(row["nproc"]), *row["overrides"], f"output.dir={out}",
                check=False)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        result["failed"] = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
        return result
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result["step_peaks_mb"] = [r["peak_host_mb"] for r in records if "peak_host_mb" in r]  # rank 0's, so far
    result.update(memory=summary["memory"], peak_mb=max(r["peak_host_mb"] for r in summary["memory"]),
                  tokens_per_s=summary["input_tokens_per_s"], time_to_first_step_s=summary["time_to_first_step_s"],
                  train_time_s=summary["train_time_s"], input_tokens=summary["input_tokens"],
                  loss=summary["final_loss"])
    return result


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Real model sizes on one machine ({meta['title']})", "",
             f"`{meta['command']}` on {meta['machine']}, {meta['date']}. {meta['shape_note']}", "",
             "Estimate: `nxd-finetune validate --json`, busiest rank. Measured: the highest rank's peak resident "
             "memory (`summary.json` `memory`, VmHWM) of `nxd-finetune run` over its `steps` optimizer steps of 2 "
             "micro-batches; `rank 0 after step 1`: rank 0's peak when its first step was logged (`metrics.jsonl` "
             "`peak_host_mb`).", "",
             "| row | procs | tokens | AC | steps | estimate GiB | rank 0 after step 1 GiB | measured peak GiB | error "
             "| input tokens/s | time to first step s |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        est = r["estimate"]["total"] / 2**30
        if "peak_mb" in r:
            peak = r["peak_mb"] / 1024
            first = f"{r['step_peaks_mb'][0] / 1024:.2f}" if r.get("step_peaks_mb") else "-"
            lines.append(f"| {r['label']} | {r['nproc']} | {r['seq']} | {r['ac']} | {_steps(r)} | {est:.2f} | {first} "
                         f"| {peak:.2f} | {(est - peak) / peak:+.1%} | {r['tokens_per_s']:,.0f} "
                         f"| {r['time_to_first_step_s']:.1f} |")
        else:
            why = r.get("skipped") or f"failed: {r.get('failed')}"
            lines.append(f"| {r['label']} | {r['nproc']} | {r['seq']} | {r['ac']} | {_steps(r)} | {est:.2f} | - | - "
                         f"| {why} | - | - |")
    lines += ["", "Estimate parts (GiB) per row:", "",
              "| row | " + " | ".join(PARTS) + " |", "|---|" + "---:|" * len(PARTS)]
    for r in rows:
        lines.append(f"| {r['label']} | " + " | ".join(f"{r['estimate'].get(k, 0) / 2**30:.2f}" for k in PARTS) + " |")
    lines += ["", *(f"- {n}" for n in meta.get("notes", [])), ""]
    return "\n".join(lines)


def _steps(row: dict[str, Any]) -> str:
    return next((o.split("=")[1] for o in row["overrides"] if o.startswith("training.max_steps=")), "2")


PARTS = ("runtime", "weights", "gradients", "optimizer", "activations", "loss", "vocabulary gradient",
         "allocator cache", "optimizer step", "checkpoint save", "total")


def plot(meta: dict[str, Any], rows: list[dict[str, Any]], stem: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    sweep = [r for r in rows if r["group"] == "seq" and "peak_mb" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    for ac, marker in (("none", "o"), ("selective", "s"), ("full", "^")):
        pts = [(r["seq"], r["peak_mb"] / 1024, r["estimate"]["total"] / 2**30) for r in sweep if r["ac"] == ac]
        if pts:
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"AC {ac} (measured)")[0]
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker=marker, ls=":", color=line.get_color(),
                    label=f"AC {ac} (estimate)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_seq_len (tokens, micro-batch 1)")
    ax.set_ylabel("peak resident memory (GiB)")
    ax.set_title(f"{meta['title']}: LoRA, 1 process")
    ax.legend(fontsize=7)
    fig.tight_layout()
    if sweep:  # a run of the layout rows only (--only) draws no sweep
        written.append(stem.with_name(stem.name + "_memory_vs_seq.png"))
        fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    done = [r for r in rows if r["group"] in ("layout", "sft") and "peak_mb" in r]
    if done:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
        labels = [r["label"].replace("LoRA ", "").replace("full SFT ", "SFT ") for r in done]
        x = range(len(done))
        a1.bar([i - 0.2 for i in x], [r["peak_mb"] / 1024 for r in done], 0.4, label="measured")
        a1.bar([i + 0.2 for i in x], [r["estimate"]["total"] / 2**30 for r in done], 0.4, label="estimate")
        a1.set_ylabel("peak per rank (GiB)")
        a1.legend(fontsize=7)
        a2.bar(list(x), [r["tokens_per_s"] for r in done])
        a2.set_ylabel("input tokens/s (all ranks)")
        for a in (a1, a2):
            a.set_xticks(list(x))
            a.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        fig.suptitle(f"{meta['title']}: layouts at {done[0]['seq']} tokens")
        fig.tight_layout()
        written.append(stem.with_name(stem.name + "_layouts.png"))
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a 30M shape and shorter sequences (a few minutes)")
    ap.add_argument("--report", action="store_true", help="only redraw from the stored results, estimates recomputed")
    ap.add_argument("--only", action="append", metavar="LABEL",
                    help="a row label to run, repeatable (others are kept from the stored results, if any)")
    ap.add_argument("--note", action="append", default=[], help="a line about the conditions, shown under the table")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="bf16: bf16 weights, bf16-mixed training; fp32: fp32 weights and training; auto: bf16 "
                         "where the CPU has native bf16 matrix instructions, else fp32")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"optimizer steps per row (default {STEPS}; the longest sequence's rows at most {STEPS_LONG})")
    args = ap.parse_args()
    s = SETTINGS[args.quick]
    precision = pick_precision(args.precision)
    stem = RESULTS / (s["name"] + ("_fp32" if precision == "fp32" else ""))
    stored = json.loads(stem.with_suffix(".json").read_text()) if stem.with_suffix(".json").is_file() else None
    lora_dir = build_model(*s["lora"])
    sft_dir = build_model(*s["sft"])
    with tempfile.TemporaryDirectory(prefix="nxd-bench-scale-") as tmp:
        work = Path(tmp)
        recipes = {}
        for kind, model_dir in (("lora", lora_dir), ("sft", sft_dir)):
            recipes[kind] = work / f"{kind}.yaml"
            recipes[kind].write_text(RECIPE.format(model=model_dir, data=BENCH / "data" / "sft.jsonl",
                                                   out=work / "out", dtype="bf16" if precision == "bf16" else "fp32",
                                                   precision="bf16-mixed" if precision == "bf16" else "fp32"))
        if args.report:
            assert stored is not None, f"no stored results at {stem}.json"
            rows, meta = stored["rows"], stored["meta"]
            meta["notes"] = [*meta.get("notes", []), *args.note]
            for r in rows:
                r["estimate"] = estimate(recipes[r["model"]], r)
        else:
            only = set(args.only) if args.only else None
            labels = [row["label"] for row in rows_for(args.quick, args.steps)]
            unknown = sorted((only or set()) - set(labels))
            if unknown:
                raise SystemExit(f"--only: unknown row(s) {unknown}; rows: {labels}")
            old = {r["label"]: r for r in (stored["rows"] if stored else [])}
            rows = []
            for row in rows_for(args.quick, args.steps):
                if only is not None and row["label"] not in only:
                    if row["label"] in old:  # kept from the stored results; a row never run stays out
                        rows.append(old[row["label"]])
                    continue
                r = run_row(recipes[row["model"]], row, work)
                rows.append(r)
                got = f"peak {r['peak_mb'] / 1024:.2f} GiB, {r['tokens_per_s']:,.0f} tok/s" if "peak_mb" in r else \
                    r.get("skipped") or r.get("failed")
                print(f"{r['label']:32s} estimate {r['estimate']['total'] / 2**30:.2f} GiB  {got}  "
                      f"({r.get('wall_s', 0):.0f} s)", flush=True)
            meta = dict(title="Llama-3.2-1B shape" if not args.quick else "30M quick shape",
                        command="python bench/bench_scale.py" + (" --quick" if args.quick else "")
                        + (f" --precision {args.precision}" if args.precision != "auto" else "")
                        + (f" --steps {args.steps}" if args.steps else ""),
                        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB",
                        date=time.strftime("%Y-%m-%d %H:%M"),
                        shape_note=("LoRA rows: hidden 2048, 16 layers, 32/8 heads, ffn 8192, vocab 128256, tied "
                                    "(1.24B parameters); full SFT rows: the same widths with 4 layers."
                                    if not args.quick else "hidden 512, 4 layers, vocab 32000.")
                        + (" LoRA rows: bf16 weights, bf16-mixed." if precision == "bf16" else
                           " Every row: fp32 weights and training (`model.dtype: fp32`, `training.precision: fp32`)."),
                        precision=precision,
                        notes=[*(stored["meta"].get("notes", []) if stored and args.only else []), *args.note])
    RESULTS.mkdir(exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    stem.with_suffix(".md").write_text(render(meta, rows))
    pngs = plot(meta, rows, stem)
    print(render(meta, rows))
    print("wrote", stem.with_suffix(".md"), *pngs)


if __name__ == "__main__":
    main()

"""Markdown rendering of the benchmark results (bench/bench_lora.py writes the JSON next to it)."""

from __future__ import annotations

from typing import Any


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _label(r: dict[str, Any]) -> str:
    s = r["spec"]
    if s["framework"] == "hf":
        return "HF transformers+peft, padded" + ("" if s["flush_denormal"] else " (no flush_denormal)")
    return "nxd-finetune, packed" if s["packing"] else "nxd-finetune, padded (same batches as HF)"


def markdown(res: dict[str, Any]) -> str:
    m, peak = res["machine"], res["matmul_peak"]["flops_per_s"]
    out = [
        f"# LoRA SFT on CPU: nxd-finetune vs HF transformers + peft{' (quick)' if res['quick'] else ''}",
        "",
        f"{res['date']}; {m['cpu_model']}, {m['cores']} cores; torch {m['torch']}, transformers "
        f"{m['transformers']}, peft {m['peft']}; fp32; LoRA r=16 alpha=32 all-linear, AdamW, grad clip 1.0; "
        f"measured fp32 matmul peak {peak / 1e9:.1f} GFLOP/s ({res['matmul_peak']['n']}^3, "
        f"{res['matmul_peak']['threads']} threads).",
        "",
        "| shape | configuration | tok/s (non-pad) | vs HF | step (s) | tok/step | peak RSS (MB) | RSS vs HF "
        "| GFLOP/s | % peak | step-1 loss | load1 / other cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_shape: dict[str, list[dict[str, Any]]] = {}
    for r in res["runs"]:
        by_shape.setdefault(r["spec"]["shape"], []).append(r)
    for shape, rows in by_shape.items():
        hf = next(r for r in rows if r["spec"]["framework"] == "hf")
        c = rows[0]["shape_config"]
        dims = (f"{shape} ({c['hidden_size']}h {c['num_hidden_layers']}L {c['num_attention_heads']}/"
                f"{c['num_key_value_heads']} heads, ffn {c['intermediate_size']}, V {c['vocab_size']})")
        for r in rows:
            out.append(
                f"| {dims} | {_label(r)} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / hf['tokens_per_s']:.2f}x "
                f"| {r['step_s_mean']:.3f} | {r['tokens'] / r['steps']:.0f} | {r['peak_rss_mb']:.0f} "
                f"| {r['peak_rss_mb'] / hf['peak_rss_mb']:.2f}x | {r['flops_per_s'] / 1e9:.1f} | {100 * r['mfu']:.0f}% "
                f"| {r['first_loss']:.5f} | {r['load1_before']:.2f} / {r['other_cores']:.2f} |"
            )
            dims = ""
    cli = res.get("cli") or {}
    if cli:
        q = cli["quickstart"]
        out += ["", f"- `nxd-finetune --help`: {cli['help']['median_s']:.2f} s (median of 3)."]
        if "error" in q:
            out.append(f"- quickstart: failed: {q['error'][-300:]}")
        else:
            out.append(f"- quickstart time to first step: {q['time_to_first_step_s']:.2f} s from `run()` entry "
                       f"(model + data from cache, includes the pre-training eval); whole 1-step CLI run "
                       f"{q['one_step_run_wall_s']:.2f} s (imports, step, save).")
    out += [
        "",
        "How to read it:",
        "- Every configuration runs in its own process; warmup steps are excluded, then one pass over the "
        "same training samples is timed, so all rows process the same non-padding tokens. "
        "tok/s counts non-padding tokens; peak RSS is `ru_maxrss` of that process.",
        f"- Packed rows hold {res['max_seq_len']} tokens, {res['micro_batch']['packed_rows']} row per "
        f"micro-batch; padded micro-batches hold {res['micro_batch']['padded_samples']} samples padded to the "
        f"longest; {res['grad_accum']} micro-batches per optimizer step.",
        "- FLOPs per token (bench/common.py `train_flops`): frozen base 4N (forward 2N + input-gradient 2N; "
        "no weight gradient), adapters 6N_lora, causal attention 6 L q_dim per layer for a sample of L "
        "tokens (padding and cross-sample attention not counted). The same useful-FLOP count for every "
        "row, so GFLOP/s ratios equal tok/s ratios.",
        "- step-1 loss: the same samples and init give the same loss in the padded rows (a correctness check); "
        "packed rows hold other samples.",
        "- load1 = 1-minute load average before the configuration started (includes the previous one); "
        "other cores = CPU used by other processes during the run (machine busy time minus ours).",
    ]
    return "\n".join(out) + "\n"

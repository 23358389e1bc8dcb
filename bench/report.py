"""Markdown rendering of the benchmark results (bench/bench_lora.py writes the JSON next to it)."""

from __future__ import annotations

from typing import Any

TARGETS = {"packed": 1.5, "padded": 1.05, "rss": 0.8}  # issue 8, on CPU
TRL_TARGETS = {"tokens": 1.5, "rss": 0.7}  # issue 32: against TRL's SFTTrainer


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _key(r: dict[str, Any]) -> tuple[str, bool]:
    return r["spec"]["framework"], bool(r["spec"]["packing"])


def _label(r: dict[str, Any]) -> str:
    fw, packed = _key(r)
    if fw == "trl":
        return "TRL SFTTrainer+peft, packed (padding-free)"
    if fw == "hf":
        return "HF+peft, packed (flattened)" if packed else "HF+peft, padded"
    if fw == "ours-compile":
        return "nxd-finetune, packed, model.compile"
    return "nxd-finetune, packed" if packed else "nxd-finetune, padded (HF's batches)"


def _vs(r: dict[str, Any], base: dict[str, Any] | None, key: str) -> str:
    """``r[key]`` as a multiple of ``base[key]``; ``-`` without a base (results without that column)."""
    return f"{r[key] / base[key]:.2f}x" if base else "-"


def _targets(shape: dict[str, Any]) -> list[str]:
    rows = {_key(r): r for r in shape["rows"]}
    ours_p, ours_u, hf_u, hf_p = rows["ours", True], rows["ours", False], rows["hf", False], rows["hf", True]

    def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
        return a[key] / b[key]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    out = []
    for what, a, b, goal in (("packed vs HF padded", ours_p, hf_u, TARGETS["packed"]),
                             ("packed vs HF packed", ours_p, hf_p, TARGETS["packed"]),
                             ("padded vs HF padded", ours_u, hf_u, TARGETS["padded"])):
        c, w = ratio(a, b, "tokens_per_cpu_s"), ratio(a, b, "tokens_per_s")
        out.append(f"tok/s {what} >= {goal}x: {c:.2f}x CPU-time -- {verdict(c >= goal)} (wall {w:.2f}x)")
    for what, a, b in (("packed vs HF padded", ours_p, hf_u), ("packed vs HF packed", ours_p, hf_p),
                       ("padded vs HF padded", ours_u, hf_u)):
        m = ratio(a, b, "peak_rss_mb")
        out.append(f"peak RSS {what} <= {TARGETS['rss']}x: {m:.2f}x -- {verdict(m <= TARGETS['rss'])}")
    compiled = rows.get(("ours-compile", True))
    if compiled is not None:  # --compile
        c, w, m = (ratio(compiled, ours_p, k) for k in ("tokens_per_cpu_s", "tokens_per_s", "peak_rss_mb"))
        out.append(f"model.compile vs eager, packed: {c:.2f}x tok/s CPU-time (wall {w:.2f}x), {m:.2f}x peak RSS")
    trl = rows.get(("trl", True))
    if trl is not None:  # results from before the TRL column have none
        c, w, m = (ratio(ours_p, trl, k) for k in ("tokens_per_cpu_s", "tokens_per_s", "peak_rss_mb"))
        out.append(f"tok/s packed vs TRL SFTTrainer packed >= {TRL_TARGETS['tokens']}x (issue 32): {c:.2f}x "
                   f"CPU-time -- {verdict(c >= TRL_TARGETS['tokens'])} (wall {w:.2f}x)")
        out.append(f"peak RSS packed vs TRL SFTTrainer packed <= {TRL_TARGETS['rss']}x (issue 32): {m:.2f}x -- "
                   f"{verdict(m <= TRL_TARGETS['rss'])}")
    return out


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    peaks = ", ".join(f"{p['flops_per_cpu_s'] / 1e9:.0f} GFLOP/s per CPU-s ({p['flops_per_s'] / 1e9:.0f} wall) with "
                      f"{p['threads']} thread{'s' * (p['threads'] > 1)}" for p in res["matmul_peak"])
    threads = res["threads"] or "torch default"
    has_trl = any(_key(r) == ("trl", True) for shape in res["shapes"] for r in shape["rows"])
    trl = f", trl {m['trl']}" if "trl" in m else ""
    out = [
        f"# LoRA SFT on CPU: nxd-finetune vs HF transformers + peft{' and TRL SFTTrainer' * has_trl}"
        f"{' (quick)' if res['quick'] else ''}",
        "",
        f"{res['date']} ({res['duration_s'] // 60} min); {m['cpu_model']}, {m['cores']} cores; torch {m['torch']}, "
        f"transformers {m['transformers']}, peft {m['peft']}{trl}; fp32; LoRA r=16 alpha=32 all-linear, AdamW, "
        f"grad clip 1.0; {threads} torch thread(s) per run; median of {res['reps']} interleaved repeat(s); "
        f"measured fp32 matmul peak ({res['matmul_peak'][0]['n']}^3): {peaks}.",
        "",
        "| shape | configuration | tok/s per CPU-s | vs HF padded | vs HF packed | vs TRL | tok/s wall [min-max] "
        "| step (s) | tok/step | padding | peak RSS (MB) | RSS vs HF padded | RSS vs TRL | GFLOP/s per core "
        "| % peak | step-1 loss | other cores |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in res["shapes"]:
        rows = {_key(r): r for r in shape["rows"]}
        hf_u, hf_p, trl_p = rows["hf", False], rows["hf", True], rows.get(("trl", True))
        c = shape["shape_config"]
        dims = (f"{shape['shape']} ({c['hidden_size']}h {c['num_hidden_layers']}L, ffn {c['intermediate_size']}, "
                f"V {c['vocab_size']}; {shape['samples']} samples, {shape['tokens']} tokens)")
        for r in shape["rows"]:
            lo, hi = r["tokens_per_s_range"]
            out.append(
                f"| {dims} | {_label(r)} | {r['tokens_per_cpu_s']:.0f} "
                f"| {r['tokens_per_cpu_s'] / hf_u['tokens_per_cpu_s']:.2f}x "
                f"| {r['tokens_per_cpu_s'] / hf_p['tokens_per_cpu_s']:.2f}x | {_vs(r, trl_p, 'tokens_per_cpu_s')} "
                f"| {r['tokens_per_s']:.0f} [{lo:.0f}-{hi:.0f}] | {r['step_s_median']:.3f} "
                f"| {r['tokens'] / r['steps']:.0f} | {100 * (1 - r['tokens'] / r['slots']):.0f}% "
                f"| {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / hf_u['peak_rss_mb']:.2f}x "
                f"| {_vs(r, trl_p, 'peak_rss_mb')} "
                f"| {r['flops_per_cpu_s'] / 1e9:.1f} | {100 * r['mfu_cpu']:.0f}% "
                f"| {r['first_loss']:.5f} | {r['other_cores']:.2f} |"
            )
            dims = ""
    out += ["", f"Targets (issue 8{'; issue 32 for TRL' * has_trl}), from the medians above:"]
    for shape in res["shapes"]:
        out += [f"- {shape['shape']}: {t}" for t in _targets(shape)]
    cli = res.get("cli") or {}
    if cli:
        q = cli["quickstart"]
        when = f" (measured {cli['measured_at']}: {cli['note']})" if cli.get("measured_at") else ""
        out += ["", f"CLI{when}:",
                f"- `nxd-finetune --help`: {cli['help']['median_s']:.2f} s (median of 3; target < 0.5 s)."]
        if "error" in q:
            out.append(f"- quickstart: failed: {q['error'][-300:]}")
        else:
            out.append(f"- quickstart time to first training step: {q['time_to_first_step_s']:.2f} s from `run()` "
                       f"entry (model + tokenized data from cache, includes the pre-training eval); the whole "
                       f"1-step CLI run {q['one_step_run_wall_s']:.2f} s wall (imports, step, save).")
    out += [
        "",
        "How to read it (details in bench/README.md):",
        "- Every configuration runs in its own process; warmup steps are excluded, then one pass over the "
        "training samples is timed. tok/s counts non-padding tokens. *tok/s per CPU-s* divides by the "
        "process's CPU time (user + system), which other processes on the machine barely change at one "
        "thread; *wall* is elapsed time. Ratios and verdicts are of the CPU-time medians (wall ratios depend "
        "on what else ran at the time; see the other-cores column).",
        f"- Packed rows (ours) hold up to {res['max_seq_len']} tokens, {res['micro_batch']['packed_rows']} row per "
        f"micro-batch; padded and HF-flattened micro-batches hold {res['micro_batch']['padded_samples']} samples; "
        f"{res['grad_accum']} micro-batches per optimizer step. *padding*: share of the token slots computed "
        "that hold padding.",
        "- FLOPs per token (bench/common.py `train_flops`): frozen base 4N, adapters 6N_lora, causal attention "
        "within each sample; the same useful-FLOP count for every row. *GFLOP/s per core* = useful FLOPs per "
        "CPU-second; *% peak* = that against the measured matmul peak per thread. nxd-finetune skips part "
        "of the counted work (lm_head and the last layer's o_proj/MLP run at target positions only), so "
        "its % peak is model-FLOP utilisation, above the hardware's.",
        "- step-1 loss: the padded rows see the same samples and init, so they must agree (a correctness "
        "check); packed rows hold other samples in their first step.",
        "- TRL SFTTrainer (bench/trl_sft_worker.py): the same messages, `packing=True` (best-fit rows of "
        f"{res['max_seq_len']} tokens, padding-free, 1 row per micro-batch), `assistant_only_loss=True` (the "
        "tokenizer's template with `{% generation %}` around the assistant turns: the same trained tokens as "
        "ours), no activation checkpointing; it times as many steps as one epoch of its packed rows has, "
        "after the warm-up step. Its tokens are every token of the samples in those steps.",
        "- other cores: CPU used by other processes during the run (machine busy time minus ours), median.",
    ]
    return "\n".join(out) + "\n"

"""Markdown of the GPU benchmark's results (bench/bench_gpu.py writes the JSON beside it)."""

from __future__ import annotations

from typing import Any

GOALS = {"tokens": 1.3, "memory": 0.8, "mfu_8b": 0.45}  # issue 36, against the best HF configuration
LABELS = {
    "ours": "nxd-finetune, packed",
    "hf-padded": "HF+peft, padded",
    "hf-flat": "HF+peft, padding-free (flattened)",
    "liger": "HF+peft+Liger, padding-free",
    "ours-compile": "nxd-finetune, packed, model.compile",
}
GiB = 2**30


def peak_line(peak: dict[str, Any]) -> str:
    if "flops_per_s" not in peak:
        return f"failed: {str(peak.get('error', peak))[-300:]}"
    rate = peak["flops_per_s"]
    shown = f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"
    return (f"{shown} ({peak['dtype']} {peak['n']}^3, mean of {peak['reps']} "
            f"after {peak.get('warmup', 3)} warm-up)")


def _status(r: dict[str, Any]) -> str | None:
    """Why a configuration has no numbers (None when it has them)."""
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if "oom" in r:
        return f"out of device memory ({r['oom'][:160]})"
    if "error" in r:
        return "failed: " + " ".join(r["error"].strip().splitlines()[-1:])[:300]
    return None


def progress_line(row: dict[str, Any]) -> str:
    r = row["result"]
    why = _status(r)
    if why:
        return f"{row['config']}: {why}"
    mem = f", max reserved {r['max_reserved_gib']:.2f} GiB" if r.get("max_reserved_gib") is not None else ""
    mfu = f", MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
    return (f"{row['config']}: {r['tokens_per_s']:.0f} tok/s, step {r['step_s_median']:.3f} s{mem}{mfu}, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB, step-1 loss {r['losses'][0]:.4f}")


def _ok(r: dict[str, Any]) -> bool:
    return _status(r) is None and "tokens_per_s" in r


def best_hf(shape: dict[str, Any]) -> dict[str, Any] | None:
    """The HF configuration with the most tokens/s (None if none ran)."""
    rows = [row for row in shape["rows"] if not row["config"].startswith("ours") and _ok(row["result"])]
    return max(rows, key=lambda row: row["result"]["tokens_per_s"], default=None)


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _table(shape: dict[str, Any]) -> list[str]:
    best = best_hf(shape)
    b = best["result"] if best else None
    out = ["| configuration | micro-batch x per step | tok/s | vs best HF | step (s) | tok/step | padding "
           "| max allocated (GiB) | max reserved (GiB) | reserved vs best HF | MFU | MFU (6N) | step-1 loss "
           "| setup (s) | attention |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in shape["rows"]:
        r, label = row["result"], LABELS[row["config"]]
        why = _status(r)
        if why:
            out.append(f"| {label} | {row['spec']['micro_batch']} | {why} |" + " |" * 12)
            continue
        res = r.get("max_reserved_gib")
        vs_tok = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x" if b else "-"
        vs_mem = f"{res / b['max_reserved_gib']:.2f}x" if b and res and b.get("max_reserved_gib") else "-"
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        mfu_6n = "-" if r["mfu_6n"] is None else f"{100 * r['mfu_6n']:.1f}%"
        out.append(
            f"| {label} | {row['spec']['micro_batch']} x {row['spec']['grad_accum']} | {r['tokens_per_s']:.0f} "
            f"| {vs_tok} | {r['step_s_median']:.3f} | {r['tokens'] / r['steps']:.0f} "
            f"| {100 * (r['padding'] or 0):.0f}% | {_f(r.get('max_allocated_gib'), '.2f')} | {_f(res, '.2f')} "
            f"| {vs_mem} | {mfu} | {mfu_6n} | {r['losses'][0]:.4f} | {r['setup_s']:.1f} "
            f"| {r.get('attention', '-')} |")
    out += [f"- {LABELS[row['config']]}: {row['note']}" for row in shape["rows"] if row.get("note")]
    return out


def _memory_estimate(shape: dict[str, Any]) -> list[str]:
    ours = next((row["result"] for row in shape["rows"] if row["config"] == "ours"), None)
    if not ours or "validate" not in ours:
        return []
    est = ours["validate"]["memory_per_rank_bytes"]
    total, runtime = est["total"] / GiB, est.get("runtime", 0) / GiB
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in est.items() if k != "total" and v)
    line = f"- `validate`'s estimate for nxd-finetune: {total:.2f} GiB ({parts} GiB)"
    res = ours.get("max_reserved_gib")
    if res:
        line += (f"; measured `max_memory_reserved` {res:.2f} GiB, `max_memory_allocated` "
                 f"{ours['max_allocated_gib']:.2f} GiB: estimate / reserved = {total / res:.3f} "
                 f"({(total - runtime) / res:.3f} without the host-side `runtime` part)")
    else:
        line += f"; no device memory measured here (peak RSS {ours['peak_rss_mb'] / 1024:.2f} GiB)"
    return [line + "."]


def _goals(shape: dict[str, Any], gpu: bool) -> list[str]:
    best = best_hf(shape)
    ours = next((row["result"] for row in shape["rows"] if row["config"] == "ours"), None)
    if best is None or ours is None or not _ok(ours):
        return ["- goals: not evaluated (a configuration did not run)"]
    b = best["result"]
    verdict = (lambda ok: "met" if ok else "NOT met") if gpu else (lambda ok: "no verdict: not a GPU run")
    speed = ours["tokens_per_s"] / b["tokens_per_s"]
    out = [f"- tokens/s vs the best HF configuration ({LABELS[best['config']]}) >= {GOALS['tokens']}x: "
           f"{speed:.2f}x -- {verdict(speed >= GOALS['tokens'])}"]
    if ours.get("max_reserved_gib") and b.get("max_reserved_gib"):
        mem = ours["max_reserved_gib"] / b["max_reserved_gib"]
        out.append(f"- peak reserved memory vs it <= {GOALS['memory']}x: {mem:.2f}x -- "
                   f"{verdict(mem <= GOALS['memory'])}")
    if shape["shape"] == "8b" and ours.get("mfu") is not None:
        out.append(f"- MFU on the 8B shape >= {100 * GOALS['mfu_8b']:.0f}%: {100 * ours['mfu']:.1f}% -- "
                   f"{verdict(ours['mfu'] >= GOALS['mfu_8b'])}")
    return out + _compile_line(shape, ours)


def compile_seconds(r: dict[str, Any]) -> float:
    """The compile time a run's warm-up held: its warm-up seconds less as many steps at the timed
    median (the compiled steps' own time)."""
    return float(r["warmup_s"] - r["warmup_steps"] * r["step_s_median"])


def _compile_line(shape: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    row = next((row for row in shape["rows"] if row["config"] == "ours-compile"), None)
    if row is None or not _ok(row["result"]):
        return []
    r = row["result"]
    return [f"- `model.compile`: {r['tokens_per_s'] / ours['tokens_per_s']:.2f}x nxd-finetune's eager tokens/s, "
            f"{_f(r.get('max_reserved_gib'), '.2f')} GiB reserved; compiling took about {compile_seconds(r):.0f} s "
            f"of the {r['warmup_s']:.0f} s warm-up ({r['warmup_steps']} steps)"]


def markdown(res: dict[str, Any]) -> str:
    env, s = res.get("env", {}), res["settings"]
    if res["gpu_result"]:
        title = f"# LoRA SFT on {env.get('gpu', 'a GPU')}: nxd-finetune vs HF transformers + peft (+ Liger)"
        where = (f"{env.get('gpu')}, {env.get('gpu_memory_gib', 0):.1f} GiB; nvidia-smi (driver, name, memory, power "
                 f"limit, max SM clock): {env.get('nvidia_smi')}; CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}")
    else:
        title = (f"# GPU bench pipeline, {'tiny shapes ' if res['tiny'] else ''}on {res['device']}: a smoke check, "
                 "NOT a GPU result")
        where = f"device {res['device']}{' (tiny shapes)' if res['tiny'] else ''}"
    lora = s["lora"]
    out = [
        title, "",
        f"{res['date']} ({res.get('duration_s', 0):.0f} s); {where}; torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}, peft {env.get('peft')}, "
        f"liger-kernel {env.get('liger-kernel') or 'not installed'}.",
        f"LoRA r={lora['rank']} alpha={lora['alpha']} on every linear, {s['precision']}, {s['grad_accum']} "
        f"micro-batches per optimizer step (unless noted), {s['warmup_steps']} warm-up + {s['timed_steps']} timed "
        f"steps per configuration, packed rows of {s['seq_len']} tokens, data {s['data']}.",
        f"Measured matmul peak: {peak_line(res['matmul_peak'])}.", "",
    ]
    if res.get("interrupted"):
        out += [f"**Incomplete: {res['interrupted']}.**", ""]
    for shape in res["shapes"]:
        c = shape["config"]
        out += [f"## {shape['shape']}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
                f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, ffn {c['intermediate_size']}, vocab "
                f"{c['vocab_size']}{', tied' if c.get('tie_word_embeddings') else ''}; "
                f"{shape['params']['base']:,} matmul parameters (N_base), "
                f"{shape['params']['lora']:,} LoRA (N_lora)", ""]
        why = _status(shape.get("checkpoint", {}))
        if why:
            out += [f"checkpoint: {why}", ""]
            continue
        out += _table(shape) + [""] + _memory_estimate(shape) + _goals(shape, res["gpu_result"]) + [""]
    out += [
        "How to read it (bench/README.md, GPU mode):",
        "- tok/s: non-padding tokens of the timed steps' samples (prompt and response, the same count for every "
        "configuration) / the wall time of those steps, the device synchronised at each step's end.",
        "- MFU: useful training FLOPs per second / the measured matmul peak. Useful FLOPs (bench/common.py "
        "`train_flops`): per token 4 N_base (frozen weights: forward 2N + input gradient 2N, no weight gradient) + "
        "6 N_lora, plus causal attention within each sample, 6 L^2 q_dim per layer and sample of L tokens; N_base "
        "= the decoder linears + lm_head (the embedding is a gather). MFU (6N): 6 (N_base + N_lora) per token, the "
        "full-fine-tuning convention, shown for comparison only (it counts weight gradients LoRA never computes).",
        "- Memory: the process's `torch.cuda.max_memory_allocated` / `max_memory_reserved` over the whole run "
        "(load + training).",
        "- step-1 loss: the HF rows see the same samples from the same weights, so they must agree; ours packs "
        "other samples into its rows.",
    ]
    out += [f"- Not done: {item}." for item in res.get("not_done", [])]
    return "\n".join(out) + "\n"

"""LoRA on a mixture-of-experts model on CPU: nxd-finetune (LoRA on the experts through
``lora.target_parameters``, grouped GEMMs) against transformers + peft ``target_parameters`` on the
same model and data, tokens/s and peak memory in one run; and our grouped GEMM against the
per-expert loop (transformers' reference) on the experts alone.

    python bench/bench_moe.py                     # 16 experts, top 2, hidden 512, 4 layers, 4 x 256 tokens
    python bench/bench_moe.py --quick             # 2 layers, 4 x 128 tokens (a few minutes on 2 cores)
    python bench/bench_moe.py --shape qwen3-30b-a3b   # 128 experts, top 8, width 192, 16 q / 2 kv heads
    python bench/bench_moe.py --layers 8 --seq 512 --steps 8 --note "quiet machine"

The model: a random-init (seed 0) ``Qwen3MoeForCausalLM``, hidden 512, 8 query / 4 kv heads of
head_dim 64, every layer 16 experts of width 256, top 2 renormalised, the quickstart tokenizer's
vocabulary, fp32; written once under ``bench/.cache/models/`` (git-ignored). ``--shape qwen3-30b-a3b``:
Qwen3-30B-A3B's routing and proportions at hidden 512 (:data:`QWEN3_30B_A3B`: 16 query / 2 kv heads
of head_dim 64, 128 experts of width 192, top 8 renormalised; ~64 tokens per expert per step),
cached as ``moe-qwen3-30b-a3b-<layers>l``. Every training row runs in its own process
(``system.run_worker``) on the same random rows (all tokens targets), LoRA r16 alpha 32 on
q/k/v/o and on both fused expert tensors (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``),
router frozen, AdamW lr 1e-4, fp32:

- ``nxd grouped``: the engine ``nxd-finetune run`` trains with (``sft.engine.build_engine``: the
  recipe, ``forward_backward``, ``step``); experts as two grouped GEMMs, the LoRA as two more
  rank-wide ones per tensor (no ``[E, out, in]`` delta formed);
- ``nxd loop``: the same with the per-expert loop (``set_expert_kernel(model, "loop")``);
- ``HF+peft grouped_mm``: ``AutoModelForCausalLM`` (transformers' default experts implementation,
  ``grouped_mm`` where torch has it) + ``peft.get_peft_model(target_parameters=...)``, a plain loop;
- ``HF+peft eager``: the same with ``experts_implementation="eager"`` (transformers' per-expert loop).

Measured in each worker: ``step`` = the median wall time of the steps after the first; tokens/s from
it; ``cpu`` = the process's CPU seconds over the timed steps (tokens per CPU-second does not count time
spent waiting for a core, the number to compare on a loaded machine); ``load`` = peak resident
memory (``VmHWM``) after building the model; then ``VmHWM`` is reset (``/proc/self/clear_refs``) and
``train peak`` is the peak over the steps (the whole process: interpreter, libraries, model, adapter,
optimizer, activations). Step-1 losses must agree (the same init and rows; LoRA B starts at zero).
The experts alone: one MoE layer's experts with LoRA on both tensors, forward + backward over the
routed tokens of one step, grouped against loop, median of ``--reps``.
Results: ``bench/results/moe_cpu[_a3b][_quick].{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench import report, runs, system  # noqa: E402
from bench.runs import CACHE, MiB  # noqa: E402

DATA = BENCH / "data" / "sft.jsonl"
SHAPE: dict[str, Any] = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                         "intermediate_size": 1024, "num_experts": 16, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 256, "norm_topk_prob": True, "max_position_embeddings": 2048,
                         "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
# Qwen3-30B-A3B's routing (128 experts, top 8 renormalised) and expert width / hidden (768 / 2048) at
# hidden 512: expert width 192, 16 q / 2 kv heads (its 8:1 ratio) of 64, so the query width is 2x the
# hidden as in the real model (32 x 128 at 2048): per token the experts are ~2x the attention
# projections, as there. 4 x 256 tokens give each expert ~64 rows per step.
QWEN3_30B_A3B: dict[str, Any] = {**SHAPE, "num_attention_heads": 16, "num_key_value_heads": 2, "num_experts": 128,
                                 "num_experts_per_tok": 8, "moe_intermediate_size": 192}
SHAPES: dict[str, dict[str, Any]] = {"small": SHAPE, "qwen3-30b-a3b": QWEN3_30B_A3B}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ROWS = (("nxd", "grouped"), ("nxd", "loop"), ("hf", "grouped_mm"), ("hf", "eager"))
LABELS = {("nxd", "grouped"): "nxd grouped", ("nxd", "loop"): "nxd loop (reference)",
          ("hf", "grouped_mm"): "HF+peft grouped_mm", ("hf", "eager"): "HF+peft eager"}


def ensure_model(layers: int, shape: str = "small") -> Path:
    """``bench/.cache/models/moe-<layers>l`` (``moe-<shape>-<layers>l`` for a shape other than
    ``small``): the quickstart tokenizer and a random-init (seed 0) ``Qwen3MoeForCausalLM`` of
    :data:`SHAPES` ``[shape]`` with ``layers`` layers, fp32."""
    name = f"moe-{layers}l" if shape == "small" else f"moe-{shape}-{layers}l"
    return runs.ensure_model(name, "Qwen3MoeConfig", SHAPES[shape], layers)


def recipe_dict(model: Path, seq: int, steps: int) -> dict[str, Any]:
    return {
        "model": {"path": str(model), "dtype": "fp32"},
        "data": {"train": str(DATA), "format": "messages", "max_seq_len": seq},
        "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": list(ATTENTION),
                 "target_parameters": list(EXPERTS)},
        "training": {"micro_batch_size": 1, "grad_accum": 1, "max_steps": steps, "lr": 1e-4, "warmup_steps": 0,
                     "precision": "fp32", "device": "cpu", "seed": 0, "grad_clip": None},
        "eval": {"before": False}, "logging": {"progress": False},
        "output": {"dir": str(CACHE / "outputs" / "moe")},
    }


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One training row, in this process: build, train ``steps`` steps on the same rows, measure."""
    import torch

    torch.manual_seed(0)
    model_dir, batch, seq, steps = Path(spec["model"]), spec["batch"], spec["seq"], spec["steps"]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    if spec["framework"] == "nxd":
        from nxd_finetune.models.moe import set_expert_kernel
        from nxd_finetune.objective import CrossEntropy
        from nxd_finetune.recipe import recipe_from_dict
        from nxd_finetune.sft.engine import build_engine

        recipe = recipe_from_dict(recipe_dict(model_dir, seq, steps))
        engine = build_engine(recipe, model_dir, torch.device("cpu"), total_steps=steps)
        model = engine.modules[0]
        set_expert_kernel(model, spec["kernel"])
        micro, n_targets, objective = {"input_ids": ids, "labels": ids}, torch.tensor(batch * (seq - 1)), CrossEntropy()

        def step() -> float:
            loss, _ = engine.forward_backward([micro], n_targets, objective)
            engine.step()
            return float(loss)
    else:
        import peft
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                  experts_implementation=spec["kernel"])
        spec["kernel_used"] = hf.config._experts_implementation
        model = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, target_modules=list(ATTENTION),
                                                        target_parameters=list(EXPERTS), lora_dropout=0.0)).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step() -> float:  # a plain loop, as a transformers + peft user writes it
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            return float(loss)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    build_s, load_peak, loaded = time.perf_counter() - t0, runs.vm("VmHWM"), runs.vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    times, losses = [], []
    cpu0 = 0.0
    for i in range(steps):
        if i == 1:
            cpu0 = time.process_time()
        t = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t)
    cpu_s = (time.process_time() - cpu0) / max(1, steps - 1)
    step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
    # tokens / time_s / cpu_s: per step, as system.run_worker turns them into tokens_per_s / _per_cpu_s
    return {"trainable": trainable, "load_peak_bytes": load_peak, "loaded_rss_bytes": loaded,
            "train_peak_bytes": runs.vm("VmHWM"), "build_s": build_s, "step_s": step_s, "step_times": times,
            "tokens": batch * seq, "time_s": step_s, "cpu_s": cpu_s, "losses": losses,
            "kernel_used": spec.get("kernel_used", spec["kernel"])}


def experts_alone(tokens: int, reps: int, shape: dict[str, Any] = SHAPE) -> dict[str, Any]:
    """One layer's experts (``shape``) with LoRA r16 on both tensors, forward + backward over
    ``tokens`` tokens routed top-k by a random router: grouped GEMMs against the per-expert loop."""
    import torch

    from nxd_finetune.lora import LoraConfig, inject_lora
    from nxd_finetune.models import DecoderConfig, build_model
    from nxd_finetune.models.moe import moe_blocks, set_expert_kernel

    config = DecoderConfig.from_hf({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                    "num_hidden_layers": 1, "vocab_size": 64, **shape})
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    inject_lora(model, LoraConfig(r=16, lora_alpha=32, target_modules=[], target_parameters=list(EXPERTS)))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    block = moe_blocks(model)[0]
    x = torch.randn(tokens, shape["hidden_size"], requires_grad=True)
    _, weights, index = block.gate(x.detach())
    out: dict[str, Any] = {"tokens": tokens}
    results = {}
    for kernel in ("grouped", "loop"):
        set_expert_kernel(model, kernel)
        times = []
        for _ in range(reps + 1):
            for p in [*block.experts.parameters(), x]:
                p.grad = None
            t = time.perf_counter()
            y = block.experts(x, index, weights)
            y.square().sum().backward()
            times.append(time.perf_counter() - t)
        grads = [p.grad.clone() for p in [*block.experts.parameters(), x] if p.requires_grad]
        results[kernel] = (y.detach(), grads)
        out[f"{kernel}_ms"] = statistics.median(times[1:]) * 1000
    (yg, gg), (yl, gl) = results["grouped"], results["loop"]
    diffs = [float((a - b).abs().max()) for a, b in zip([yg, *gg], [yl, *gl], strict=True)]
    out["max_abs_diff"] = max(diffs)
    out["speedup"] = out["loop_ms"] / out["grouped_ms"]
    return out


def render(res: dict[str, Any]) -> str:
    rows = {(r["framework"], r["kernel"]): r for r in res["rows"]}
    lines = [f"# LoRA on a mixture-of-experts model, CPU ({res['shape']})", "",
             f"{res['cpu']}, {res['threads']} torch threads, {res['batch']} x {res['seq']} tokens per step, "
             f"{res['steps']} steps per row (the first not timed). {res['note']}", "",
             "| row | experts kernel | tokens/s | tokens / CPU-s | step | load peak | train peak | step-1 loss "
             "| other cores |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in ROWS:
        r = rows.get(key)
        if r is not None:
            lines.append(f"| {LABELS[key]} | {r['kernel_used']} | {r['tokens_per_s']:.0f} | {r['tokens_per_cpu_s']:.0f}"
                         f" | {r['step_s']:.2f} s | {r['load_peak_bytes'] / MiB:.0f} MiB | "
                         f"{r['train_peak_bytes'] / MiB:.0f} MiB | {r['losses'][0]:.4f} | {r['other_cores']:.2f} |")
    ours, hf = rows.get(("nxd", "grouped")), rows.get(("hf", "grouped_mm"))
    if ours and hf:
        lines += ["", f"- tokens/s nxd / HF+peft (grouped_mm): {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x wall, "
                      f"{ours['tokens_per_cpu_s'] / hf['tokens_per_cpu_s']:.2f}x per CPU-second (goal >= 1.5x)",
                  f"- train peak nxd / HF+peft (grouped_mm): {ours['train_peak_bytes'] / hf['train_peak_bytes']:.2f}x "
                  "(goal <= 0.8x)"]
    e = res.get("experts_alone")
    if e:
        lines += [f"- experts alone ({e['tokens']} tokens, LoRA on both tensors, forward + backward): grouped "
                  f"{e['grouped_ms']:.1f} ms, loop {e['loop_ms']:.1f} ms, {e['speedup']:.2f}x; outputs and "
                  f"gradients within {e['max_abs_diff']:.1e}"]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path, plt: ModuleType) -> Path:
    rows = [r for key in ROWS for r in res["rows"] if (r["framework"], r["kernel"]) == key]
    labels = [LABELS[(r["framework"], r["kernel"])] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    x = list(range(len(rows)))
    a1.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rows], 0.4, label="tokens/s (wall)")
    a1.bar([i + 0.2 for i in x], [r["tokens_per_cpu_s"] for r in rows], 0.4, label="tokens / CPU-s")
    a1.set_ylabel("training tokens per second")
    a1.legend(fontsize=7)
    a2.bar(x, [r["train_peak_bytes"] / MiB for r in rows])
    a2.set_ylabel("peak resident memory while training (MiB)")
    title = f"MoE LoRA, CPU ({res['shape']}, {res['batch']} x {res['seq']} tokens per step)"
    return runs.save_figure(plt, fig, (a1, a2), labels, title, path, rotation=25, ha="right")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small",
                    help="small: 16 experts top 2, width 256 (default); qwen3-30b-a3b: 128 experts top 8, "
                         "width 192, 16 q / 2 kv heads (Qwen3-30B-A3B's proportions at hidden 512)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 x 128 tokens")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --quick 2)")
    ap.add_argument("--batch", type=int, default=4, help="rows per step")
    ap.add_argument("--seq", type=int, default=None, help="tokens per row (default 256; --quick 128)")
    ap.add_argument("--steps", type=int, default=6, help="steps per row, the first not timed")
    ap.add_argument("--reps", type=int, default=5, help="repeats of the experts-alone timing")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per run (1: on a shared machine, 2 threads stall each other)")
    runs.add_result_args(ap, "moe_cpu[_a3b][_quick]")
    args = ap.parse_args()
    layers = args.layers or (2 if args.quick else 4)
    seq = args.seq or (128 if args.quick else 256)
    model, dims = ensure_model(layers, args.shape), SHAPES[args.shape]
    shape = (f"{dims['num_experts']} experts, top {dims['num_experts_per_tok']}, hidden {dims['hidden_size']}, "
             f"expert width {dims['moe_intermediate_size']}, {layers} layers")
    if args.shape != "small":
        shape = (f"{args.shape} shape: {shape}, {dims['num_attention_heads']} q / {dims['num_key_value_heads']} kv "
                 f"heads of {dims['head_dim']}")
    res: dict[str, Any] = {"shape": shape, "shape_name": args.shape,
                           "model_config": {**dims, "num_hidden_layers": layers}, "cpu": report.cpu_model(),
                           "machine": platform.machine(),
                           "threads": args.threads, "batch": args.batch, "seq": seq, "steps": args.steps,
                           "note": args.note, "rows": []}
    for framework, kernel in ROWS:
        spec = {"framework": framework, "kernel": kernel, "model": str(model), "batch": args.batch, "seq": seq,
                "steps": args.steps, "threads": args.threads}
        row = {**spec, **system.run_worker(Path(__file__), spec)}  # this file, a spec as its argument: worker()
        res["rows"].append(row)
        print(f"{LABELS[(framework, kernel)]}: {row['tokens_per_s']:.0f} tokens/s, {row['tokens_per_cpu_s']:.0f} "
              f"per CPU-s, train peak {row['train_peak_bytes'] / MiB:.0f} MiB, losses {row['losses'][:2]}", flush=True)
    import torch

    torch.set_num_threads(args.threads)
    res["experts_alone"] = experts_alone(args.batch * seq, args.reps, dims)
    default = "moe_cpu" + ("" if args.shape == "small" else "_a3b") + ("_quick" if args.quick else "")
    runs.write_results(res, args.out or default, render, plot)


if __name__ == "__main__" and not runs.run_as_worker(worker):  # a worker (system.run_worker) runs one row
    main()

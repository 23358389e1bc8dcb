"""QLoRA on the Llama-3.2-1B shape: the frozen base's memory in bf16 against NF4, peak training
memory and step time, nxd-finetune beside transformers + peft (+ bitsandbytes for QLoRA).

    python bench/bench_qlora.py                   # 1B shape, 256 tokens, 4 steps per row (~15 min, 2 cores)
    python bench/bench_qlora.py --quick           # the 30M quick shape of bench_scale.py (a minute)
    python bench/bench_qlora.py --seq 512 --steps 6

Rows, each in its own process (``--worker``), LoRA r16 all-linear, fp32 adapters, bf16 autocast,
one random row of ``--seq`` tokens per step (all of them targets), the same row for every framework:

- ``nxd bf16 LoRA``: ``model.dtype: bf16``, ``training.precision: bf16-mixed``;
- ``nxd NF4 QLoRA``: the same with ``model.quantization: {method: nf4, double_quant: true,
  compute_dtype: bfloat16}`` (which recomputes activations by default: ``parallel.activation_checkpointing``
  resolves to ``full``);
- ``nxd NF4 QLoRA, 4-bit embedding``: the same with ``model.quantization.embeddings: true``;
- ``HF+peft bf16 LoRA``: ``LlamaForCausalLM`` in bf16 + ``get_peft_model``, a plain loop with AdamW;
- ``HF+peft+bnb QLoRA``: ``BitsAndBytesConfig`` with the same settings, ``prepare_model_for_kbit_training``
  with its defaults, as QLoRA users run it: it casts the parameters left unquantized, embeddings and
  norms, to fp32, and turns gradient checkpointing on.

Measured in each worker: ``base`` = the bytes of the frozen tensors as held (bitsandbytes' packed
weights and block scales included); ``load peak`` = peak resident memory (``VmHWM``) after building
the model; then ``VmHWM`` is reset (``/proc/self/clear_refs``) and ``train peak`` is the peak over
the steps; ``step`` = the median wall time of the steps after the first; tokens/s from it, and
tokens per CPU-second from the worker's CPU time over the same steps (``other cores``: what other
processes kept busy meanwhile). The allocator's environment (``MALLOC_*``, ``LD_PRELOAD``) is the
same for every row and recorded in the results. For the
nxd rows, ``validate``'s estimate of the same run (its ``weights`` part and total) goes beside them.
The 1B checkpoint is bench_scale.py's (random init, bf16, tied embeddings, vocab 128256, built once
under ``bench/.cache/models/``). Results: ``bench/results/qlora[_quick].{json,md}``.
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

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench import report, system  # noqa: E402
from bench.bench_scale import SHAPE_1B, SHAPE_QUICK, build_model  # noqa: E402

RESULTS = BENCH / "results"
DATA = BENCH / "data" / "sft.jsonl"
GiB = 2**30
ROWS = (("nxd", "bf16"), ("nxd", "nf4"), ("nxd", "nf4-emb"), ("hf", "bf16"), ("hf", "nf4"))
LABELS = {("nxd", "bf16"): "nxd bf16 LoRA", ("nxd", "nf4"): "nxd NF4 QLoRA",
          ("nxd", "nf4-emb"): "nxd NF4 QLoRA, 4-bit embedding", ("hf", "bf16"): "HF+peft bf16 LoRA",
          ("hf", "nf4"): "HF+peft+bnb QLoRA"}
QUANT = {"method": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}
QUANTS: dict[str, dict[str, Any] | None] = {"bf16": None, "nf4": QUANT, "nf4-emb": {**QUANT, "embeddings": True}}
"""``model.quantization`` of each nxd row (``nf4-emb``: the tied embedding in 4 bits too)."""


def recipe_dict(model: Path, base: str, seq: int, steps: int) -> dict[str, Any]:
    quant = QUANTS[base]
    return {
        "model": {"path": str(model), "dtype": "bf16", **({"quantization": dict(quant)} if quant else {})},
        "data": {"train": str(DATA), "format": "messages", "max_seq_len": seq},
        "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "training": {"micro_batch_size": 1, "grad_accum": 1, "max_steps": steps, "lr": 1e-4, "warmup_steps": 0,
                     "precision": "bf16-mixed", "device": "cpu", "seed": 0},
        "eval": {"before": False}, "logging": {"progress": False},
        "output": {"dir": str(BENCH / ".cache" / "outputs" / "qlora")},
    }


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _frozen_bytes(model: Any) -> int:
    """Bytes of the frozen tensors as held: data, and bitsandbytes' block scales (nested too) / row scales."""
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        if p.requires_grad:
            continue
        total += p.data.nbytes
        state = getattr(p, "quant_state", None)
        if state is not None:
            total += state.absmax.nbytes + (state.state2.absmax.nbytes if state.state2 is not None else 0)
        scb = getattr(p, "SCB", None)
        total += scb.nbytes if scb is not None else 0
    return total


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One row, in this process: build, train ``steps`` steps on one random row, measure."""
    import torch

    torch.manual_seed(0)
    model_dir, seq, steps = Path(spec["model"]), spec["seq"], spec["steps"]
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    if spec["framework"] == "nxd":
        from nxd_finetune.objective import CrossEntropy
        from nxd_finetune.recipe import recipe_from_dict
        from nxd_finetune.sft.engine import build_engine

        recipe = recipe_from_dict(recipe_dict(model_dir, spec["base"], seq, steps))
        engine = build_engine(recipe, model_dir, torch.device("cpu"), total_steps=steps)
        model = engine.modules[0]
        batch, n_targets, objective = {"input_ids": ids, "labels": ids}, torch.tensor(seq - 1), CrossEntropy()
        recompute = recipe.parallel.activation_checkpointing != "none"

        def step() -> float:
            loss, _ = engine.forward_backward([batch], n_targets, objective)
            engine.step()
            return float(loss)
    else:
        import peft
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        quant = None
        if spec["base"] == "nf4":
            quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                       bnb_4bit_compute_dtype=torch.bfloat16)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, quantization_config=quant,
                                                  device_map="cpu", attn_implementation="sdpa")
        if quant is not None:  # its defaults: gradient checkpointing on
            hf = peft.prepare_model_for_kbit_training(hf)
        model = peft.get_peft_model(hf, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                        task_type="CAUSAL_LM")).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        recompute = bool(hf.is_gradient_checkpointing)

        def step() -> float:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss)
    build_s = time.perf_counter() - t0
    base, load_peak = _frozen_bytes(model), _vm("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    times, cpu_times, losses = [], [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        losses.append(step())
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - c)
    step_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
    cpu_s = statistics.median(cpu_times[1:]) if len(cpu_times) > 1 else cpu_times[0]
    return {"base_bytes": base, "load_peak_bytes": load_peak, "train_peak_bytes": _vm("VmHWM"), "build_s": build_s,
            "step_s": step_s, "step_times": times, "tokens_per_s": seq / step_s, "cpu_s": cpu_s,
            "cpu_times": cpu_times, "tokens_per_cpu_s": seq / cpu_s, "recompute": recompute, "losses": losses}


def _estimate(model: Path, base: str, seq: int, steps: int) -> dict[str, float]:
    from nxd_finetune.preflight.report import run_checks
    from nxd_finetune.recipe import recipe_from_dict

    memory = run_checks(recipe_from_dict(recipe_dict(model, base, seq, steps))).memory
    return {"weights": memory["weights"], "total": sum(memory.values())}


def allocator_env() -> dict[str, str]:
    """The allocator's settings in this environment, which every row's worker inherits as they are."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") or k == "LD_PRELOAD"}


def _allocator_text(env: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in env.items()) or "glibc malloc, no MALLOC_* / LD_PRELOAD set"


def render(results: dict[str, Any]) -> str:
    rows = {(r["framework"], r["base"]): r for r in results["rows"]}
    lines = [f"# QLoRA memory and step time ({results['shape']})", "",
             f"{results['cpu']}, {results['threads']} torch threads, {results['seq']} tokens per step, "
             f"{results['steps']} steps per row (the first not timed); allocator environment, every row: "
             f"{_allocator_text(results.get('allocator', {}))}; {results['note']}", "",
             "| row | recompute | base | load peak | train peak | validate: weights / total | step | tokens/s | "
             "tokens per CPU-s | other cores |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in ROWS:
        r = rows.get(key)
        if r is None:
            continue
        est = r.get("estimate")
        est_s = f"{est['weights'] / GiB:.2f} / {est['total'] / GiB:.2f} GiB" if est else "-"
        cpu_s = f"{r['tokens_per_cpu_s']:.1f}" if "tokens_per_cpu_s" in r else "-"
        recompute = {True: "full", False: "none"}.get(r.get("recompute"), "-")
        lines.append(f"| {LABELS[key]} | {recompute} | {r['base_bytes'] / GiB:.2f} GiB | "
                     f"{r['load_peak_bytes'] / GiB:.2f} GiB | {r['train_peak_bytes'] / GiB:.2f} GiB | {est_s} | "
                     f"{r['step_s']:.2f} s | {r['tokens_per_s']:.1f} | {cpu_s} | {r.get('other_cores', '-')} |")
    ours_b, hf_q = rows.get(("nxd", "bf16")), rows.get(("hf", "nf4"))
    if ours_b:
        lines.append("")
    for key in (("nxd", "nf4"), ("nxd", "nf4-emb")):
        q = rows.get(key)
        if ours_b and q:
            lines += [f"- base memory {LABELS[key]} / bf16: {q['base_bytes'] / ours_b['base_bytes']:.2f}x "
                      "(goal <= 0.3x)",
                      f"- peak training memory {LABELS[key]} / bf16 LoRA: "
                      f"{q['train_peak_bytes'] / ours_b['train_peak_bytes']:.2f}x (goal <= 0.5x)"]
    for key in (("nxd", "nf4"), ("nxd", "nf4-emb")):
        q = rows.get(key)
        if q and hf_q:
            per_cpu = (f", per CPU-second {q['tokens_per_cpu_s'] / hf_q['tokens_per_cpu_s']:.2f}x"
                       if "tokens_per_cpu_s" in q and "tokens_per_cpu_s" in hf_q else "")
            lines.append(f"- tokens/s {LABELS[key]} / HF+peft+bnb QLoRA: "
                         f"{q['tokens_per_s'] / hf_q['tokens_per_s']:.2f}x{per_cpu} (goal >= 1x)")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--note", default="")
    ap.add_argument("--rows", default=",".join(f"{f}:{b}" for f, b in ROWS),
                    help="the rows to run, framework:base, comma-separated (default: all)")
    ap.add_argument("--out", default=None, help="results file stem under bench/results (default: qlora[_quick])")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        import torch

        torch.set_num_threads(spec["threads"])
        print("RESULT " + json.dumps(worker(spec)), flush=True)
        return
    name, shape = ("scale-quick", SHAPE_QUICK) if args.quick else ("llama-3.2-1b-shape", SHAPE_1B)
    model = build_model(name, shape)
    results: dict[str, Any] = {"shape": name, "cpu": report.cpu_model(), "machine": platform.machine(),
                               "threads": args.threads, "seq": args.seq, "steps": args.steps, "note": args.note,
                               "allocator": allocator_env(), "rows": []}
    chosen = [tuple(r.split(":", 1)) for r in args.rows.split(",")]
    for framework, base in (key for key in ROWS if key in chosen):
        spec = {"framework": framework, "base": base, "model": str(model), "seq": args.seq, "steps": args.steps,
                "threads": args.threads}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
        proc, usage = system.run_measured([sys.executable, __file__, "--worker", json.dumps(spec)], env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"worker failed: {spec}\n{proc.stderr[-4000:]}")
        row = {**spec, **json.loads(line[len("RESULT "):]), "other_cores": round(usage["other_cores"], 2)}
        if framework == "nxd":
            row["estimate"] = _estimate(model, base, args.seq, args.steps)
        results["rows"].append(row)
        print(f"{LABELS[(framework, base)]}: base {row['base_bytes'] / GiB:.2f} GiB, train peak "
              f"{row['train_peak_bytes'] / GiB:.2f} GiB, step {row['step_s']:.2f} s", flush=True)
    out = RESULTS / (args.out or ("qlora_quick" if args.quick else "qlora"))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(results))
    print(render(results))


if __name__ == "__main__":
    main()

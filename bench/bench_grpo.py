"""GRPO with LoRA on CPU: nxd-finetune (``objective: grpo``, sampling on the training model with its
KV cache) against TRL's ``GRPOTrainer`` + ``peft`` (generating with transformers' ``generate``) on the
same model, prompts, reward and settings: step time split into generation and training, and peak
memory, in one run.

    python bench/bench_grpo.py                    # 4 layers, 2 prompts x 8 completions of 32 tokens, 6 steps
    python bench/bench_grpo.py --quick            # 2 layers, 4 steps
    python bench/bench_grpo.py --layers 8 --completion 64 --note "quiet machine"

The model: a random-init (seed 0) ``LlamaForCausalLM``, hidden 512, 8 query / 4 kv heads, MLP 1376,
the quickstart tokenizer's vocabulary and chat template, fp32; written once under
``bench/.cache/models/`` (git-ignored). The prompts: the quickstart's eval questions as conversations
(rendered with the chat template's generation prompt by each side). Both sides, each in its own
process (``system.run_worker``) with ``--threads`` torch threads: LoRA r16 alpha 32 on every linear
layer, AdamW lr 1e-5, ``num_generations`` 8, ``--prompts`` prompts per step (one generation per
optimizer step, TRL's ``steps_per_generation = gradient_accumulation_steps = 1``), temperature 1,
top_p 1, no top_k, ``beta`` 0, ``num_iterations`` 1, ``loss_type: dapo`` (TRL's defaults), the same
reward function (:func:`length_reward`). The random model rarely samples its end token, so both
sides decode nearly every completion to ``--completion`` tokens: the same work.

Measured in each worker, over the steps after the first (warm-up): ``step`` = the median wall time
of a step; ``generation`` = the median time sampling a step's completions (ours: its
``time/generation_s`` in ``metrics.jsonl``; TRL: the time in ``GRPOTrainer._generate``, wrapped by a
timer); ``training`` = step - generation (scoring, the loss's forward and backward passes, the
optimizer); ``peak`` = the process's peak resident memory (``VmHWM``: interpreter, libraries, model,
adapter, optimizer, KV cache, activations) at the end; ``cpu/step`` = process CPU seconds per step
over the whole training call (ours includes building the model, TRL's does not). Results:
``bench/results/grpo_cpu[_quick].{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))

from bench import report, runs, system  # noqa: E402
from bench.runs import CACHE, MiB  # noqa: E402

QUESTIONS = ROOT / "nxd_finetune" / "assets" / "quickstart" / "eval.jsonl"
SHAPE: dict[str, Any] = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
                         "intermediate_size": 1376, "max_position_embeddings": 1024, "tie_word_embeddings": False,
                         "rms_norm_eps": 1e-5}
LABELS = {"nxd": "nxd-finetune (KV-cache sampler)", "trl": "TRL GRPOTrainer + peft (transformers generate)"}
GOAL_SPEED, GOAL_MEMORY = 1.5, 0.7  # issue 44 item 9


def length_reward(completion_ids: Sequence[Sequence[int]], **kwargs: object) -> list[float | None]:
    """The reward both sides use (TRL's signature): the completion's length in tokens, / 100."""
    return [len(ids) / 100 for ids in completion_ids]


def ensure_model(layers: int) -> Path:
    """``bench/.cache/models/grpo-llama-<layers>l``: the quickstart tokenizer and a random-init
    (seed 0) ``LlamaForCausalLM`` of :data:`SHAPE` with ``layers`` layers, fp32."""
    return runs.ensure_model(f"grpo-llama-{layers}l", "LlamaConfig", SHAPE, layers)


def prompts_file(n: int) -> Path:
    """The first ``n`` quickstart eval questions as ``prompt`` rows (a user message each)."""
    out = CACHE / "grpo_prompts.jsonl"
    rows = []
    for line in QUESTIONS.read_text().splitlines()[:n]:
        user = [m for m in json.loads(line)["messages"] if m["role"] == "user"][-1]
        rows.append({"prompt": [{"role": "user", "content": user["content"]}]})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _ours(spec: dict[str, Any], model_dir: Path, data: Path, out: Path) -> tuple[list[float], list[float]]:
    """``nxd-finetune run`` in this process; step and generation times from its metrics.jsonl."""
    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft.trainer import run

    rows = spec["prompts"] * spec["generations"]
    recipe = recipe_from_dict({
        "model": {"path": str(model_dir), "dtype": "fp32"},
        "data": {"train": str(data), "format": "prompt", "shuffle": False},
        "objective": "grpo",
        "rl": {"reward_funcs": ["bench.bench_grpo:length_reward"], "num_generations": spec["generations"],
               "max_completion_length": spec["completion"], "temperature": 1.0, "beta": 0.0},
        "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "training": {"micro_batch_size": rows, "grad_accum": 1, "max_steps": spec["steps"], "lr": 1e-5,
                     "scheduler": "constant", "warmup_steps": 0, "precision": "fp32", "device": "cpu", "seed": 0,
                     "grad_clip": 1.0, "weight_decay": 0.0},
        "eval": {"before": False}, "logging": {"progress": False, "every_n_steps": 1},
        "checkpoint": {"every_n_steps": None, "resume": None}, "output": {"dir": str(out)},
    })
    run(recipe)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "train_loss" in r]
    stamps = [r["time"] for r in records]
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)], [r["time/generation_s"] for r in records[1:]]


def _trl(spec: dict[str, Any], model_dir: Path, data: Path, out: Path) -> tuple[list[float], list[float]]:
    """TRL's ``GRPOTrainer`` with a peft LoRA; step times from a callback, generation from a timer
    around ``GRPOTrainer._generate``."""
    import peft
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=spec["prompts"] * spec["generations"],
                      gradient_accumulation_steps=1, num_generations=spec["generations"],
                      max_completion_length=spec["completion"], temperature=1.0, beta=0.0, learning_rate=1e-5,
                      max_steps=spec["steps"], lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                      report_to=[], use_cpu=True, save_strategy="no", bf16=False, fp16=False, seed=0,
                      max_grad_norm=1.0, weight_decay=0.0, shuffle_dataset=False, dataloader_num_workers=0)
    lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[length_reward], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, peft_config=lora)
    generation: list[float] = []
    inner = trainer._generate

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        result = inner(*a, **k)
        generation.append(time.perf_counter() - t)
        return result

    trainer._generate = timed  # type: ignore[method-assign]
    stamps: list[float] = []

    class Stamps(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            stamps.append(time.perf_counter())

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if not stamps:
                stamps.append(time.perf_counter())

    trainer.add_callback(Stamps())
    trainer.train()
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return steps[1:], generation[1:]


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One side, in this process: train ``steps`` GRPO steps, measure."""
    import torch

    torch.manual_seed(0)
    model_dir, data = Path(spec["model"]), Path(spec["data"])
    out = CACHE / "outputs" / f"grpo-{spec['framework']}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
    baseline = runs.vm("VmRSS")
    cpu0, t0 = time.process_time(), time.perf_counter()
    steps, generation = (_ours if spec["framework"] == "nxd" else _trl)(spec, model_dir, data, out)
    cpu_per_step = (time.process_time() - cpu0) / spec["steps"]
    step_s, gen_s = statistics.median(steps), statistics.median(generation)
    tokens = spec["prompts"] * spec["generations"] * spec["completion"]  # at most: completions sampled per step
    return {"step_s": step_s, "generation_s": gen_s, "training_s": step_s - gen_s, "steps_per_s": 1 / step_s,
            "step_times": steps, "generation_times": generation, "peak_bytes": runs.vm("VmHWM"),
            "baseline_rss_bytes": baseline, "total_s": time.perf_counter() - t0,
            "tokens": tokens, "time_s": step_s, "cpu_s": cpu_per_step}


def render(res: dict[str, Any]) -> str:
    rows = {r["framework"]: r for r in res["rows"]}
    lines = [f"# GRPO with LoRA, CPU ({res['shape']})", "",
             f"{res['cpu']}, {res['threads']} torch thread(s) per side, {res['prompts']} prompts x "
             f"{res['generations']} completions of up to {res['completion']} tokens per step, {res['steps']} steps "
             f"per side (the first not timed). {res['note']}", "",
             "| side | steps/s | step | generation | training | cpu/step | peak memory | other cores |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in ("nxd", "trl"):
        r = rows.get(key)
        if r is not None:
            lines.append(f"| {LABELS[key]} | {r['steps_per_s']:.3f} | {r['step_s']:.2f} s | {r['generation_s']:.2f} s"
                         f" | {r['training_s']:.2f} s | {r['cpu_s']:.2f} s | {r['peak_bytes'] / MiB:.0f} MiB | "
                         f"{r['other_cores']:.2f} |")
    ours, trl = rows.get("nxd"), rows.get("trl")
    if ours and trl:
        speed, memory = ours["steps_per_s"] / trl["steps_per_s"], ours["peak_bytes"] / trl["peak_bytes"]
        gen, train = trl["generation_s"] / ours["generation_s"], trl["training_s"] / ours["training_s"]
        lines += ["", f"- steps/s nxd / TRL: {speed:.2f}x (goal >= {GOAL_SPEED}x: "
                      f"{'met' if speed >= GOAL_SPEED else 'not met'}); TRL's time / ours: generation {gen:.2f}x, "
                      f"training {train:.2f}x",
                  f"- peak memory nxd / TRL: {memory:.2f}x (goal <= {GOAL_MEMORY}x: "
                  f"{'met' if memory <= GOAL_MEMORY else 'not met'})"]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path, plt: ModuleType) -> Path:
    rows = [r for key in ("nxd", "trl") for r in res["rows"] if r["framework"] == key]
    labels = [LABELS[r["framework"]].replace(" (", "\n(") for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
    x = list(range(len(rows)))
    gen = [r["generation_s"] for r in rows]
    a1.bar(x, gen, 0.5, label="generation")
    a1.bar(x, [r["training_s"] for r in rows], 0.5, bottom=gen, label="training")
    a1.set_ylabel("seconds per GRPO step (median)")
    a1.legend(fontsize=7)
    a2.bar(x, [r["peak_bytes"] / MiB for r in rows])
    a2.set_ylabel("peak resident memory (MiB)")
    title = (f"GRPO + LoRA on CPU ({res['shape']}; {res['prompts']} x {res['generations']} completions of "
             f"{res['completion']} tokens per step)")
    return runs.save_figure(plt, fig, (a1, a2), labels, title, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers, 4 steps")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --quick 2)")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="completions per prompt (num_generations)")
    ap.add_argument("--completion", type=int, default=32, help="max_completion_length")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per side, the first not timed (default 6; --quick 4)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per side")
    runs.add_result_args(ap, "grpo_cpu[_quick]")
    args = ap.parse_args()
    layers = args.layers or (2 if args.quick else 4)
    steps = args.steps or (4 if args.quick else 6)
    model = ensure_model(layers)
    data = prompts_file(args.prompts * steps)
    shape = f"random Llama, hidden {SHAPE['hidden_size']}, {layers} layers, fp32"
    res: dict[str, Any] = {"shape": shape, "cpu": report.cpu_model(), "machine": platform.machine(),
                           "threads": args.threads, "prompts": args.prompts, "generations": args.generations,
                           "completion": args.completion, "steps": steps, "note": args.note, "rows": []}
    for framework in ("nxd", "trl"):
        spec = {"framework": framework, "model": str(model), "data": str(data), "prompts": args.prompts,
                "generations": args.generations, "completion": args.completion, "steps": steps,
                "threads": args.threads}
        row = {**spec, **system.run_worker(Path(__file__), spec)}  # this file, a spec as its argument: worker()
        res["rows"].append(row)
        print(f"{LABELS[framework]}: {row['steps_per_s']:.3f} steps/s (generation {row['generation_s']:.2f} s, "
              f"training {row['training_s']:.2f} s), peak {row['peak_bytes'] / MiB:.0f} MiB", flush=True)
    runs.write_results(res, args.out or ("grpo_cpu_quick" if args.quick else "grpo_cpu"), render, plot)


if __name__ == "__main__" and not runs.run_as_worker(worker):  # a worker (system.run_worker) runs one side
    main()

"""LoRA SFT on one GPU: nxd-finetune against HF transformers + peft (padded and padding-free) and
HF + liger-kernel, side by side in one run: tokens/s, step time, peak device memory, MFU against
the measured bf16 matmul peak of the same GPU, and ``validate``'s memory estimate beside the
measured peak.

    python3 bench/bench_gpu.py --out DIR [--shapes 1b,8b] [--steps N] [--device cuda|cpu] [--tiny]
    python3 bench/bench_gpu.py --device cpu --tiny --out /tmp/gpu_smoke     # CPU smoke (make bench-gpu-smoke)

Writes ``DIR/gpu_bench.json`` (every number) and ``DIR/gpu_bench.md`` (the table), rewritten after
every configuration so a run cut short keeps what it measured. Method, formulas and caveats:
bench/README.md ("GPU mode"). ``--device cpu --tiny`` runs the whole pipeline on a CPU with tiny
shapes: a smoke check of the code, never a GPU result.

Shapes (random init, bf16, drawn on the device: bench/gpu_worker.py ``checkpoint``): ``1b`` =
Llama-3.2-1B's config (hidden 2048, 16 layers, 32/8 heads, ffn 8192, vocab 128256, tied), ``8b``
= Llama-3-8B's (hidden 4096, 32 layers, 32/8 heads, ffn 14336, vocab 128256). Data:
bench/data/sft.jsonl (512 chat samples, 20-491 tokens, prompts masked) with the quickstart
tokenizer (its ids only; the model computes all 128256 logits). Per shape, each configuration in
its own process (bench/gpu_worker.py), HF padded first (see ``--padded-samples``):

- ``ours``: nxd-finetune, packed rows of ``--seq-len`` (2048) tokens, one row per micro-batch;
- ``hf-padded``: HF + peft, micro-batches of ``k`` samples padded to the longest, ``k`` = seq-len /
  mean sample length (the same tokens per micro-batch as a packed row, on average). If it runs out
  of device memory, it is run again with ``k / 2`` samples and twice the micro-batches per step
  (the same samples per optimizer step), and the table says so;
- ``hf-flat``: the same micro-batches as ``hf-padded``, flattened (padding-free);
- ``liger``: ``hf-flat`` with liger-kernel's fused Llama ops, where liger-kernel imports;
- ``ours-compile``: ``ours`` with ``model.compile: true``, on the ``--compile-shapes`` (default 1b),
  after every shape's other configurations (the optional row goes first when the budget runs out);
  the table's note gives the compile time (the warm-up's seconds less its steps at the median).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_report  # noqa: E402
from bench.bench_scale import SHAPE_1B  # noqa: E402
from bench.common import BENCH, CACHE, DATA, LORA, ROOT, SEED, param_counts, train_flops  # noqa: E402
from nxd_finetune.data.loader import build_dataloaders  # noqa: E402
from nxd_finetune.quickstart import ensure_tiny_model  # noqa: E402

WORKER = BENCH / "gpu_worker.py"
SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
TINY = {  # --tiny: 2 layers, the tokenizer's vocabulary (None), tied as the full shape
    "1b": dict(SHAPE_1B, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=None, rope_scaling=None, max_position_embeddings=2048),
    "8b": dict(SHAPE_8B, hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=1, head_dim=32, vocab_size=None, max_position_embeddings=2048),
}
SHAPES = {"1b": SHAPE_1B, "8b": SHAPE_8B}
CONFIGS = ("hf-padded", "ours", "hf-flat", "liger")  # padded first: its micro-batch may need halving
NOT_DONE = ["a plot (png): not drawn"]


def fail(message: str) -> NoReturn:
    """Bad input: one ``error:`` line, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class Interrupted(Exception):
    """SIGTERM / SIGINT (e.g. a time box around the bench) arrived; the running worker was killed."""


class Workers:
    """Runs ``gpu_worker.py`` processes one at a time, each in its own process group. Each gets at
    most ``timeout_s`` and what is left of ``budget_s`` (None: no budget); a configuration that
    fails, runs out of time or finds the budget spent becomes a result that says so, not the end of
    the benchmark. On SIGTERM / SIGINT the running worker's group is killed at once (so no orphan
    keeps the GPU) and :class:`Interrupted` is raised in the main thread."""

    MIN_LEFT_S = 10.0  # less budget than this left: do not start another configuration

    def __init__(self, timeout_s: float, budget_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.proc: subprocess.Popen[str] | None = None
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, signum: int, frame: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        raise Interrupted(signal.Signals(signum).name)

    def run(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The worker's ``RESULT`` dict, or ``{"error": ...}`` / ``{"skipped": ...}``."""
        limit = self.timeout_s
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left < self.MIN_LEFT_S:
                return {"skipped": "not started: the bench's --budget-s was spent"}
            limit = min(limit, left)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
        try:
            out, err = self.proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
            return {"error": f"cut after {limit:.0f} s (--worker-timeout / --budget-s)",
                    "process_s": time.perf_counter() - t0}
        finally:
            rc, self.proc = self.proc.returncode, None
        line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
        if rc != 0 or line is None:
            return {"error": (err or out)[-3000:], "process_s": time.perf_counter() - t0}
        result: dict[str, Any] = json.loads(line[len("RESULT "):])
        result["process_s"] = time.perf_counter() - t0
        return result


def shape_config(name: str, tiny: bool, tokenizer: Any) -> dict[str, Any]:
    """The LlamaConfig kwargs of a shape (tiny: its 2-layer version with the tokenizer's vocabulary)."""
    cfg = dict(TINY[name] if tiny else SHAPES[name])
    cfg["vocab_size"] = cfg["vocab_size"] or len(tokenizer)
    return dict(cfg, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def ensure_checkpoint(name: str, config: dict[str, Any], args: argparse.Namespace, tokenizer_dir: Path,
                      workers: Workers) -> tuple[Path, dict[str, Any]]:
    """The shape's random-init checkpoint under the cache (written on the device once per machine)."""
    model_dir = CACHE / "gpu" / "models" / f"{name}{'-tiny' if args.tiny else ''}"
    spec_file = model_dir / "bench_spec.json"
    if spec_file.is_file() and json.loads(spec_file.read_text()) == json.loads(json.dumps(config, sort_keys=True)):
        return model_dir, {"cached": True}
    spec = {"framework": "checkpoint", "device": args.device, "model_dir": str(model_dir), "config": config,
            "tokenizer": str(tokenizer_dir)}
    return model_dir, workers.run(spec)


def hf_steps(tokenizer: Any, args: argparse.Namespace, samples: int, grad_accum: int, steps: int) -> list[Any]:
    """HF's optimizer steps: ``grad_accum`` micro-batches of ``samples`` samples each, in the order of
    our loader with packing off (the recipe's seeded shuffle, epoch 0)."""
    data = build_dataloaders(data_section(args, packing=False), tokenizer, micro_batch_size=samples, seed=SEED)
    ds, rows, sampler = data.train.batch_of.dataset, data.train.batch_of.rows, data.train.sampler
    micro = [[ds[i] for row in b for i in rows[row]] for b in sampler.rank_batches(0)]
    out = [micro[i: i + grad_accum] for i in range(0, len(micro) - grad_accum + 1, grad_accum)][:steps]
    if len(out) < steps:
        fail(f"the data holds {len(out)} optimizer steps of {grad_accum} x {samples} samples; "
             f"--steps + --warmup ask for {steps}")
    return out


def data_section(args: argparse.Namespace, packing: bool) -> dict[str, Any]:
    return {"train": str(DATA), "format": "messages", "max_seq_len": args.seq_len, "packing": packing,
            "shuffle": True, "cache_dir": str(CACHE / "gpu" / "data")}


def write_batches(path: Path, steps: list[Any]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"steps": steps}))
    return str(path)


def derive(row: dict[str, Any], config: dict[str, Any], peak: float | None) -> None:
    """Rates, FLOPs and MFU of a finished configuration, in place (formulas: bench/README.md)."""
    r = row["result"]
    if "time_s" not in r:
        return
    counts = param_counts(config, LORA["rank"])
    r["tokens_per_s"] = r["tokens"] / r["time_s"]
    r["targets_per_s"] = r["targets"] / r["time_s"]
    r["useful_flops"] = train_flops(config, LORA["rank"], r["lengths"])
    r["flops_per_s"] = r["useful_flops"] / r["time_s"]
    r["flops_6n_per_s"] = 6 * (counts["base"] + counts["lora"]) * r["tokens_per_s"]
    r["mfu"] = r["flops_per_s"] / peak if peak else None
    r["mfu_6n"] = r["flops_6n_per_s"] / peak if peak else None
    r["padding"] = 1 - r["tokens"] / r["slots"] if r.get("slots") else None


def bench_shape(name: str, args: argparse.Namespace, workers: Workers, res: dict[str, Any],
                emit: Callable[[], None]) -> None:
    """One shape's configurations, appended to ``res["shapes"]`` as they finish (``emit`` after each)."""
    tok_dir = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = shape_config(name, args.tiny, tokenizer)
    model_dir, ckpt = ensure_checkpoint(name, config, args, tok_dir, workers)
    shape: dict[str, Any] = {"shape": name + ("-tiny" if args.tiny else ""), "config": config,
                             "params": param_counts(config, LORA["rank"]), "checkpoint": ckpt, "rows": []}
    res["shapes"].append(shape)
    if "error" in ckpt or "skipped" in ckpt:
        print(f"{name}: no checkpoint: {ckpt.get('error', ckpt.get('skipped'))[-500:]}", flush=True)
        return
    lengths = build_dataloaders(data_section(args, packing=False), tokenizer, micro_batch_size=1,
                                seed=SEED).train.batch_of.dataset.lengths.tolist()
    k = args.padded_samples or max(1, round(args.seq_len / statistics.mean(lengths)))
    total = args.warmup + args.steps
    work = CACHE / "gpu" / "work" / shape["shape"]
    base = {"device": args.device, "precision": args.precision, "model_dir": str(model_dir), "seq_len": args.seq_len,
            "grad_accum": args.grad_accum, "warmup_steps": args.warmup, "timed_steps": args.steps,
            "attention": args.attention, "data": str(DATA), "cache_dir": str(CACHE / "gpu" / "data"), "work": str(work)}
    batches = write_batches(work / f"hf_{k}.json", hf_steps(tokenizer, args, k, args.grad_accum, total))
    shape.update(padded_samples=k, mean_sample_tokens=statistics.mean(lengths))
    print(f"{shape['shape']}: {config['hidden_size']}h x {config['num_hidden_layers']}L, vocab {config['vocab_size']};"
          f" HF micro-batches of {k} samples", flush=True)
    shape["base_spec"] = dict(base, batches=batches)
    for cfg in CONFIGS:
        spec = dict(base, framework=cfg.split("-")[0], packing=cfg != "hf-padded",
                    batches=batches, micro_batch=f"{k} samples" if cfg != "ours" else f"1 row of {args.seq_len}",
                    grad_accum=args.grad_accum)
        if cfg == "liger" and args.device != "cuda":
            result: dict[str, Any] = {"skipped": "liger-kernel's Triton kernels need a GPU"}
        else:
            result = workers.run(spec)
        row = {"config": cfg, "spec": spec, "result": result}
        if cfg == "hf-padded" and "oom" in result and k > 1:
            row["first_try"] = {"micro_batch": spec["micro_batch"], **result}
            half = write_batches(work / f"hf_{k // 2}.json",
                                 hf_steps(tokenizer, args, k // 2, args.grad_accum * 2, total))
            spec = dict(spec, batches=half, grad_accum=args.grad_accum * 2, micro_batch=f"{k // 2} samples")
            row.update(spec=spec, result=workers.run(spec),
                       note=f"out of device memory at {k} samples per micro-batch x {args.grad_accum}; run again "
                            f"with {k // 2} samples x {args.grad_accum * 2} micro-batches per step")
        derive(row, config, res["matmul_peak"].get("flops_per_s"))
        shape["rows"].append(row)
        print("  " + gpu_report.progress_line(row), flush=True)
        emit()


def bench_compiled(shape: dict[str, Any], args: argparse.Namespace, workers: Workers, peak: float | None,
                   emit: Callable[[], None]) -> None:
    """The ``ours-compile`` row of a shape whose other rows ran (``bench_shape``)."""
    if "base_spec" not in shape:
        return
    spec = dict(shape["base_spec"], framework="ours", packing=True, compile=True,
                micro_batch=f"1 row of {args.seq_len}", grad_accum=args.grad_accum)
    row = {"config": "ours-compile", "spec": spec, "result": workers.run(spec)}
    derive(row, shape["config"], peak)
    shape["rows"].append(row)
    print("  " + gpu_report.progress_line(row), flush=True)
    emit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory for gpu_bench.json / gpu_bench.md")
    ap.add_argument("--shapes", default="1b,8b", help="comma-separated: 1b,8b (default)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed optimizer steps per configuration (default 5; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first (default 2)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2-layer shapes, rows of 256 tokens: the CPU smoke check")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per packed row (default 2048; --tiny 256)")
    ap.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    ap.add_argument("--padded-samples", type=int, default=None,
                    help="samples per HF micro-batch (default: seq-len / mean sample length)")
    ap.add_argument("--precision", choices=("bf16-mixed", "fp32"), default=None,
                    help="default: bf16-mixed on cuda (bf16 weights, fp32 adapters, bf16 autocast); fp32 on cpu")
    ap.add_argument("--attention", default=None,
                    help="nxd-finetune's model.attention (auto, sdpa, flex); default: the recipe default, auto")
    ap.add_argument("--compile-shapes", default="1b",
                    help="shapes that also run nxd-finetune with model.compile, after all others (default 1b; "
                         "'' for none)")
    ap.add_argument("--peak-n", type=int, default=None, help="matmul peak size n (n^3; default 8192, cpu 512)")
    ap.add_argument("--worker-timeout", type=float, default=300.0, help="seconds per configuration before it is cut")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for the whole bench: configurations that would start later are skipped, and "
                         "the running one is cut at the limit (default: none; set it below an outer time box)")
    args = ap.parse_args()
    args.shapes = args.shapes.split(",")
    args.compile_shapes = [s for s in args.compile_shapes.split(",") if s]
    bad = [s for s in args.shapes + args.compile_shapes if s not in SHAPES]
    if bad or args.grad_accum < 1 or args.warmup < 1:
        fail(f"unknown shape(s) {', '.join(bad)} (use 1b, 8b)" if bad else "--grad-accum and --warmup must be >= 1")
    args.steps = args.steps or (2 if args.tiny else 5)
    args.seq_len = args.seq_len or (256 if args.tiny else 2048)
    args.precision = args.precision or ("bf16-mixed" if args.device == "cuda" else "fp32")
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        fail("--device cuda, but no CUDA device is visible (the CPU smoke check: --device cpu --tiny)")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    peak_spec = {"framework": "peak", "device": args.device, "n": args.peak_n or (8192 if gpu else 512), "reps": 10,
                 "warmup": 3, "dtype": "bfloat16" if args.precision != "fp32" else "float32"}
    workers = Workers(args.worker_timeout, args.budget_s)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": args.device, "tiny": args.tiny,
        "gpu_result": gpu and not args.tiny, "matmul_peak": {}, "env": {},
        "settings": {"seq_len": args.seq_len, "grad_accum": args.grad_accum, "warmup_steps": args.warmup,
                     "timed_steps": args.steps, "precision": args.precision, "lora": LORA,
                     "data": str(DATA.relative_to(ROOT))},
        "not_done": NOT_DONE, "shapes": [],
    }

    def emit() -> None:
        res["duration_s"] = round(time.time() - t0, 1)
        (args.out / "gpu_bench.json").write_text(json.dumps(res, indent=1))
        (args.out / "gpu_bench.md").write_text(gpu_report.markdown(res))

    try:
        res["matmul_peak"] = workers.run(peak_spec)
        res["env"] = res["matmul_peak"].get("info", {})
        print(f"matmul peak: {gpu_report.peak_line(res['matmul_peak'])}", flush=True)
        emit()
        for name in args.shapes:
            bench_shape(name, args, workers, res, emit)
        for shape in res["shapes"]:
            if shape["shape"].removesuffix("-tiny") in args.compile_shapes:
                bench_compiled(shape, args, workers, res["matmul_peak"].get("flops_per_s"), emit)
    except Interrupted as e:
        res["interrupted"] = f"{e}: the bench was stopped; the configurations after the last row did not run"
        emit()
        print(f"interrupted ({e}); results so far in {args.out}", file=sys.stderr)
        raise SystemExit(1) from None
    emit()
    print((args.out / "gpu_bench.md").read_text())


if __name__ == "__main__":
    main()

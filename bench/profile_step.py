"""Profile one training micro-step of ours or HF's on a benchmark batch (torch.profiler op table).

    python bench/profile_step.py --framework ours --shape small --packing
    python bench/profile_step.py --framework hf --shape large --threads 1 --reps 3
    python bench/profile_step.py --shape real --packing --mbs 4 --threads 1 --optimizer

Uses the models and data of bench/bench_lora.py (run it or ``--quick`` once first so the model and
data caches exist); ``--shape real``: ``builtin:smollm2-135m-instruct`` (the extra ``[smollm2]``)
on the quickstart's training conversations in rows of 128 tokens, as ``bench/bench_real.py`` trains
it. Prints the mean wall time of forward+backward over ``--reps``, the fraction of the fp32
matmul peak it reaches (``--peak``: GFLOP/s per CPU-second, as bench_real measures it) and the
top ops.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.common import CACHE, LORA, SEED, ensure_model, recipe_dict  # noqa: E402

REAL = "real"  # --shape real: builtin:smollm2-135m-instruct, as bench/bench_real.py trains it
REAL_SEQ_LEN = 128


def real_model() -> Path:
    from nxd_finetune.smollm2 import ensure_smollm2

    return ensure_smollm2()


def shape_recipe(shape: str, packing: bool, mbs: int) -> dict[str, Any]:
    """The recipe of ``shape``: bench_lora's, or for ``real`` the real model on the quickstart data."""
    if shape != REAL:
        return recipe_dict(shape, packing, mbs, 1, None)
    train = Path(__file__).resolve().parents[1] / "nxd_finetune" / "assets" / "quickstart" / "train.jsonl"
    recipe = recipe_dict("small", packing, mbs, 1, None)
    recipe["model"]["path"] = str(real_model())
    recipe["data"].update(train=str(train), max_seq_len=REAL_SEQ_LEN, shuffle=False,
                          cache_dir=str(CACHE / "data_real"))
    return recipe


def batch_for(shape: str, packing: bool, mbs: int, index: int) -> dict[str, torch.Tensor]:
    from nxd_finetune.data.inputs import load_tokenizer
    from nxd_finetune.data.loader import build_dataloaders
    from nxd_finetune.recipe import recipe_from_dict

    recipe = recipe_from_dict(shape_recipe(shape, packing, mbs))
    tok = load_tokenizer(recipe, Path(recipe.model.path))
    data = build_dataloaders(recipe.data, tok, micro_batch_size=mbs, seed=SEED)
    it = iter(data.train)
    for _ in range(index):
        next(it)
    batch = next(it)
    if not packing:  # as the trainer's step_batches: unpacked rows keep the is_causal path
        batch.pop("segment_ids")
    return batch


def ours_step(shape: str, optimizer: bool = False, compiled: bool = False):
    """The trainer's step on one micro-batch: ``Engine.forward_backward`` (loss at target positions),
    plus ``Engine.step`` (clipping, AdamW, schedule) with ``optimizer``; ``compiled``: ``model.compile``."""
    from nxd_finetune.objective import SFT
    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft.engine import build_engine

    spec = shape_recipe(shape, True, 1)
    spec["model"]["compile"] = compiled
    recipe = recipe_from_dict(spec)
    engine = build_engine(recipe, Path(recipe.model.path), torch.device("cpu"), 1000)
    engine.train(True)

    def step(batch):
        n = (batch["labels"][:, 1:] != -100).sum().clamp(min=1).float()
        engine.forward_backward([batch], n, SFT)
        if optimizer:
            engine.step()

    return engine.model, step


def hf_step(shape: str):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    path = real_model() if shape == REAL else ensure_model(shape)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()

    def step(batch):
        mask = batch.get("segment_ids")
        attn = (mask > 0).long() if mask is not None else (batch["labels"] != -12345).long()
        n = (batch["labels"][:, 1:] != -100).sum()
        out = model(input_ids=batch["input_ids"], attention_mask=attn, labels=batch["labels"], num_items_in_batch=n,
                    use_cache=False)
        out.loss.backward()

    return model, step


def model_path(shape: str) -> Path:
    return real_model() if shape == REAL else ensure_model(shape)


def peak_line(model: Path, batch: dict[str, torch.Tensor], cpu_s: float) -> str:
    """The step's training FLOPs (``bench.common.train_flops``: LoRA ``4 N_base + 6 N_lora`` per token
    plus causal attention per sample) per CPU-second against the fp32 matmul peak measured now."""
    import json

    from bench.common import train_flops
    from bench.system import matmul_peak

    seg = batch.get("segment_ids")
    lengths = ([int(n) for row in seg for n in torch.unique_consecutive(row[row > 0], return_counts=True)[1]]
               if seg is not None else [int(n) for n in (batch["labels"] != -99999).sum(1)])
    flops = train_flops(json.loads((model / "config.json").read_text()), LORA["rank"], lengths)
    peak = matmul_peak(threads=torch.get_num_threads())["flops_per_cpu_s"]
    return (f"{flops / 1e9:.1f} GFLOP per step: {flops / cpu_s / 1e9:.1f} GFLOP/s per CPU-s, fp32 matmul peak "
            f"{peak / 1e9:.1f}: {100 * flops / cpu_s / peak:.0f}% of it")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=["ours", "hf"], default="ours")
    ap.add_argument("--shape", default="small")
    ap.add_argument("--packing", action="store_true")
    ap.add_argument("--mbs", type=int, default=None, help="default: 1 packed row or 4 padded samples")
    ap.add_argument("--index", type=int, default=0, help="which micro-batch of epoch 0")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--optimizer", action="store_true", help="ours: include the optimizer step")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--compile", action="store_true", help="ours: model.compile (3 untimed warm-up steps)")
    ap.add_argument("--peak", action="store_true", help="measure the fp32 matmul peak and print the fraction")
    ap.add_argument("--sort", default="self_cpu_time_total", help="the op table's sort key")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(SEED)
    mbs = args.mbs or (1 if args.packing else 4)
    batch = batch_for(args.shape, args.packing, mbs, args.index)
    if args.framework == "hf" and args.packing:
        raise SystemExit("HF runs padded batches only")
    model, step = (ours_step(args.shape, args.optimizer, args.compile) if args.framework == "ours"
                   else hf_step(args.shape))
    t = time.perf_counter()
    for _ in range(3 if args.compile else 1):  # warmup (compile: the first sizes, then dynamic ones)
        step(batch)
    print(f"warm-up {time.perf_counter() - t:.1f}s")
    times, cpu = [], []
    for _ in range(args.reps):
        t, c = time.perf_counter(), time.process_time()
        step(batch)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    packed = "segment_ids" in batch
    n_tok = int((batch["segment_ids"] > 0).sum()) if packed else int((batch["labels"] != -99999).sum())
    layout = "packed" if args.packing else "padded"
    print(f"{args.framework} {args.shape} {layout} batch {tuple(batch['input_ids'].shape)}: "
          f"fwd+bwd min {min(times):.3f}s mean {sum(times) / len(times):.3f}s, CPU time min {min(cpu):.3f}s "
          f"({n_tok} slots; on a busy machine compare CPU times with --threads 1)")
    if args.peak:
        print(peak_line(model_path(args.shape), batch, min(cpu)))
    if args.no_profile:
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False) as prof:
        step(batch)
    print(prof.key_averages().table(sort_by=args.sort, row_limit=args.rows))


if __name__ == "__main__":
    main()

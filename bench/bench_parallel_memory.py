"""Per-rank memory of the parallel layouts: parameter, gradient and optimizer bytes, peak RSS.

    python bench/bench_parallel_memory.py            # ~300M-parameter Llama, full SFT and LoRA
    python bench/bench_parallel_memory.py --quick    # a 30M model, to check the script
    python bench/bench_parallel_memory.py --only sft:dp2,sft:dp2-zero1 --note "..."  # re-run rows

For each layout (tp 1/2, ZeRO-1 off/on over dp 2) and each mode (full SFT, LoRA), the workers are
started by the same launcher ``nxd-finetune run`` uses (spawn, so each process starts clean) and
run the trainer's engine for ``--steps`` optimizer steps on the quickstart data (packed 128-token
rows). Each rank reports:

- ``params_mb`` / ``trainable_mb``: bytes of the parameters it holds (sharded ones: its shard);
- ``grads_mb``: bytes of the gradients after the last backward (before the optimizer step);
- ``optim_mb``: bytes of the optimizer's tensors (Adam moments; with ZeRO-1 the dp shard of the
  moments plus the fp32 master shards that are copies: with fp32 parameters the master shards are
  views into the parameters and add nothing);
- ``rss_after_build_mb``: resident memory once the model is built and loaded (each rank reads only
  its slices of the safetensors files, so this is well under the full model at tp=2);
- ``peak_rss_mb``: the process's resident high-water mark (``VmHWM``) at the end.

The checkpoint is a ``transformers.LlamaForCausalLM`` with random weights (seed 0), written once
under ``bench/.cache/models/``. Results: ``bench/results/parallel_memory[_quick].{json,md}``.
``--only MODE:LAYOUT,...`` runs those rows and puts them in place of the same rows of the existing
results (each row keeps the date it was measured); ``--note`` records a line about the conditions
(other jobs on the machine...) under the table.
"""

from __future__ import annotations

import argparse
import difflib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SHAPES = {
    "300m": dict(hidden_size=1024, num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=2816, vocab_size=32000),
    "30m": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1376, vocab_size=32000),
}
# name -> (nproc, recipe overrides)
LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["parallel.tp=2"]),
    "dp2": (2, []),
    "dp2-zero1": (2, ["parallel.zero1=true"]),
    "tp2-dp2": (4, ["parallel.tp=2"]),
    "tp2-dp2-zero1": (4, ["parallel.tp=2", "parallel.zero1=true"]),
}
MODES = {"sft": ["lora=null", "training.lr=1e-5"], "lora": []}


def ensure_model(shape: str) -> Path:
    out = BENCH / ".cache" / "models" / f"memory-{shape}"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nxd_finetune.quickstart import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    config = LlamaConfig(max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
                         **SHAPES[shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _mb(tensors: Any) -> float:
    return round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 1)


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def worker(recipe_dict: dict[str, Any], steps: int) -> dict[str, Any]:
    """One rank: the trainer's engine and data, ``steps`` optimizer steps, then its numbers."""
    import torch

    from nxd_finetune.data.inputs import load_tokenizer
    from nxd_finetune.data.loader import build_dataloaders
    from nxd_finetune.objective import SFT
    from nxd_finetune.parallel.launch import init_distributed
    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft.engine import build_engine
    from nxd_finetune.sft.step import step_batches

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    backend = init_distributed("gloo")
    recipe = recipe_from_dict(recipe_dict)
    model_dir = Path(recipe.model.path)
    rss_start = _rss_mb()
    engine = build_engine(recipe, model_dir, torch.device("cpu"), steps)
    rss_build = _rss_mb()
    st = engine.state
    data = build_dataloaders(recipe.data, load_tokenizer(recipe, model_dir), micro_batch_size=1, dp_rank=st.coord("dp"),
                             dp_world=st.size("dp"), seed=0)
    batches = step_batches(data.train, recipe.grad_accum_steps, True)
    grads_mb, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        mbs, _ = next(batches)
        n = engine.dp_sum(sum((b["labels"][:, 1:] != -100).sum() for b in mbs).float())
        engine.forward_backward(mbs, n, SFT)
        grads_mb = _mb(p.grad for p in engine.trainable() if p.grad is not None)
        engine.step()
    inner = engine.optimizer.optimizer
    zero1 = hasattr(inner, "flats")  # Zero1Optimizer: moments of the shards + fp32 master shards
    stepper = inner.inner if zero1 else inner
    optim = [v for s in stepper.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    optim += [f.master for f in inner.flats if f.param_buffer is None] if zero1 else []  # not views
    return {
        "rank": backend.rank, "tp_rank": st.coord("tp"), "dp_rank": st.coord("dp"),
        "params_mb": _mb(engine.parameters()), "trainable_mb": _mb(engine.trainable()),
        "grads_mb": grads_mb, "optim_mb": _mb(optim),
        "rss_start_mb": rss_start, "rss_after_build_mb": rss_build,
        # VmHWM, not ru_maxrss: the latter survives exec, so a spawned worker would report the
        # launching parent's peak whenever that is higher
        "peak_rss_mb": _status_mb("VmHWM"),
        "step_s": round((time.perf_counter() - t0) / steps, 2),
    }


def _selected(only: str | None) -> list[tuple[str, str]]:
    """``(mode, layout)`` rows to run: all, or those of ``--only`` (SystemExit naming a bad one)."""
    rows = [(mode, name) for mode in MODES for name in LAYOUTS]
    if only is None:
        return rows
    chosen = []
    for item in only.split(","):
        item = item.strip()
        mode, _, name = item.partition(":")
        if (mode, name) not in rows:
            close = difflib.get_close_matches(item, [f"{m}:{n}" for m, n in rows], n=1)
            raise SystemExit(f"--only: unknown row {item!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        chosen.append((mode, name))
    return chosen


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", help="comma-separated MODE:LAYOUT rows (e.g. sft:dp2,lora:dp2-zero1) to run in "
                    "place of the same rows of the existing results")
    ap.add_argument("--note", help="a line about the conditions of this run, shown under the table")
    args = ap.parse_args()
    from nxd_finetune.parallel.launch import launch
    from nxd_finetune.recipe import load_recipe

    shape = "30m" if args.quick else "300m"
    selected = _selected(args.only)
    model_dir = ensure_model(shape)
    out = BENCH / "results" / f"parallel_memory{'_quick' if args.quick else ''}"
    date = time.strftime("%Y-%m-%d %H:%M")
    previous = json.loads(out.with_suffix(".json").read_text()) if args.only and out.with_suffix(".json").is_file() \
        else {"meta": {}, "rows": []}
    new_rows = {}
    for mode, name in selected:
        nproc, layout = LAYOUTS[name]
        recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml", [
            f"model.path={model_dir}", "data.max_seq_len=128", "training.micro_batch_size=1",
            "training.grad_accum=1", "eval.every_n_steps=null", "checkpoint.every_n_steps=null",
            f"parallel.nproc={nproc}", *layout, *MODES[mode]])
        t = time.perf_counter()
        ranks = launch(worker, nproc, recipe.to_dict(), args.steps)
        print(f"{mode:5s} {name:14s} {time.perf_counter() - t:6.1f}s  " + "  ".join(
            f"r{r['rank']}: params {r['params_mb']} MB grads {r['grads_mb']} optim {r['optim_mb']} "
            f"peak {r['peak_rss_mb']} MB" for r in ranks), flush=True)
        new_rows[(mode, name)] = {"mode": mode, "layout": name, "nproc": nproc, "date": date, "ranks": ranks}
    old_rows = {(r["mode"], r["layout"]): r for r in previous["rows"]}
    rows = [new_rows.get(key) or old_rows[key] for key in [(m, n) for m in MODES for n in LAYOUTS]
            if key in new_rows or key in old_rows]
    meta = {**previous["meta"], "machine": f"{platform.processor() or platform.machine()}, "
            f"{__import__('os').cpu_count()} cores", "shape": SHAPES[shape], "parameters": _parameters(model_dir),
            "steps": args.steps, "seq": "packed rows of 128 tokens, micro-batch 1, fp32"}
    meta.setdefault("date", date)  # of the first full run; rows carry their own
    if args.note:
        meta["notes"] = [*meta.get("notes", []), f"{date} ({len(new_rows)} rows): {args.note}"]
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(render(meta, rows))
    print(f"wrote {out}.json and {out}.md")


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Per-rank memory of the parallel layouts ({meta['parameters'] / 1e6:.0f}M-parameter Llama)", "",
             f"{meta['machine']}; shape {meta['shape']}; {meta['seq']}; {meta['steps']} optimizer steps (AdamW). "
             "Numbers of rank 0 (the other ranks of a layout hold the same sizes); *measured*: when the row ran.", "",
             "| mode | layout | procs | params MB | trainable MB | grads MB | optimizer MB | RSS after build MB "
             "| peak RSS MB (rank 0) | peak RSS MB (max rank) | measured |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        r0 = row["ranks"][0]
        worst = max(r["peak_rss_mb"] for r in row["ranks"])
        lines.append(f"| {row['mode']} | {row['layout']} | {row['nproc']} | {r0['params_mb']} | {r0['trainable_mb']} "
                     f"| {r0['grads_mb']} | {r0['optim_mb']} | {r0['rss_after_build_mb']} | {r0['peak_rss_mb']} "
                     f"| {worst} | {row.get('date', meta['date'])} |")
    lines += ["", "- params: what the rank holds (tp shards); optimizer: Adam moments, which ZeRO-1 splits over the "
              "dp ranks, plus ZeRO-1's fp32 master shards where they are copies (bf16 parameters); with fp32 "
              "parameters the master shards are views into the parameters.",
              "- RSS includes the Python/torch runtime (~300-400 MB per process before the model).",
              "- ZeRO-1 with fp32 parameters (full SFT) keeps per rank the parameters and the gradients (one flat "
              "buffer each, the master shard a view into the parameters) and 1/dp of the Adam moments: "
              "4N + 4N + 8N/dp bytes for N trainable elements, against 4N + 4N + 8N for plain dp; its collectives "
              "work in place on gloo and AdamW steps the shard in chunks of 4M elements, so its temporaries stay "
              "small. With bf16 parameters it adds the fp32 master shards (4N/dp).",
              "- RSS after build is higher with ZeRO-1 and fp32 parameters: the optimizer copies the parameters "
              "into its flat buffer (without it they stay file-backed pages of the checkpoint until first used) "
              "and zeroes the gradient buffer at construction; the peak is reached in training either way.",
              *(f"- {note}" for note in meta.get("notes", [])), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

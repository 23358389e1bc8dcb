"""One configuration of the GPU benchmark (bench/bench_gpu.py), in its own process, so its peak
device memory is its own and an out-of-memory error ends only this configuration.

    python bench/gpu_worker.py '<json spec>'      # prints one JSON result line: RESULT {...}

``spec["framework"]``:

- ``peak``: the device's measured matmul peak (``n``^3 products in the bench's dtype: warm-up, then
  the mean of ``reps`` timed ones) and the device's facts (name, memory, torch / CUDA versions);
- ``checkpoint``: a random-init Llama checkpoint of ``config`` in ``model_dir``, drawn on the device
  and written one decoder layer per safetensors shard (never the whole model on the host);
- ``ours``: nxd-finetune as ``nxd-finetune run`` drives it: ``validate``'s checks and memory
  estimate (``preflight.run_checks``), ``setup_rank``, the trainer's ``train`` loop over
  ``step_batches`` (packed rows of ``seq_len`` tokens, one row per micro-batch);
- ``hf`` / ``liger``: ``LlamaForCausalLM.from_pretrained`` (sdpa) straight onto the device +
  ``peft.get_peft_model`` (adapters in fp32, peft's default), bf16 autocast, a plain loop with the
  same AdamW, schedule and clipping, over the micro-batches the parent wrote (``batches``), padded
  to the longest sample (``DataCollatorForSeq2Seq``) or flattened without padding
  (``DataCollatorWithFlattening``: position ids restart per sample, transformers masks across
  them); ``liger`` first applies ``liger_kernel``'s Llama kernels (RoPE, RMSNorm, SwiGLU, fused
  linear cross entropy).

The heavy imports happen inside each runner: a process imports only what its configuration uses
(the HF processes never import nxd-finetune, so nothing of ours can change their torch settings).

Every training configuration runs ``warmup_steps`` untimed optimizer steps, then ``timed_steps``
timed ones; the device is synchronised at every step boundary. Tokens are the non-padding tokens
of the timed steps' samples; ``lengths`` lists those samples' lengths (for the FLOP count).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import LORA, SEED, TRAIN  # noqa: E402
from bench.worker import _peak_rss_mb, worker_main  # noqa: E402

GiB = 2**30


class Clock:
    """Step boundaries: ``mark()`` after synchronising the device; ``tokens`` / ``targets`` /
    ``lengths`` per step."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.marks: list[float] = []
        self.tokens: list[int] = []
        self.targets: list[int] = []
        self.lengths: list[list[int]] = []
        self.slots: list[int] = []  # token positions computed (padding included)

    def mark(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
        self.marks.append(time.perf_counter())

    def timing(self, warmup: int) -> dict[str, Any]:
        """The steps after ``warmup``: ``marks[k]`` is the end of step ``k`` (``marks[0]`` the
        start of the first)."""
        steps = [b - a for a, b in zip(self.marks[warmup:-1], self.marks[warmup + 1:], strict=True)]
        return {"steps": len(steps), "tokens": sum(self.tokens[warmup:]), "targets": sum(self.targets[warmup:]),
                "slots": sum(self.slots[warmup:]),
                "time_s": self.marks[-1] - self.marks[warmup], "step_s": steps,
                "step_s_median": sorted(steps)[len(steps) // 2], "tokens_per_step": self.tokens,
                "lengths": [n for step in self.lengths[warmup:] for n in step],
                "warmup_s": self.marks[warmup] - self.marks[0]}


def memory(device: str) -> dict[str, Any]:
    """The process's peaks: the caching allocator's on CUDA (None elsewhere) and host RSS."""
    out: dict[str, Any] = {"peak_rss_mb": _peak_rss_mb(), "max_allocated_gib": None, "max_reserved_gib": None}
    if device == "cuda":
        import torch

        out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    return out


def device_info(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                            "cuda": torch.version.cuda, "device": device}
    for dist in ("peft", "liger-kernel", "triton"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=props.total_memory / GiB, capability=f"{props.major}.{props.minor}",
                    cudnn=torch.backends.cudnn.version())
        try:
            query = "--query-gpu=driver_version,name,memory.total,power.limit,clocks.max.sm"
            smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            info["nvidia_smi"] = f"unavailable: {e}"
    return info


def run_peak(spec: dict[str, Any]) -> dict[str, Any]:
    """Matmul peak: ``n``^3 products in ``dtype``, ``warmup`` untimed, mean over ``reps``."""
    import torch

    dev, n, reps = spec["device"], spec["n"], spec["reps"]
    dtype = getattr(torch, spec["dtype"])
    g = torch.Generator(dev).manual_seed(SEED)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    clock = Clock(dev)
    for _ in range(spec["warmup"]):
        a @ b
    clock.mark()
    for _ in range(reps):
        a @ b
    clock.mark()
    seconds = clock.marks[1] - clock.marks[0]
    return {"n": n, "dtype": spec["dtype"], "reps": reps, "seconds": seconds,
            "flops_per_s": 2 * n**3 * reps / seconds, "info": device_info(dev)}


def run_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    """A random-init checkpoint: norms 1, every other tensor N(0, 0.02) drawn on the device in
    bf16; one safetensors shard per decoder layer (+ one for the embedding, final norm, lm_head)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out, dev = Path(spec["model_dir"]), spec["device"]
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(**spec["config"])
    with torch.device("meta"):
        names = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        groups.setdefault(f"layer{int(parts[2]):03d}" if parts[1:2] == ["layers"] else "outer", []).append(name)
    g = torch.Generator(dev).manual_seed(SEED)
    weight_map: dict[str, str] = {}
    t0 = time.perf_counter()
    for i, (_, members) in enumerate(sorted(groups.items())):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in members:
            if name.endswith("norm.weight"):
                t = torch.ones(names[name], dtype=torch.bfloat16, device=dev)
            else:
                t = torch.randn(names[name], dtype=torch.bfloat16, device=dev, generator=g).mul_(0.02)
            tensors[name] = t.cpu()
            weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(spec["tokenizer"]).save_pretrained(out)
    (out / "bench_spec.json").write_text(json.dumps(spec["config"], sort_keys=True))
    return {"write_s": time.perf_counter() - t0, "tensors": len(names), "shards": len(groups)}


def recipe_dict(spec: dict[str, Any]) -> dict[str, Any]:
    """nxd-finetune's recipe of the ``ours`` configuration."""
    bf16 = spec["precision"] != "fp32"
    model: dict[str, Any] = {"path": spec["model_dir"], "dtype": "bf16" if bf16 else "fp32"}
    if spec.get("attention"):  # model.attention; unset: the recipe's default (auto)
        model["attention"] = spec["attention"]
    if spec.get("compile"):  # model.compile
        model["compile"] = True
    return {
        "model": model,
        "data": {"train": spec["data"], "format": "messages", "max_seq_len": spec["seq_len"], "packing": True,
                 "shuffle": True, "cache_dir": spec["cache_dir"]},
        "lora": dict(LORA),
        "training": {"micro_batch_size": 1, "grad_accum": spec["grad_accum"],
                     "max_steps": spec["warmup_steps"] + spec["timed_steps"], "seed": SEED,
                     "precision": spec["precision"], "device": spec["device"], **TRAIN},
        "eval": {"before": False},
        "logging": {"every_n_steps": 1, "progress": False},
        "output": {"dir": str(Path(spec["work"]) / "ours")},
    }


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from nxd_finetune.metrics import MetricsWriter
    from nxd_finetune.preflight import run_checks
    from nxd_finetune.preflight.report import report_json
    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft.setup import setup_rank
    from nxd_finetune.sft.step import step_batches
    from nxd_finetune.sft.trainer import TrainState, train

    recipe = recipe_from_dict(recipe_dict(spec))
    estimate = report_json(run_checks(recipe))  # what `nxd-finetune validate --json` prints
    t0 = time.perf_counter()
    rr = setup_rank(recipe, write_recipe=False)
    setup_s = time.perf_counter() - t0
    after_setup = torch.cuda.memory_allocated() / GiB if spec["device"] == "cuda" else None
    clock = Clock(spec["device"])

    def counted(steps: Iterable[tuple[list[dict[str, torch.Tensor]], int]]) -> Iterator[Any]:
        for step, n in steps:
            lengths = []
            for b in step:  # packed rows: each segment id > 0 is one sample
                for row in b["segment_ids"]:
                    lengths += torch.unique_consecutive(row[row > 0], return_counts=True)[1].tolist()
            clock.tokens.append(n)
            clock.targets.append(sum(int(rr.objective.count(b)) for b in step))
            clock.lengths.append(lengths)
            clock.slots.append(sum(int(b["input_ids"].numel()) for b in step))
            yield step, n

    def marked(steps: Iterable[Any]) -> Iterator[Any]:
        for item in steps:
            clock.mark()  # the previous step has ended (synchronised) when the next one is drawn
            yield item

    steps = marked(rr.runtime.batches(counted(step_batches(rr.data.train, rr.grad_accum, recipe.data.packing))))
    metrics = MetricsWriter(Path(recipe.output.dir), tensorboard=False, enabled=False)
    records = train(rr.engine, steps, rr.total_steps, recipe, metrics, None, TrainState(), False, runtime=rr.runtime)
    clock.mark()
    return {**clock.timing(spec["warmup_steps"]), **memory(spec["device"]), "setup_s": setup_s,
            "allocated_after_setup_gib": after_setup, "losses": [r["train_loss"] for r in records],
            "validate": estimate, "warmup_steps": spec["warmup_steps"],
            "attention": f"model.attention={spec.get('attention') or 'auto (default)'}"
                         + (", model.compile=true" if spec.get("compile") else "")}


def _liger(spec: dict[str, Any]) -> str | None:
    """Apply liger-kernel's Llama kernels (class-level, before the model is built); the reason when
    it cannot run here."""
    if spec["device"] != "cuda":
        return "liger-kernel's Triton kernels need a GPU"
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as e:
        return f"liger-kernel does not import: {e}"
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    return None


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        LlamaForCausalLM,
        get_cosine_schedule_with_warmup,
    )

    dev, model_dir = spec["device"], spec["model_dir"]
    if spec["framework"] == "liger":
        skipped = _liger(spec)
        if skipped:
            return {"skipped": skipped}
    torch.manual_seed(SEED)
    bf16 = spec["precision"] != "fp32"
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32,
                                             device_map=dev, attn_implementation="sdpa")
    lcfg = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg)
    setup_s = time.perf_counter() - t0
    after_setup = torch.cuda.memory_allocated() / GiB if dev == "cuda" else None
    steps = json.loads(Path(spec["batches"]).read_text())["steps"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=TRAIN["lr"], betas=tuple(TRAIN["betas"]), eps=TRAIN["eps"],
                                  weight_decay=TRAIN["weight_decay"])
    scheduler = get_cosine_schedule_with_warmup(optimizer, TRAIN["warmup_steps"], len(steps))
    if spec["packing"]:
        collator = DataCollatorWithFlattening(separator_id=-100, return_tensors="pt")
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100, return_tensors="pt")
    model.train()
    clock, losses = Clock(dev), []
    clock.mark()
    for step in steps:
        batches = [{k: v.to(dev, non_blocking=True) for k, v in collator(mb).items()} for mb in step]
        n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        clock.tokens.append(sum(len(s["input_ids"]) for mb in step for s in mb))
        clock.targets.append(n_items)
        clock.lengths.append([len(s["input_ids"]) for mb in step for s in mb])
        clock.slots.append(sum(int(b["input_ids"].numel()) for b in batches))
        total = torch.zeros((), device=dev)
        for b in batches:
            with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=bf16):
                # use_cache=False: with a cache transformers skips the packed-sequence detection
                out = model(**b, use_cache=False, num_items_in_batch=torch.tensor(max(n_items, 1), device=dev))
            out.loss.backward()
            total += out.loss.detach()
            del out
        torch.nn.utils.clip_grad_norm_(trainable, TRAIN["grad_clip"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        clock.mark()
    return {**clock.timing(spec["warmup_steps"]), **memory(dev), "setup_s": setup_s,
            "allocated_after_setup_gib": after_setup, "losses": [float(x) for x in losses],
            "attention": model.config._attn_implementation}


def run_guarded(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's runner; a CUDA out-of-memory error becomes the result ``{"oom": ...}``."""
    import torch

    runners = {"peak": run_peak, "checkpoint": run_checkpoint, "ours": run_ours, "hf": run_hf, "liger": run_hf}
    try:
        return runners[spec["framework"]](spec)
    except torch.cuda.OutOfMemoryError as e:
        return {"oom": str(e).splitlines()[0], **memory(spec["device"])}


if __name__ == "__main__":
    worker_main({name: run_guarded for name in ("peak", "checkpoint", "ours", "hf", "liger")})

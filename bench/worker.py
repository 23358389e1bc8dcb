"""One benchmark configuration, in its own process (so its peak RSS is its own).

    python bench/worker.py '<json spec>'      # prints one JSON result line: RESULT {...}

``spec``: ``framework`` (``ours`` | ``ours-compile``, ours with ``model.compile`` | ``hf``), ``shape``,
``packing`` (ours: best-fit rows of ``max_seq_len`` tokens; hf: ``DataCollatorWithFlattening``,
HF's padding-free packing of each micro-batch), ``micro_batch_size``, ``grad_accum``,
``warmup_steps``, ``max_samples``, ``threads`` (``torch.set_num_threads``; None leaves torch's
default), ``batches`` (hf: path of the JSON the parent wrote, holding the warmup and timed
optimizer steps as lists of micro-batches of samples).

Both loops run ``warmup_steps`` optimizer steps (not timed), then one timed pass over the whole
training set (epoch 0 again, from its start), so both frameworks time exactly the same samples.
The timed pass records wall time and this process's CPU time (user + system, all threads).

- ours: the trainer's own loop, ``sft.trainer.train`` over ``sft.engine.build_engine`` (the engine
  every ``nxd-finetune run`` uses: loss at target positions only, ParallelOptimizer with AdamW and
  clipping, LR schedule), fed by ``build_dataloaders`` and the trainer's ``step_batches``.
- hf: ``LlamaForCausalLM.from_pretrained`` (sdpa attention) + ``peft.get_peft_model``, micro-batches
  padded to the longest sample by ``DataCollatorForSeq2Seq`` (what HF users do) or flattened by
  ``DataCollatorWithFlattening``; loss normalised by the step's target tokens
  (``num_items_in_batch``, as HF's Trainer does); the same clipping, AdamW and schedule; a plain loop.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CACHE, LORA, SEED, TRAIN, recipe_dict  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepClock:
    """Wraps an iterator of optimizer steps ``(micro_batches, n_input_tokens)``; records when each
    step was handed out (wall and process CPU time), its non-padding tokens and its token slots
    (padding included)."""

    def __init__(self, steps: Any) -> None:
        self.steps, self.times, self.cpu0, self.tokens, self.slots = steps, [], None, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.steps)
        self.times.append(time.perf_counter())
        if self.cpu0 is None:
            self.cpu0 = time.process_time()
        self.tokens += item[1]
        self.slots += sum(int(b["input_ids"].numel()) for b in item[0])
        return item


def _timing(clock: StepClock) -> dict[str, Any]:
    t_end, cpu_end = time.perf_counter(), time.process_time()
    times = clock.times + [t_end]
    steps = sorted(b - a for a, b in zip(times[:-1], times[1:], strict=True))
    return {"steps": len(steps), "tokens": clock.tokens, "slots": clock.slots, "time_s": t_end - clock.times[0],
            "cpu_s": cpu_end - clock.cpu0, "step_s_mean": sum(steps) / len(steps),
            "step_s_median": steps[len(steps) // 2]}


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from nxd_finetune.data.inputs import load_tokenizer
    from nxd_finetune.data.loader import build_dataloaders
    from nxd_finetune.metrics import MetricsWriter
    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft.engine import build_engine
    from nxd_finetune.sft.step import step_batches
    from nxd_finetune.sft.trainer import TrainState, train

    rss_imports = _rss_mb()
    raw = recipe_dict(spec["shape"], spec["packing"], spec["micro_batch_size"], spec["grad_accum"],
                      spec["max_samples"])
    raw["model"]["compile"] = spec["framework"] == "ours-compile"
    recipe = recipe_from_dict(raw)
    torch.set_flush_denormal(True)  # as trainer.run_rank() does on CPU
    device = torch.device("cpu")
    model_dir = Path(recipe.model.path)
    tokenizer = load_tokenizer(recipe, model_dir)
    data = build_dataloaders(recipe.data, tokenizer, micro_batch_size=recipe.training.micro_batch_size,
                             seed=SEED, fixed_shape=False)
    ga, warmup = recipe.grad_accum_steps, spec["warmup_steps"]
    epoch_steps = data.train.batches_per_epoch // ga
    engine = build_engine(recipe, model_dir, device, warmup + epoch_steps)
    metrics = MetricsWriter(CACHE / "outputs", tensorboard=False, enabled=False)
    rss_model = _rss_mb()
    start = data.train.state_dict()
    state = TrainState()

    def loop(steps: Any, until: int) -> list[dict[str, Any]]:
        return train(engine, steps, until, recipe, metrics, None, state, False)

    first = loop(step_batches(data.train, ga, recipe.data.packing), 1)  # step 1: loss check
    loop(step_batches(data.train, ga, recipe.data.packing), warmup)
    data.train.load_state_dict(start)  # the timed pass is epoch 0 from its start
    clock = StepClock(step_batches(data.train, ga, recipe.data.packing))
    last = loop(clock, warmup + epoch_steps)
    return {**_timing(clock), "first_loss": first[-1]["train_loss"], "last_loss": last[-1]["train_loss"],
            "rss_after_imports_mb": rss_imports, "rss_after_model_mb": rss_model,
            "rows_per_epoch": len(data.train.batch_of.rows)}


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

    rss_imports = _rss_mb()
    torch.set_flush_denormal(True)
    torch.manual_seed(SEED)
    model_dir = CACHE / "models" / spec["shape"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lcfg = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg)
    steps = json.loads(Path(spec["batches"]).read_text())
    warmup, timed = steps["warmup"], steps["timed"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=TRAIN["lr"], betas=tuple(TRAIN["betas"]), eps=TRAIN["eps"],
                                  weight_decay=TRAIN["weight_decay"])
    scheduler = get_cosine_schedule_with_warmup(optimizer, TRAIN["warmup_steps"], len(warmup) + len(timed))
    if spec["packing"]:
        collator = DataCollatorWithFlattening(separator_id=-100, return_tensors="pt")
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100, return_tensors="pt")
    rss_model = _rss_mb()
    model.train()
    losses: list[torch.Tensor] = []

    def one_step(batches: list[dict[str, torch.Tensor]]) -> None:
        n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        loss_sum = torch.zeros(())
        for b in batches:
            # use_cache=False: training needs no KV cache, and with one HF skips the packed-sequence
            # detection, so flattened samples would attend across their boundaries
            out = model(**b, use_cache=False, num_items_in_batch=torch.tensor(max(n_items, 1)))
            out.loss.backward()
            loss_sum += out.loss.detach()
        torch.nn.utils.clip_grad_norm_(trainable, TRAIN["grad_clip"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)

    for step in warmup:
        one_step([collator(mb) for mb in step])
    first_loss = float(losses[0])

    def token_steps():  # collating is part of the timed loop, as our loader's is
        for step in timed:
            yield [collator(mb) for mb in step], sum(len(s["input_ids"]) for mb in step for s in mb)

    clock = StepClock(token_steps())
    for batches, _ in clock:
        one_step(batches)
    return {**_timing(clock), "first_loss": first_loss, "last_loss": float(losses[-1]),
            "rss_after_imports_mb": rss_imports, "rss_after_model_mb": rss_model,
            "attn_implementation": model.config._attn_implementation}


def worker_main(runners: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """A worker process: the spec from argv, ``runners[spec["framework"]]`` on it, one ``RESULT``
    line (with the spec, this process's peak RSS, wall time and torch threads)."""
    spec = json.loads(sys.argv[1])
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    result = runners[spec["framework"]](spec)
    result.update(spec=spec, peak_rss_mb=_peak_rss_mb(), wall_s=time.perf_counter() - t0,
                  threads=torch.get_num_threads())
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    worker_main({"ours": run_ours, "ours-compile": run_ours, "hf": run_hf})

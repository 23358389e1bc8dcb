"""One benchmark configuration, in its own process (so its peak RSS is its own).

    python bench/worker.py '<json spec>'      # prints one JSON result line

``spec``: ``framework`` (``ours`` | ``hf``), ``shape``, ``packing`` (ours only), ``micro_batch_size``,
``grad_accum``, ``warmup_steps``, ``max_samples``, ``batches`` (hf: path of the JSON the parent wrote,
holding the warmup and timed optimizer steps as lists of micro-batches of samples), ``flush_denormal``.

Both loops run ``warmup_steps`` optimizer steps (not timed), then one timed pass over the whole
training set (epoch 0 again, from its start), so both frameworks time exactly the same samples.

- ours: the trainer's own ``train()`` loop (``micro_step``: forward, ``causal_lm_loss`` sum / target
  tokens of the step, backward; grad clip; AdamW; LR schedule), fed by ``build_dataloaders`` and
  the model from ``build_training_model``, optimizer from ``build_optimizer``.
- hf: ``LlamaForCausalLM.from_pretrained`` + ``peft.get_peft_model``, batches padded to the longest
  sample by ``DataCollatorForSeq2Seq`` (what HF users do), loss normalised by the step's target
  tokens (``num_items_in_batch``, as HF's Trainer does), the same clipping, AdamW and schedule.
"""

from __future__ import annotations

import json
import resource
import sys
import time
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
    step was handed out and how many non-padding tokens it held."""

    def __init__(self, steps: Any) -> None:
        self.steps, self.times, self.tokens = steps, [], 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.steps)
        self.times.append(time.perf_counter())
        self.tokens += item[1]
        return item


def _timing(clock: StepClock, t_end: float) -> dict[str, Any]:
    times = clock.times + [t_end]
    steps = [b - a for a, b in zip(times[:-1], times[1:], strict=True)]
    steps_sorted = sorted(steps)
    return {"steps": len(steps), "tokens": clock.tokens, "time_s": t_end - clock.times[0],
            "step_s_mean": sum(steps) / len(steps), "step_s_median": steps_sorted[len(steps) // 2]}


def _propose_target_logits_micro_step() -> None:
    """The proposed trainer change, applied for this process only: ``micro_step`` computes the loss
    with ``causal_lm_loss_at_targets`` (logits at target positions only) instead of full logits +
    ``causal_lm_loss``. Same loss; sft/trainer.py is owned elsewhere, so the bench shows the gain."""
    from nxd_finetune.sft import trainer
    from nxd_finetune.sft.loss import causal_lm_loss_at_targets

    def micro_step(model, batch, n_targets, device, precision):
        with trainer._autocast(device, precision):
            loss = causal_lm_loss_at_targets(model, batch, reduction="sum") / n_targets
        loss.backward()
        return loss.detach()

    trainer.micro_step = micro_step


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft.build import build_optimizer, build_training_model, load_tokenizer
    from nxd_finetune.sft.loader import build_dataloaders
    from nxd_finetune.sft.metrics import MetricsWriter
    from nxd_finetune.sft.trainer import TrainState, _step_batches, train

    rss_imports = _rss_mb()
    if spec.get("target_logits"):
        _propose_target_logits_micro_step()
    recipe = recipe_from_dict(recipe_dict(spec["shape"], spec["packing"], spec["micro_batch_size"],
                                          spec["grad_accum"], spec["max_samples"]))
    if spec["flush_denormal"]:
        torch.set_flush_denormal(True)  # as trainer.run() does on CPU
    torch.manual_seed(SEED)
    device = torch.device("cpu")
    model_dir = Path(recipe.model.path)
    tokenizer = load_tokenizer(recipe, model_dir)
    model = build_training_model(recipe, model_dir, device).model
    data = build_dataloaders(recipe.data, tokenizer, micro_batch_size=recipe.training.micro_batch_size,
                             seed=SEED, fixed_shape=False)
    ga, warmup = recipe.grad_accum_steps, spec["warmup_steps"]
    epoch_steps = data.train.batches_per_epoch // ga
    optimizer, scheduler = build_optimizer(model, recipe, warmup + epoch_steps)
    metrics = MetricsWriter(CACHE / "outputs", tensorboard=False, enabled=False)
    rss_model = _rss_mb()
    start = data.train.state_dict()
    state = TrainState()

    def loop(steps: Any, until: int) -> list[dict[str, Any]]:
        return train(model, optimizer, scheduler, steps, until, recipe, device, metrics, None, state, False)

    first = loop(_step_batches(data.train, ga, recipe.data.packing), 1)  # step 1: loss check
    loop(_step_batches(data.train, ga, recipe.data.packing), warmup)
    data.train.load_state_dict(start)  # the timed pass is epoch 0 from its start
    clock = StepClock(_step_batches(data.train, ga, recipe.data.packing))
    last = loop(clock, warmup + epoch_steps)
    result = _timing(clock, time.perf_counter())
    return {**result, "first_loss": first[-1]["train_loss"], "last_loss": last[-1]["train_loss"],
            "rss_after_imports_mb": rss_imports, "rss_after_model_mb": rss_model,
            "rows_per_epoch": len(data.train.rows)}


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, LlamaForCausalLM, get_cosine_schedule_with_warmup

    rss_imports = _rss_mb()
    if spec["flush_denormal"]:
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
    collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100, return_tensors="pt")
    rss_model = _rss_mb()
    model.train()
    losses: list[float] = []

    def one_step(micro_batches: list[list[dict[str, list[int]]]]) -> None:
        batches = [collator(mb) for mb in micro_batches]
        n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        loss_sum = 0.0
        for b in batches:
            out = model(**b, num_items_in_batch=torch.tensor(max(n_items, 1)))
            out.loss.backward()
            loss_sum += out.loss.detach()
        torch.nn.utils.clip_grad_norm_(trainable, TRAIN["grad_clip"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_sum)

    for step in warmup:
        one_step(step)
    first_loss = float(losses[0])

    def token_steps():
        for step in timed:
            yield step, sum(len(s["input_ids"]) for mb in step for s in mb)

    clock = StepClock(token_steps())
    for step, _ in clock:
        one_step(step)
    result = _timing(clock, time.perf_counter())
    return {**result, "first_loss": first_loss, "last_loss": float(losses[-1]),
            "rss_after_imports_mb": rss_imports, "rss_after_model_mb": rss_model,
            "attn_implementation": model.config._attn_implementation}


def main() -> None:
    spec = json.loads(sys.argv[1])
    import torch

    t0 = time.perf_counter()
    result = run_ours(spec) if spec["framework"] == "ours" else run_hf(spec)
    result.update(spec=spec, peak_rss_mb=_peak_rss_mb(), wall_s=time.perf_counter() - t0,
                  threads=torch.get_num_threads())
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()

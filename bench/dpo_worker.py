"""One DPO benchmark configuration, in its own process (so its peak RSS is its own).

    python bench/dpo_worker.py '<json spec>'      # prints one JSON result line: RESULT {...}

``spec``: ``framework`` (``ours`` | ``trl``), ``shape``, ``data`` (the preference jsonl),
``pairs`` (the first pairs used), ``pairs_per_step``, ``warmup_steps``, ``threads``,
``work`` (a fresh directory for this run's outputs and data cache).

Both sides train LoRA r16 on every linear with DPO (sigmoid, beta 0.1), the reference being the base
model (adapter off), its log-probs computed in one pass before training; the pairs in file order,
``pairs_per_step`` pairs per optimizer step (one micro-batch, chosen and rejected rows padded to the
longest), AdamW / cosine / clipping as the LoRA bench. ``warmup_steps`` steps are not timed.

- ours: what ``nxd-finetune run`` executes (``setup_rank``, ``attach_reference``, the trainer's
  ``train`` loop over ``step_batches``), the data cache in a fresh directory, so the tokenization and
  the reference pass happen in every run.
- trl: ``DPOTrainer`` (``precompute_ref_log_probs=True``, ``peft_config``, sdpa attention,
  ``gradient_checkpointing=False`` as ours; TRL's DPO default is True), a sequential sampler.

Tokens: the non-padding tokens of the chosen and rejected rows of the timed steps (ours: the row up
to its last target token; TRL: its attention mask).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CACHE, LORA, MAX_SEQ_LEN, SEED, TRAIN  # noqa: E402
from bench.worker import _rss_mb, worker_main  # noqa: E402

BETA = 0.1


class Clock:
    """Wall and process CPU time at each optimizer step's end; tokens of each step."""

    def __init__(self) -> None:
        self.ends: list[tuple[float, float]] = []
        self.tokens: list[int] = []

    def mark(self) -> None:
        self.ends.append((time.perf_counter(), time.process_time()))

    def timing(self, warmup: int) -> dict[str, Any]:
        """The steps after ``warmup``: from the end of the last warmup step to the end of the last."""
        (w0, c0), (w1, c1) = self.ends[warmup - 1], self.ends[-1]
        steps = sorted(b[0] - a[0] for a, b in zip(self.ends[warmup - 1:-1], self.ends[warmup:], strict=True))
        return {"steps": len(steps), "tokens": sum(self.tokens[warmup:]), "time_s": w1 - w0, "cpu_s": c1 - c0,
                "step_s_median": steps[len(steps) // 2], "step_s_mean": sum(steps) / len(steps),
                "tokens_per_step": self.tokens}


def recipe_dict(spec: dict[str, Any]) -> dict[str, Any]:
    work = Path(spec["work"])
    steps = spec["pairs"] // spec["pairs_per_step"]
    return {
        "model": {"path": str(CACHE / "models" / spec["shape"]), "dtype": "fp32"},
        "data": {"train": spec["data"], "format": "preference", "max_seq_len": MAX_SEQ_LEN, "packing": False,
                 "shuffle": False, "cache_dir": str(work / "data"), "max_samples": spec["pairs"]},
        "objective": "dpo", "preference": {"beta": BETA},
        "lora": dict(LORA),
        "training": {"micro_batch_size": spec["pairs_per_step"], "grad_accum": 1, "max_steps": steps,
                     "seed": SEED, "precision": "fp32", "device": "cpu", **TRAIN},
        "eval": {"before": False},
        "logging": {"every_n_steps": 1, "progress": False},
        "output": {"dir": str(work / "ours")},
    }


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from nxd_finetune.metrics import MetricsWriter
    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft.reference import attach_reference
    from nxd_finetune.sft.setup import setup_rank
    from nxd_finetune.sft.step import step_batches
    from nxd_finetune.sft.trainer import TrainState, train

    rss_imports = _rss_mb()
    torch.set_flush_denormal(True)  # as trainer.run_rank() does on CPU
    recipe = recipe_from_dict(recipe_dict(spec))
    t0 = time.perf_counter()
    rr = setup_rank(recipe)
    t_setup = time.perf_counter()
    reference = attach_reference(recipe, rr.engine, rr.data, rr.model_dir)
    t_ref = time.perf_counter()
    rss_ref = _rss_mb()
    clock = Clock()

    def counted() -> Any:
        for step, n in step_batches(rr.data.train, rr.grad_accum, recipe.data.packing):
            if clock.tokens:  # the previous step has ended when the next one is drawn
                clock.mark()
            labels = [b["labels"] for b in step]
            # a row's non-padding tokens: up to its last target token (completions end the rows)
            tokens = sum(int(((lab != -100) * torch.arange(1, lab.shape[1] + 1)).amax(1).sum()) for lab in labels)
            clock.tokens.append(tokens)
            yield step, n

    metrics = MetricsWriter(Path(recipe.output.dir), tensorboard=False, enabled=False)
    records = train(rr.engine, counted(), rr.total_steps, recipe, metrics, None, TrainState(), False)
    clock.mark()
    return {**clock.timing(spec["warmup_steps"]), "reference": reference, "setup_s": t_setup - t0,
            "reference_pass_s": t_ref - t_setup, "first_loss": records[0]["train_loss"],
            "last_loss": records[-1]["train_loss"], "rss_after_imports_mb": rss_imports,
            "rss_after_reference_mb": rss_ref}


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    rss_imports = _rss_mb()
    torch.set_flush_denormal(True)
    model_dir = CACHE / "models" / spec["shape"]
    rows = [json.loads(ln) for ln in Path(spec["data"]).read_text().splitlines()[: spec["pairs"]]]
    clock = Clock()
    steps = spec["pairs"] // spec["pairs_per_step"]
    args = DPOConfig(
        output_dir=str(Path(spec["work"]) / "trl"), per_device_train_batch_size=spec["pairs_per_step"],
        gradient_accumulation_steps=1, learning_rate=TRAIN["lr"], adam_beta1=TRAIN["betas"][0],
        adam_beta2=TRAIN["betas"][1], adam_epsilon=TRAIN["eps"], weight_decay=TRAIN["weight_decay"],
        max_grad_norm=TRAIN["grad_clip"], lr_scheduler_type="cosine", warmup_steps=TRAIN["warmup_steps"],
        max_steps=steps, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", bf16=False, fp16=False,
        seed=SEED, beta=BETA, loss_type=["sigmoid"], max_length=MAX_SEQ_LEN, precompute_ref_log_probs=True,
        gradient_checkpointing=False, disable_dropout=True, dataloader_num_workers=0)
    lcfg = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
    losses: list[float] = []

    class Timed(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.mark()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kw: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, train_dataset: Any = None) -> SequentialSampler:
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def training_step(self, model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            clock.tokens.append(int(inputs["attention_mask"].sum()))
            return super().training_step(model, inputs, *a, **kw)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    t_setup = time.perf_counter()
    # tokenization and the reference pass run in the constructor (precompute_ref_log_probs)
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                      peft_config=lcfg, callbacks=[Timed()])
    t_ref = time.perf_counter()
    rss_ref = _rss_mb()
    trainer.train()
    return {**clock.timing(spec["warmup_steps"]), "setup_s": t_setup - t0, "reference_pass_s": t_ref - t_setup,
            "first_loss": losses[0], "last_loss": losses[-1], "rss_after_imports_mb": rss_imports,
            "rss_after_reference_mb": rss_ref, "attn_implementation": trainer.model.config._attn_implementation}


if __name__ == "__main__":
    worker_main({"ours": run_ours, "trl": run_trl})

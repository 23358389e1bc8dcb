"""The LoRA bench's TRL column: ``SFTTrainer`` + peft, in its own process (so its peak RSS is its own).

    python bench/trl_sft_worker.py '<json spec>'      # prints one JSON result line: RESULT {...}

``spec`` as for bench/worker.py (``framework`` ``trl``, ``shape``, ``micro_batch_size`` packed rows,
``grad_accum``, ``warmup_steps``, ``max_samples``, ``threads``).

What most users would run instead of nxd-finetune: ``SFTTrainer`` on the bench's messages data
(the first ``max_samples`` rows of bench/data/sft.jsonl, as the other columns), with

- ``packing=True`` (TRL's default strategy ``bfd``: best-fit decreasing rows of ``max_length`` = 512
  tokens, which turns on ``padding_free``: each micro-batch is one flattened row with position ids,
  no attention mask, no padding; transformers' sdpa attention then masks across samples from the
  position ids);
- ``assistant_only_loss=True``: TRL masks everything but the assistant turns with the chat
  template's ``{% generation %}`` markers. The bench tokenizer's template has none, and TRL's
  ``get_training_chat_template`` only knows released templates, so the worker marks the assistant
  content and its eos (:func:`training_template`): the same spans nxd-finetune trains (the input ids
  and labels of every sample were checked equal to ours when this column was added);
- the same LoRA (r16, alpha 32, every linear), AdamW, cosine schedule, clipping 1.0, fp32, no
  activation checkpointing (TRL's default is on; ours is off), sdpa attention; TRL's own sampler
  (seeded random), loss and metrics (its chunked log-prob head, entropy and token accuracy).

Timed: the optimizer steps after ``warmup_steps``, as many as one epoch of TRL's packed rows has
(from the end of the last warm-up step to the end of the last step; the pass may wrap into the next
epoch by the warm-up's rows). Tokens: the input tokens of those steps' micro-batches, i.e. every
token of the samples they hold (prompts included); a padding-free row has no padding
(``pad_to_multiple_of=None``), so tokens = slots.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CACHE, DATA, LORA, MAX_SEQ_LEN, SEED, TRAIN  # noqa: E402
from bench.dpo_worker import Clock  # noqa: E402
from bench.worker import _rss_mb, worker_main  # noqa: E402

ASSISTANT_TURN = "{{ message['content'] }}{{ eos_token }}"


def training_template(template: str) -> str:
    """The bench tokenizer's chat template with ``{% generation %}`` around each assistant turn's
    content and eos (the span nxd-finetune trains: after ``<|assistant|>\\n``, through the eos)."""
    if template.count(ASSISTANT_TURN) != 1:
        raise SystemExit(f"unexpected chat template (no single {ASSISTANT_TURN!r}): {template!r}")
    return template.replace(ASSISTANT_TURN, "{% generation %}" + ASSISTANT_TURN + "{% endgeneration %}")


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rss_imports = _rss_mb()
    torch.set_flush_denormal(True)
    model_dir = CACHE / "models" / spec["shape"]
    rows = [json.loads(ln) for ln in DATA.read_text().splitlines()[: spec["max_samples"]]]
    clock, losses = Clock(), []
    pending = {"tokens": 0, "slots": 0}
    slots: list[int] = []

    class Timed(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.mark()
            clock.tokens.append(pending["tokens"])
            slots.append(pending["slots"])
            pending.update(tokens=0, slots=0)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kw: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class Counted(SFTTrainer):
        def training_step(self, model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
            n = int(inputs["input_ids"].numel())
            mask = inputs.get("attention_mask")  # absent when padding-free
            pending["tokens"] += n if mask is None else int(mask.sum())
            pending["slots"] += n
            return super().training_step(model, inputs, *a, **kw)

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = training_template(tokenizer.chat_template)
    lcfg = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
    mbs, ga, warmup = spec["micro_batch_size"], spec["grad_accum"], spec["warmup_steps"]
    with tempfile.TemporaryDirectory(dir=CACHE) as work:
        args = SFTConfig(
            output_dir=str(Path(work) / "trl"), per_device_train_batch_size=mbs, gradient_accumulation_steps=ga,
            learning_rate=TRAIN["lr"], adam_beta1=TRAIN["betas"][0], adam_beta2=TRAIN["betas"][1],
            adam_epsilon=TRAIN["eps"], weight_decay=TRAIN["weight_decay"], max_grad_norm=TRAIN["grad_clip"],
            lr_scheduler_type="cosine", warmup_steps=TRAIN["warmup_steps"], max_steps=1, logging_steps=1,
            report_to=[], use_cpu=True, save_strategy="no", bf16=False, fp16=False, seed=SEED,
            max_length=MAX_SEQ_LEN, packing=True, assistant_only_loss=True, pad_to_multiple_of=None,
            activation_checkpointing=False, dataloader_num_workers=0, disable_tqdm=True)
        # tokenizing and packing run in the constructor (not timed; in the peak RSS)
        trainer = Counted(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          peft_config=lcfg, callbacks=[Timed()])
        epoch_steps = len(trainer.train_dataset) // (mbs * ga)
        trainer.args.max_steps = warmup + epoch_steps
        t_setup = time.perf_counter()
        rss_model = _rss_mb()
        trainer.train()
    timing = clock.timing(warmup)
    timing.pop("tokens_per_step")
    return {**timing, "slots": sum(slots[warmup:]), "setup_s": t_setup - t0, "first_loss": losses[0],
            "last_loss": losses[-1], "rss_after_imports_mb": rss_imports, "rss_after_model_mb": rss_model,
            "rows_per_epoch": len(trainer.train_dataset),
            "attn_implementation": trainer.model.config._attn_implementation}


if __name__ == "__main__":
    worker_main({"trl": run_trl})

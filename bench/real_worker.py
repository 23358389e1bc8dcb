"""One configuration of the real-model bench (bench/bench_real.py), in its own process (its peak
RSS is its own).

    python bench/real_worker.py '<json spec>'      # prints one JSON result line: RESULT {...}

``spec``: ``framework`` (``ours-sft`` | ``trl-sft`` | ``ours-dpo`` | ``trl-dpo``), ``model_dir``
(builtin:smollm2-135m-instruct converted), ``sft_data`` / ``dpo_data`` (jsonl), ``steps``,
``rows_per_step`` (SFT: packed rows of ``max_seq_len`` tokens), ``pairs_per_step`` (DPO),
``max_seq_len``, ``lr``, ``beta``, ``warmup_steps`` (not timed), ``threads``, ``work`` (a fresh
directory: outputs, data cache). The adapter is saved under ``<work>/adapter`` (PEFT format) for
the parent to score.

- ours: ``nxd_finetune.sft.trainer.run`` (what ``nxd-finetune run`` executes: tokenizing into a
  fresh cache, the steps, export), its steps timed through a batch source that wraps the loader's;
  DPO's reference log-probs are computed at the step that uses each pair (the reference: the base
  model, adapter off), so their cost is inside the timed steps, as TRL's default is.
- trl-sft: ``SFTTrainer`` + peft, ``packing=True`` (padding-free rows of ``max_seq_len``),
  ``assistant_only_loss=True`` with SmolLM2's chat template marked with ``{% generation %}``
  around each assistant turn's content and ``<|im_end|>`` (:func:`training_template`; the text it
  renders is the original template's, checked), no activation checkpointing.
- trl-dpo: ``DPOTrainer`` + peft with TRL's defaults for the reference (the adapter disabled, its
  log-probs computed in each training step: ``precompute_ref_log_probs=False``), no gradient
  checkpointing, pairs in file order.

Both sides: LoRA r16 alpha 32 on every linear, fp32, AdamW, cosine schedule, 1 warm-up step of
the LR schedule, clipping 1.0. ``e2e_s``: from the runner's start (model load) to the saved adapter.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.dpo_worker import Clock  # noqa: E402
from bench.worker import _rss_mb, worker_main  # noqa: E402

LORA: dict[str, Any] = dict(rank=16, alpha=32, dropout=0.0, target_modules="all-linear")
TRAIN: dict[str, Any] = dict(betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, grad_clip=1.0, warmup_steps=1,
                             scheduler="cosine", min_lr_ratio=0.0)
SEED = 0
TURN = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
MARKED = ("{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}"
          "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}" + TURN + "{% endif %}")


def training_template(template: str) -> str:
    """SmolLM2's chat template with ``{% generation %}`` around each assistant turn's content and
    ``<|im_end|>`` (the tokens nxd-finetune trains), for TRL's ``assistant_only_loss``."""
    if template.count(TURN) != 1:
        raise SystemExit(f"unexpected chat template (no single {TURN!r}): {template!r}")
    return template.replace(TURN, MARKED)


def recipe_dict(spec: dict[str, Any], dpo: bool) -> dict[str, Any]:
    work = Path(spec["work"])
    data = ({"train": spec["dpo_data"], "format": "preference", "packing": False} if dpo else
            {"train": spec["sft_data"], "format": "messages", "packing": True})
    return {
        "model": {"path": spec["model_dir"], "dtype": "fp32"},
        "data": {**data, "max_seq_len": spec["max_seq_len"], "shuffle": False, "cache_dir": str(work / "data")},
        **({"objective": "dpo", "preference": {"beta": spec["beta"]}} if dpo else {}),
        "lora": dict(LORA),
        "training": {"micro_batch_size": spec["pairs_per_step" if dpo else "rows_per_step"], "grad_accum": 1,
                     "max_steps": spec["steps"], "lr": spec["lr"], "seed": SEED, "precision": "fp32",
                     "device": "cpu", **TRAIN},
        "eval": {"before": False},
        "checkpoint": {"every_n_steps": None, "save_mode": "adapter"},
        "logging": {"every_n_steps": 1, "progress": False},
        "output": {"dir": str(work / "ours")},
    }


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    import shutil

    from nxd_finetune.recipe import recipe_from_dict
    from nxd_finetune.sft import trainer
    from nxd_finetune.sft.setup import RankRun, loader_source
    from nxd_finetune.sft.source import BatchSource
    from nxd_finetune.sft.step import StepItem

    rss_imports = _rss_mb()
    clock = Clock()

    class Timed:
        """The loader's steps, each one's start marked (the previous one's end) and its tokens counted."""

        def __init__(self, inner: BatchSource) -> None:
            self.inner = inner

        def next_step(self, engine: Any, step: int) -> StepItem:
            clock.mark()
            item = self.inner.next_step(engine, step)
            clock.tokens.append(item[1])
            return item

        def state_dict(self) -> dict[str, object]:
            return self.inner.state_dict()

        def load_state_dict(self, state: dict[str, object]) -> None:
            self.inner.load_state_dict(state)

        def close(self) -> None:  # right after the loop (no checkpoint to finish here)
            clock.mark()
            self.inner.close()

    def source(rr: RankRun) -> Timed:
        return Timed(loader_source(rr))

    t0 = time.perf_counter()
    dpo = spec["framework"] == "ours-dpo"
    summary = trainer.run(recipe_from_dict(recipe_dict(spec, dpo)), source=source)
    assert summary is not None
    adapter = Path(spec["work"]) / "adapter"
    shutil.copytree(summary["output"], adapter)
    e2e = time.perf_counter() - t0
    clock.ends = clock.ends[1:]  # a mark at each step's start is the previous one's end; close() marks the last
    losses = [h["train_loss"] for h in summary["history"]]
    return {**clock.timing(spec["warmup_steps"]), "e2e_s": e2e, "first_step_s": summary["time_to_first_step_s"],
            "first_loss": losses[0], "last_loss": losses[-1], "rss_after_imports_mb": rss_imports,
            "adapter": str(adapter)}


def run_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    rss_imports = _rss_mb()
    torch.set_flush_denormal(True)
    dpo = spec["framework"] == "trl-dpo"
    work = Path(spec["work"])
    rows = [json.loads(ln) for ln in Path(spec["dpo_data" if dpo else "sft_data"]).read_text().splitlines()]
    clock, losses = Clock(), []
    pending = {"tokens": 0}

    class Timed(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            clock.mark()
            clock.tokens.append(pending["tokens"])
            pending["tokens"] = 0

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None,
                   **kw: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    def counted(base: type) -> type:
        class Counted(base):  # type: ignore[valid-type,misc]
            def training_step(self, model: Any, inputs: dict[str, Any], *a: Any, **kw: Any) -> Any:
                mask = inputs.get("attention_mask")  # absent when padding-free
                pending["tokens"] += int(inputs["input_ids"].numel()) if mask is None else int(mask.sum())
                return super().training_step(model, inputs, *a, **kw)

            def _get_train_sampler(self, train_dataset: Any = None) -> Any:
                from torch.utils.data import SequentialSampler

                return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)
        return Counted

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    lcfg = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")
    common = dict(output_dir=str(work / "trl"), gradient_accumulation_steps=1, learning_rate=spec["lr"],
                  adam_beta1=TRAIN["betas"][0], adam_beta2=TRAIN["betas"][1], adam_epsilon=TRAIN["eps"],
                  weight_decay=TRAIN["weight_decay"], max_grad_norm=TRAIN["grad_clip"], lr_scheduler_type="cosine",
                  warmup_steps=TRAIN["warmup_steps"], max_steps=spec["steps"], logging_steps=1, report_to=[],
                  use_cpu=True, save_strategy="no", bf16=False, fp16=False, seed=SEED,
                  max_length=spec["max_seq_len"], dataloader_num_workers=0, disable_tqdm=True)
    if dpo:
        from trl import DPOConfig, DPOTrainer

        args: Any = DPOConfig(per_device_train_batch_size=spec["pairs_per_step"], beta=spec["beta"],
                              loss_type=["sigmoid"], gradient_checkpointing=False, **common)
        trainer = counted(DPOTrainer)(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                      processing_class=tokenizer, peft_config=lcfg, callbacks=[Timed()])
    else:
        from trl import SFTConfig, SFTTrainer

        marked = training_template(tokenizer.chat_template)
        probe = rows[0]["messages"]
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        tokenizer.chat_template = marked
        if tokenizer.apply_chat_template(probe, tokenize=False) != plain:
            raise SystemExit("the marked chat template renders another text than SmolLM2's")
        args = SFTConfig(per_device_train_batch_size=spec["rows_per_step"], packing=True, assistant_only_loss=True,
                         pad_to_multiple_of=None, activation_checkpointing=False, **common)
        trainer = counted(SFTTrainer)(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                      processing_class=tokenizer, peft_config=lcfg, callbacks=[Timed()])
    first = time.perf_counter()
    trainer.train()
    adapter = work / "adapter"
    trainer.save_model(str(adapter))
    e2e = time.perf_counter() - t0
    return {**clock.timing(spec["warmup_steps"]), "e2e_s": e2e, "first_step_s": first - t0,
            "first_loss": losses[0], "last_loss": losses[-1], "rss_after_imports_mb": rss_imports,
            "adapter": str(adapter), "attn_implementation": trainer.model.config._attn_implementation}


if __name__ == "__main__":
    worker_main({"ours-sft": run_ours, "ours-dpo": run_ours, "trl-sft": run_trl, "trl-dpo": run_trl})

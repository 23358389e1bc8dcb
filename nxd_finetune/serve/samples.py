"""``eval.prompts``: at every eval of a run, greedy generations from the model as it is now,
logged beside the scores (``metrics.jsonl`` record key ``eval_samples``, a TensorBoard text table,
a table in MLflow / W&B), so a user sees the answers change, not only the loss.

Generation uses ``transformers``' ``generate`` on an HF copy of the model held by global rank 0
(on CPU, or on the run's CUDA device): the base loaded once with ``AutoModelForCausalLM`` and,
for LoRA, the adapter attached with ``peft``; at each eval the current weights are gathered from
every rank with the same collectives as the final export (``export.gather_to_writer``: any
tp / pp / dp layout) and copied in. The copy costs one more base model's
memory on rank 0, which is why this is opt-in and meant for a short list of prompts.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_finetune.data.formats import load_chat_template
from nxd_finetune.export import gather_to_writer
from nxd_finetune.lora.io import write_adapter_files
from nxd_finetune.metrics import SAMPLES, MetricsWriter
from nxd_finetune.models import resolve_dtype
from nxd_finetune.serve.generate import (
    GenerationConfig,
    LoadedModel,
    decode,
    generate_ids,
    prompt_ids,
    stop_token_ids,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.recipe import Recipe
    from nxd_finetune.sft.engine import Engine


class EvalSamples:
    """Build with :meth:`for_run`; :meth:`log` is collective (every rank calls it at each eval)."""

    def __init__(self, recipe: Recipe, engine: Engine, model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        self.recipe, self.engine, self.model_dir, self.tokenizer = recipe, engine, model_dir, tokenizer
        self._model: Any = None  # the HF model (a PeftModel under LoRA), built on first use
        self._last_step: int | None = None

    @classmethod
    def for_run(cls, recipe: Recipe, engine: Engine, model_dir: Path,
                tokenizer: PreTrainedTokenizerBase) -> EvalSamples | None:
        return cls(recipe, engine, model_dir, tokenizer) if recipe.eval.prompts else None

    def _weights(self) -> dict[str, torch.Tensor] | None:
        engine = self.engine
        tensors = gather_to_writer(engine.rank_model, engine.lora_config, engine.state.host_group("pp"))
        return None if tensors is None else {k: v.detach().to("cpu") for k, v in tensors.items()}

    def _device(self) -> torch.device:
        return self.engine.device if self.engine.device.type == "cuda" else torch.device("cpu")

    def _update(self, tensors: dict[str, torch.Tensor]) -> Any:
        """The HF model holding ``tensors`` (built on first use)."""
        from transformers import AutoModelForCausalLM

        if self._model is None:
            dtype = resolve_dtype(self.recipe.model.dtype)
            base = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype)
            base = base.to(self._device())  # type: ignore[arg-type]  # transformers' stub of .to
            if self.engine.lora_config is None:
                self._model = base
            else:
                from peft import PeftModel

                with tempfile.TemporaryDirectory(prefix="nxd-samples-") as tmp:
                    # the exporter's writer: the gathered tensors as a PEFT adapter peft loads
                    write_adapter_files(tmp, self.engine.lora_config, tensors, self.engine.lora_targets,
                                        str(self.model_dir))
                    self._model = PeftModel.from_pretrained(base, tmp)
                self._model.eval()
                return self._model
        if self.engine.lora_config is None:
            self._model.load_state_dict(tensors, strict=False)
        else:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self._model, tensors)
        self._model.eval()
        return self._model

    def generate(self) -> list[dict[str, str]] | None:
        """``[{"prompt", "completion"}]`` on global rank 0, None elsewhere. Collective."""
        tensors = self._weights()
        if not self.engine.is_logger or tensors is None:
            return None
        template = load_chat_template(self.recipe.data.chat_template)
        kwargs = self.recipe.data.chat_template_kwargs
        loaded = LoadedModel(self._update(tensors), self.tokenizer, self._device(), "training model",
                             stop_token_ids(self.tokenizer, self.model_dir, template, kwargs))
        use_chat = template is not None or bool(getattr(self.tokenizer, "chat_template", None))
        config = GenerationConfig(max_new_tokens=self.recipe.eval.max_new_tokens)
        rows = []
        for prompt in self.recipe.eval.prompts:
            ids = (prompt_ids(self.tokenizer, [{"role": "user", "content": prompt}], chat_template=template,
                              template_kwargs=kwargs)
                   if use_chat else prompt_ids(self.tokenizer, text=prompt))
            rows.append({"prompt": prompt, "completion": decode(self.tokenizer, generate_ids(loaded, ids, config))})
        return rows

    def log(self, metrics: MetricsWriter, step: int) -> None:
        """Generate and log at ``step`` (once per step: the end-of-run eval may repeat the last)."""
        if step == self._last_step:
            return
        self._last_step = step
        rows = self.generate()
        if rows is not None:
            metrics.log(step, {SAMPLES: rows})

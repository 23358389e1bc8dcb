"""The quickstart on a tiny mixture-of-experts model (``builtin:tiny-qwen3-moe``,
``recipes/quickstart-moe.yaml``, ``builtin:quickstart-moe``): the model is a transformers
``Qwen3MoeForCausalLM`` with tiny-qwen3's tokens whose logits ours equal, and a short run with LoRA
on the attention and the experts learns the task: the eval loss falls and the exact match of the
answers, scored by transformers with the adapter loaded by peft, rises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nxd_finetune import quickstart
from nxd_finetune.assets import QUICKSTART_DIR
from nxd_finetune.cli import main
from nxd_finetune.models import load_pretrained
from nxd_finetune.recipe import load_recipe
from tests.moe_helpers import doc_commands

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-moe.yaml"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def moe_dir(quickstart_cache) -> Path:
    return quickstart.ensure_tiny_model(name=quickstart.TINY_QWEN3_MOE)


def _hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def test_tiny_qwen3_moe_is_a_qwen3_moe_with_qwen3_tokens(moe_dir, quickstart_cache):
    config = AutoConfig.from_pretrained(moe_dir)
    assert config.architectures == ["Qwen3MoeForCausalLM"]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 128)
    assert config.norm_topk_prob is True and config.mlp_only_layers == [] and config.decoder_sparse_step == 1
    tok = AutoTokenizer.from_pretrained(moe_dir)
    qwen3 = AutoTokenizer.from_pretrained(quickstart.ensure_tiny_model(name=quickstart.TINY_QWEN3))
    assert tok.get_vocab() == qwen3.get_vocab() and tok.chat_template == qwen3.chat_template
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>") and config.vocab_size == len(tok)
    hf = _hf(moe_dir)
    assert all(layer.mlp.experts.gate_up_proj.shape == (8, 256, 256) for layer in hf.model.layers)
    ids = torch.tensor([tok("Is 7 even or odd? The cat sat on the mat.")["input_ids"]])
    with torch.no_grad():
        ref = hf(ids).logits
        ours = load_pretrained(moe_dir).eval()(ids)
    assert (ours - ref).abs().max() <= 1e-4
    assert quickstart.resolve_model_path("builtin:tiny-qwen3-moe") == moe_dir
    assert moe_dir.name.startswith("tiny-qwen3-moe-")


def _exact_match(model: torch.nn.Module, tok) -> float:  # noqa: ANN001  (a transformers tokenizer)
    """The answers' exact match with the generation prompt the training data ends its prompts with:
    Qwen3's template without thinking (its empty think block pre-filled, as trained)."""
    rows = [json.loads(line) for line in (QUICKSTART_DIR / "eval.jsonl").read_text().splitlines()][:40]
    template = "{%- set enable_thinking = false %}" + tok.chat_template
    return quickstart.answer_accuracy(lambda ids: model(ids).logits, tok, rows, chat_template=template)


def test_moe_quickstart_learns(moe_dir, quickstart_cache, tmp_path):
    """30 steps of the docs' quickstart line: the eval loss falls at each eval, by far, and the
    exact match of the eval answers (transformers + the adapter loaded by peft, the base's chat
    template) rises from none."""
    shipped = load_recipe("builtin:quickstart-moe")
    assert shipped.model.path == "builtin:tiny-qwen3-moe" and shipped.model_dump() == load_recipe(RECIPE).model_dump()
    assert list(shipped.lora.target_parameters) == EXPERTS and shipped.parallel.nproc == 1
    argv = doc_commands()["nxd-finetune run builtin:quickstart-moe"]  # the line docs/models.md shows, shortened
    with pytest.raises(SystemExit) as info:
        main([*argv[1:], "training.max_steps=30", "training.warmup_steps=3", "eval.every_n_steps=15",
              "eval.max_batches=4", "checkpoint.every_n_steps=null", "logging.progress=false",
              f"output.dir={tmp_path}"])
    assert (info.value.code or 0) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 15, 30]
    losses = [loss for _, loss in evals]
    assert losses[0] > losses[1] > losses[2] and losses[2] < min(1.0, losses[0] / 4), evals
    final = tmp_path / "final"
    written = json.loads((final / "adapter_config.json").read_text())
    assert written["target_parameters"] == EXPERTS
    tok = AutoTokenizer.from_pretrained(moe_dir)
    with torch.no_grad():
        before = _exact_match(_hf(moe_dir), tok)
        after = _exact_match(PeftModel.from_pretrained(_hf(moe_dir), final).eval(), tok)
    assert before == 0.0 and after >= 0.5, (before, after)

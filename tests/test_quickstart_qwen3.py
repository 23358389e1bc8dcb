"""The quickstart on a tiny Qwen3 (``builtin:tiny-qwen3``, ``recipes/quickstart-qwen3.yaml``): the model
and its tokens, Qwen3's released chat template and TRL's training variant of it (the same text as
TRL's copies), multi-turn rows rendered with the variant as TRL does, their trained tokens equal to
``transformers``' assistant mask on it (less the newline after each turn's end), with thinking and
without (``data.chat_template_kwargs: {enable_thinking: false}``), and a short run that learns."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from nxd_finetune import quickstart
from nxd_finetune.assets import QWEN3_CHAT_TEMPLATE, QWEN3_TRAINING_CHAT_TEMPLATE
from nxd_finetune.data.formats import render_row, resolve_columns, tokenize_rendered
from nxd_finetune.errors import DataError
from nxd_finetune.loss import IGNORE_INDEX
from nxd_finetune.recipe import load_recipe
from nxd_finetune.sft import trainer

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart-qwen3.yaml"
CHAT = [{"role": "user", "content": "Is 7 even or odd?"}, {"role": "assistant", "content": "odd"},
        {"role": "user", "content": "Is 12 even or odd?"}, {"role": "assistant", "content": "even"}]


@pytest.fixture(scope="module")
def qwen3_dir(quickstart_cache) -> Path:
    return quickstart.ensure_tiny_model(name=quickstart.TINY_QWEN3)


@pytest.fixture(scope="module")
def tok(qwen3_dir):
    return AutoTokenizer.from_pretrained(qwen3_dir)


def test_tiny_qwen3_is_a_qwen3_with_qwen3_tokens(qwen3_dir, tok, quickstart_cache):
    config = AutoConfig.from_pretrained(qwen3_dir)
    assert config.architectures == ["Qwen3ForCausalLM"] and config.head_dim == 32
    assert config.tie_word_embeddings is False and config.vocab_size == len(tok)
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir).eval()
    assert any(n.endswith("self_attn.q_norm.weight") for n, _ in model.named_parameters())
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    assert config.eos_token_id == tok.eos_token_id and config.pad_token_id == tok.pad_token_id
    assert tok.convert_ids_to_tokens(tok("4725")["input_ids"]) == ["4", "7", "2", "5"]  # no bos, digits apart
    for word in ("<think>", "</think>", "<|im_start|>", "<|im_end|>"):
        assert len(tok(word)["input_ids"]) == 1, word
    assert tok.decode(tok("<think>\nx</think>")["input_ids"], skip_special_tokens=True) == "<think>\nx</think>"
    with torch.no_grad():
        logits = model(torch.tensor([tok("The cat")["input_ids"]])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()
    assert quickstart.resolve_model_path("builtin:tiny-qwen3") == qwen3_dir
    assert quickstart.resolve_model_path("builtin:tiny-llama").name.startswith("tiny-llama-")


def test_chat_templates_are_qwen3s_and_trls(tok):
    """The tokenizer carries Qwen3's released template; both shipped templates are TRL's copies."""
    trl = importlib.resources.files("trl") / "chat_templates"
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE.read_text() == (trl / "qwen3.jinja").read_text()
    assert QWEN3_TRAINING_CHAT_TEMPLATE.read_text() == (trl / "qwen3_training.jinja").read_text()
    assert tok.apply_chat_template(CHAT, tokenize=False) == (
        "<|im_start|>user\nIs 7 even or odd?<|im_end|>\n<|im_start|>assistant\nodd<|im_end|>\n"
        "<|im_start|>user\nIs 12 even or odd?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\neven<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _trained(tok, template: str | None, **template_kwargs) -> tuple[list[int], list[int]]:
    rendered = render_row({"messages": CHAT}, "messages", resolve_columns(["messages"], "messages", None), tok,
                          template, template_kwargs=template_kwargs)
    ((ids, labels),) = tokenize_rendered(tok, [rendered])
    return ids, labels


def _trls_mask(tok, **template_kwargs) -> tuple[list[int], list[bool]]:
    """``transformers``' assistant mask on TRL's training variant (TRL's rule), the template seeing
    ``template_kwargs`` as TRL's ``chat_template_kwargs``, less the newline the variant's generation
    block holds after each ``<|im_end|>`` (not trained here: the rule of every template, data/formats.py)."""
    theirs = tok.apply_chat_template(CHAT, chat_template=QWEN3_TRAINING_CHAT_TEMPLATE.read_text(), tokenize=True,
                                     return_dict=True, return_assistant_tokens_mask=True, **template_kwargs)
    ids, end = list(theirs["input_ids"]), tok.convert_tokens_to_ids("<|im_end|>")
    mask = [bool(m) and not (i and ids[i - 1] == end) for i, m in enumerate(theirs["assistant_masks"])]
    assert sum(theirs["assistant_masks"]) - sum(mask) == 2
    return ids, mask


def test_multi_turn_rows_train_like_trls_assistant_mask(tok):
    """The released template renders earlier turns without their think block (its prefixes are
    inconsistent), so a multi-turn row is rendered with TRL's training variant, as TRL swaps it: each
    turn's think block, answer and ``<|im_end|>`` are trained, ``transformers``' assistant mask on the
    variant's ``{% generation %}`` markers (TRL's rule), less the newline after each ``<|im_end|>``.
    A template that is not the released one (one space added) is not swapped, and refused."""
    template = QWEN3_TRAINING_CHAT_TEMPLATE.read_text()
    ids, labels = _trained(tok, None)
    assert (ids, labels) == _trained(tok, QWEN3_CHAT_TEMPLATE.read_text()) == _trained(tok, template)
    with pytest.raises(DataError, match="renders conversation prefixes inconsistently"):
        _trained(tok, QWEN3_CHAT_TEMPLATE.read_text() + " ")
    assert (ids, [label != IGNORE_INDEX for label in labels]) == _trls_mask(tok)
    trained = tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])
    assert trained == "<think>\n\n</think>\n\nodd<|im_end|><think>\n\n</think>\n\neven<|im_end|>"


def test_no_thinking_rows_train_like_trls_assistant_mask(tok):
    """``enable_thinking: false``: the generation prompt pre-fills an empty think block, but the
    variant's ``{% generation %}`` blocks still open before it, so TRL (``chat_template_kwargs``)
    trains the block with each answer; so do we, whether the template is the tokenizer's, the
    released one or the variant given as ``data.chat_template``."""
    prompt = tok.apply_chat_template(CHAT[:3], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids, labels = _trained(tok, None, enable_thinking=False)
    assert (ids, labels) == _trained(tok, QWEN3_CHAT_TEMPLATE.read_text(), enable_thinking=False)
    assert (ids, labels) == _trained(tok, QWEN3_TRAINING_CHAT_TEMPLATE.read_text(), enable_thinking=False)
    assert (ids, [label != IGNORE_INDEX for label in labels]) == _trls_mask(tok, enable_thinking=False)


def test_qwen3_quickstart_learns(quickstart_cache, tmp_path):
    """30 steps of the Qwen3 quickstart: the eval loss falls at each eval, by far."""
    shipped = load_recipe("builtin:quickstart-qwen3")
    assert shipped.model.path == "builtin:tiny-qwen3" and shipped.data.chat_template is None
    assert shipped.model_dump() == load_recipe(RECIPE).model_dump()
    recipe = load_recipe(RECIPE, ["training.max_steps=30", "training.warmup_steps=3", "eval.every_n_steps=15",
                                  "eval.max_batches=4", "checkpoint.every_n_steps=null", "logging.progress=false",
                                  f"output.dir={tmp_path}"])
    trainer.run(recipe)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 15, 30]
    losses = [loss for _, loss in evals]
    assert losses[0] > losses[1] > losses[2] and losses[2] < min(1.0, losses[0] / 4), evals
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()

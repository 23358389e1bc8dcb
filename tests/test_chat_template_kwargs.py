"""``data.chat_template_kwargs`` (TRL's ``chat_template_kwargs``; Qwen3's ``enable_thinking: false``):
read and checked with the recipe, passed to every chat-template render (training rows, in worker
processes too, and generation prompts), part of the tokenized-data cache key, and fixed on resume.
``transformers``' ``apply_chat_template(..., **kwargs)`` is the oracle of every render. (The trained
masks of Qwen3 without thinking: tests/test_quickstart_qwen3.py and tests/test_family_chat.py; pairs:
tests/test_preference_data.py; bad values: tests/test_bad_inputs.py.)"""

from __future__ import annotations

import inspect
import json
import os

import pytest
import yaml
from transformers import PreTrainedTokenizerBase

from nxd_finetune.data.datasets import DataSpec, cache_entry, prepare_datasets
from nxd_finetune.data.formats import RESERVED_TEMPLATE_KWARGS
from nxd_finetune.errors import DataError, NxdError
from nxd_finetune.quickstart import CHAT_TEMPLATE, TINY_QWEN3, build_tokenizer
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.recipe.resume import check_resume
from nxd_finetune.serve import generate as gen

os.environ.setdefault("HF_HUB_OFFLINE", "1")

OFF = {"enable_thinking": False}
# the quickstart template with a line that only a template variable prints
NOTED = "{% if note is defined %}<|system|>\n{{ note }}\n{% endif %}" + CHAT_TEMPLATE
ROWS = [{"messages": [{"role": "user", "content": f"Is {n} even or odd?"},
                      {"role": "assistant", "content": "even" if n % 2 == 0 else "odd"}]} for n in range(6)]


@pytest.fixture(scope="module")
def qs_tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def qwen3_tok():
    return build_tokenizer(name=TINY_QWEN3)


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def test_the_recipe_reads_them_and_stores_none_for_empty():
    recipe = load_recipe("builtin:quickstart-qwen3", ["data.chat_template_kwargs.enable_thinking=false"])
    assert recipe.data.chat_template_kwargs == OFF
    assert recipe_from_dict(yaml.safe_load(recipe.to_yaml())).data.chat_template_kwargs == OFF
    assert DataSpec.from_recipe(recipe).chat_template_kwargs == OFF
    assert load_recipe("builtin:quickstart-qwen3", ["data.chat_template_kwargs={}"]).data.chat_template_kwargs is None
    with pytest.raises(DataError, match="data.chat_template_kwargs.x must be a string"):
        DataSpec.of({"train": "t.jsonl", "chat_template_kwargs": {"x": [1]}})


def test_resume_refuses_a_change_and_accepts_a_recipe_saved_without_the_key():
    plain = load_recipe("builtin:quickstart-qwen3")
    saved = plain.to_dict()
    del saved["data"]["chat_template_kwargs"]  # a checkpoint written before the key existed
    assert check_resume(yaml.safe_dump(saved), plain, "ck", 2) == []
    off = load_recipe("builtin:quickstart-qwen3", ["data.chat_template_kwargs.enable_thinking=false"])
    for before, after in ((plain, off), (off, plain)):
        with pytest.raises(NxdError, match=r"data.chat_template_kwargs\S* changed since the checkpoint"):
            check_resume(before.to_yaml(), after, "ck", 2)


def test_the_cache_key_holds_them(qs_tok, rows_file, tmp_path):
    base = {"train": rows_file, "chat_template": NOTED, "cache_dir": str(tmp_path / "cache")}
    entries = [cache_entry(base | extra, qs_tok) for extra in
               ({}, {"chat_template_kwargs": {}}, {"chat_template_kwargs": {"note": "a"}},
                {"chat_template_kwargs": {"note": "b"}}, {"chat_template_kwargs": {"note": "a", "x": 1}})]
    assert entries[0] == entries[1]  # {} renders as nothing: the entry of data without them
    assert len(set(entries)) == 4


@pytest.mark.parametrize("num_proc", [1, 2])
def test_training_rows_are_rendered_with_them(qs_tok, rows_file, tmp_path, num_proc):
    """Through the cache and the tokenizing workers: each row's tokens are ``apply_chat_template``'s
    with the same kwargs; changing them gives another cache entry, not the old rows."""
    spec = {"train": rows_file, "chat_template": NOTED, "cache_dir": str(tmp_path / "cache"), "num_proc": num_proc}
    train, _ = prepare_datasets(spec | {"chat_template_kwargs": {"note": "Be brief."}}, qs_tok)
    for i, row in enumerate(ROWS):
        expected = qs_tok.apply_chat_template(row["messages"], chat_template=NOTED, note="Be brief.")["input_ids"]
        assert train[i]["input_ids"] == list(expected)
    plain, _ = prepare_datasets(spec, qs_tok)
    assert plain[0]["input_ids"] == list(qs_tok.apply_chat_template(ROWS[0]["messages"], chat_template=NOTED)
                                         ["input_ids"])
    assert len(plain[0]["input_ids"]) < len(train[0]["input_ids"])


def test_generation_prompts_use_them(qwen3_tok):
    """``prompt_ids`` (``generate``, ``chat``, the eval samples and ``eval --generate``) renders the
    generation prompt with them: Qwen3 without thinking pre-fills the empty think block."""
    messages = [{"role": "user", "content": "Is 7 even or odd?"}]
    kwargs = gen.load_template_kwargs('{"enable_thinking": false}')
    assert kwargs == OFF and gen.load_template_kwargs("{}") is None
    ids = gen.prompt_ids(qwen3_tok, messages, template_kwargs=kwargs)
    assert ids == list(qwen3_tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
                       ["input_ids"])
    assert qwen3_tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids != gen.prompt_ids(qwen3_tok, messages)


def test_reserved_names_are_apply_chat_template_arguments():
    """Every named argument of ``apply_chat_template`` is refused as a template variable (it would
    collide with ours); a transformers release that adds one fails here."""
    named = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert named <= set(RESERVED_TEMPLATE_KWARGS)

"""Assistant-only masking on the chat templates of the newer families: Gemma's ``<start_of_turn>`` /
``<end_of_turn>``, Phi-3's ``<|assistant|>`` / ``<|end|>``, Phi-4's ``<|im_sep|>`` ChatML and Qwen3's
ChatML with ``<think>`` blocks (the released templates' logic, without tools; Qwen3's also without
thinking, ``data.chat_template_kwargs: {enable_thinking: false}``). For each: the exact
text that is trained, and the trained positions equal to ``transformers``' assistant mask
(``return_assistant_tokens_mask``) on a ``{% generation %}`` version of the template, TRL's rule:
the assistant's answer and its end-of-turn token trained, the newline the template prints after
that token not, nothing of the prompt or the role header."""

from __future__ import annotations

import itertools

import pytest
from chat_helpers import bpe_backend, chat_tokenizer

from nxd_finetune.data.formats import render_row, resolve_columns, tokenize_rendered
from nxd_finetune.errors import DataError
from nxd_finetune.loss import IGNORE_INDEX

SPECIALS = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<s>", "<|endoftext|>", "<|system|>",
            "<|user|>", "<|assistant|>", "<|end|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>"]
CORPUS = ["Be brief.", "What is two plus two?", "It is four.", "And three plus three?", "Six.", "model user",
          "2 + 2 = 4", "think"] * 4

# Gemma 2 / 3 (the system message goes in front of the first user turn; the assistant is "model")
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}"
    "{% endif %}{% for m in loop_messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ prefix if loop.first else '' }}"
    "{% if m['role'] == 'assistant' %}@@{{ m['content'] | trim }}<end_of_turn>##"
    "{% else %}{{ m['content'] | trim }}<end_of_turn>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Phi-3 / Phi-3.5 (an eos after the conversation when no generation prompt is asked for)
PHI3 = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n@@{{ m['content'] }}<|end|>##{{ '\\n' }}"
    "{% else %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)
# Phi-4
PHI4 = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant<|im_sep|>"
    "@@{{ m['content'] }}<|im_end|>##{% else %}{{ '<|im_start|>' + m['role'] + '<|im_sep|>' + m['content'] }}"
    "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant<|im_sep|>{% endif %}"
)
# Qwen3: reasoning (``reasoning_content``, or ``<think>...</think>`` in the content) is printed for
# assistant turns after the last user message; the last assistant turn always gets a think block;
# ``enable_thinking=False`` pre-fills an empty one after the generation prompt
QWEN3 = (
    "{% set ns = namespace(last_query=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] != 'assistant' %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% else %}"
    "{% set content = m['content'] %}{% set reasoning = '' %}"
    "{% if not reasoning and '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}<|im_start|>assistant\n@@"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{% else %}{{ content }}{% endif %}<|im_end|>##{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


# "@@" / "##" mark where {% generation %} / {% endgeneration %} go; a newline the template prints
# after a block tag is written {{ '\n' }} (Jinja's trim_blocks drops a literal one)


def _plain(template: str) -> str:
    return template.replace("@@", "").replace("##", "")


def _marked(template: str) -> str:
    return template.replace("@@", "{% generation %}").replace("##", "{% endgeneration %}")


# family -> (template, bos, eos)
TEMPLATES = {"gemma": (GEMMA, "<bos>", "<eos>"), "phi3": (PHI3, None, "<|endoftext|>"),
             "phi4": (PHI4, None, "<|im_end|>"), "qwen3": (QWEN3, None, "<|im_end|>")}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."}, {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six."}]
THINKING = [{"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "<think>\n2 + 2 = 4\n</think>\n\nIt is four."}]
# family, conversation -> the trained text, span by span
TRAINED = {
    ("gemma", "chat"): ["It is four.<end_of_turn>", "Six.<end_of_turn>"],
    # the eos Phi-3 prints after the whole conversation is not trained
    ("phi3", "chat"): ["It is four.<|end|>", "Six.<|end|>"],
    ("phi4", "chat"): ["It is four.<|im_end|>", "Six.<|im_end|>"],
    ("qwen3", "thinking"): ["<think>\n2 + 2 = 4\n</think>\n\nIt is four.<|im_end|>"],
    # no reasoning: Qwen3's template still prints an empty think block in the last turn, and it is trained
    ("qwen3", "single-turn"): ["<think>\n\n</think>\n\nIt is four.<|im_end|>"],
}
CONVERSATIONS = {"chat": CHAT, "thinking": THINKING, "single-turn": CHAT[:3]}


@pytest.fixture(scope="module")
def backend():
    return bpe_backend(SPECIALS, CORPUS)


def _ours(tok, messages, **template_kwargs) -> tuple[list[int], list[int]]:
    rendered = render_row({"messages": messages}, "messages", resolve_columns(["messages"], "messages", None), tok,
                          template_kwargs=template_kwargs)
    ((ids, labels),) = tokenize_rendered(tok, [rendered])
    return ids, labels


def _spans(tok, ids: list[int], labels: list[int]) -> list[str]:
    """The trained text, one string per run of trained tokens."""
    runs = itertools.groupby(zip(ids, labels, strict=True), key=lambda pair: pair[1] != IGNORE_INDEX)
    return [tok.decode([i for i, _ in run]) for trained, run in runs if trained]


@pytest.mark.parametrize(("family", "conversation"), sorted(TRAINED))
def test_trained_tokens_per_family_template(backend, family, conversation):
    template, bos, eos = TEMPLATES[family]
    messages = CONVERSATIONS[conversation]
    tok = chat_tokenizer(backend, SPECIALS, _plain(template), bos, eos, "<pad>")
    ids, labels = _ours(tok, messages)
    assert _spans(tok, ids, labels) == TRAINED[family, conversation]
    assert all(label in (IGNORE_INDEX, i) for label, i in zip(labels, ids, strict=True))
    # TRL's mask on the template with {% generation %} around each answer and its end-of-turn
    marked = chat_tokenizer(backend, SPECIALS, _marked(template), bos, eos, "<pad>")
    expected = marked.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
    assert ids == list(expected["input_ids"])
    assert [int(label != IGNORE_INDEX) for label in labels] == list(expected["assistant_masks"])


@pytest.mark.parametrize("conversation", ["chat", "single-turn", "thinking"])
def test_qwen3_without_thinking(backend, conversation):
    """``enable_thinking: false`` (``data.chat_template_kwargs``) pre-fills ``<think>\n\n</think>\n\n``
    after the generation prompt. With ``{% generation %}`` markers (how TRL trains Qwen3: its training
    variant) the marked turns are trained, TRL's mask with the same kwargs: the empty block of the
    last turn with its answer, as with thinking. Without markers, turns are located prefix by
    prefix: what the generation prompt prints (the pre-filled block) is prompt, and a turn rendered
    without it (an earlier turn, or one with reasoning) makes the prefixes inconsistent (refused)."""
    template, bos, eos = TEMPLATES["qwen3"]
    messages = CONVERSATIONS[conversation]
    marked = chat_tokenizer(backend, SPECIALS, _marked(template), bos, eos, "<pad>")
    prompt = marked.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True,
                                        enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids, labels = _ours(marked, messages, enable_thinking=False)
    expected = marked.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                          enable_thinking=False)
    assert ids == list(expected["input_ids"])
    assert [int(label != IGNORE_INDEX) for label in labels] == list(expected["assistant_masks"])
    assert (ids, labels) == _ours(marked, messages)  # the rows themselves do not change with it
    plain = chat_tokenizer(backend, SPECIALS, _plain(template), bos, eos, "<pad>")
    if conversation == "single-turn":
        assert _spans(plain, *_ours(plain, messages, enable_thinking=False)) == ["It is four.<|im_end|>"]
    else:
        with pytest.raises(DataError, match="renders conversation prefixes inconsistently"):
            _ours(plain, messages, enable_thinking=False)

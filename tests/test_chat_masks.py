"""Assistant-only masking follows TRL's convention on every template: our tokens and trained
positions equal ``transformers``' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` on
``{% generation %}`` versions of Llama-3-, ChatML-, Mistral- and quickstart-style templates (the
end-of-turn token trained, what the template prints after it not, no eos added after the
template's own end-of-turn, also where the tokenizer's eos is another token)."""

from __future__ import annotations

import pytest

from nxd_finetune.data.formats import render_row, resolve_columns, tokenize_rendered
from nxd_finetune.loss import IGNORE_INDEX
from nxd_finetune.quickstart import CHAT_TEMPLATE as QUICKSTART_TEMPLATE

SPECIALS = ["<|pad|>", "<s>", "</s>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "[INST]", "[/INST]",
            "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
CORPUS = ["You are a terse helper.", "What is two plus two?", "It is four.", "And three plus three?",
          "Six, of course.\n", "Thanks!", "You're welcome.  ", "system user assistant"] * 4

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"  # a "\n" after a tag is trimmed
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "[INST] {{ (system if loop.first else '') + m['content'] }} [/INST]"
    "{% else %}{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}"
)
QUICKSTART = QUICKSTART_TEMPLATE.replace(
    "{{ message['content'] }}{{ eos_token }}",
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}")

# template, bos, eos (the Llama-3 and ChatML eos differ from their end-of-turn tokens)
TEMPLATES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|end_of_text|>"),
    "llama3-eos-is-eot": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "chatml": (CHATML, None, "<|endoftext|>"),
    "chatml-eos-is-im-end": (CHATML, None, "<|im_end|>"),
    "mistral": (MISTRAL, "<s>", "</s>"),
    "quickstart": (QUICKSTART, "<|bos|>", "<|eos|>"),
}
CONVERSATIONS = {
    "multi-turn-with-system": [
        {"role": "system", "content": "You are a terse helper."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, of course.\n"},
    ],
    "multi-turn": [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome.  "},
    ],
}


@pytest.fixture(scope="module")
def backend():
    """A byte-level BPE (every character, "\\n" included, is a token of its own or merged) with
    the special tokens of all four template families."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def tokenizer(backend, template: str, bos: str | None, eos: str):
    from transformers import PreTrainedTokenizerFast

    named = {bos, eos, "<|pad|>"}
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token="<|pad|>",
                                   additional_special_tokens=[t for t in SPECIALS if t not in named],
                                   chat_template=template)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_labels_mask_equals_trl_assistant_mask(backend, family, conversation):
    template, bos, eos = TEMPLATES[family]
    tok = tokenizer(backend, template, bos, eos)
    messages = CONVERSATIONS[conversation]
    expected = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert sum(expected["assistant_masks"]) > 0
    rendered = render_row({"messages": messages}, "messages", resolve_columns(["messages"], "messages", None), tok)
    ((ids, labels),) = tokenize_rendered(tok, [rendered])
    assert ids == list(expected["input_ids"]), (tok.convert_ids_to_tokens(ids)[-4:],
                                                tok.convert_ids_to_tokens(expected["input_ids"])[-4:])
    ours = [int(label != IGNORE_INDEX) for label in labels]
    shown = [(t, m, o) for t, m, o in zip(tok.convert_ids_to_tokens(ids), expected["assistant_masks"], ours,
                                          strict=True) if m != o]
    assert ours == list(expected["assistant_masks"]), shown
    assert all(label in (IGNORE_INDEX, i) for label, i in zip(labels, ids, strict=True))


def test_chatml_newline_after_end_of_turn_is_not_trained(backend):
    tok = tokenizer(backend, CHATML, None, "<|endoftext|>")
    messages = CONVERSATIONS["multi-turn"]
    rendered = render_row({"messages": messages}, "messages", resolve_columns(["messages"], "messages", None), tok)
    ((ids, labels),) = tokenize_rendered(tok, [rendered])
    tokens = tok.convert_ids_to_tokens(ids)
    ends = [i for i, t in enumerate(tokens) if t == "<|im_end|>"]
    assert [labels[i] != IGNORE_INDEX for i in ends] == [False, True, False, True]
    assert all(labels[i + 1] == IGNORE_INDEX for i in ends if i + 1 < len(ids))
    # the text ends with <|im_end|>\n: "\n" untrained, no eos added after it
    assert tokens[-1] == "Ċ" and labels[-1] == IGNORE_INDEX and tok.eos_token_id not in ids

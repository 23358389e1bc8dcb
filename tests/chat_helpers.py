"""Tokenizers for chat-template tests: a small byte-level BPE trained on a few sentences, with the
special tokens of the templates under test, wrapped as a ``transformers`` fast tokenizer."""

from __future__ import annotations

from collections.abc import Sequence


def bpe_backend(specials: Sequence[str], corpus: Sequence[str]):
    """A byte-level BPE (every character, "\\n" included, is a token of its own or merged) with
    ``specials`` as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer)
    return tok


def chat_tokenizer(backend, specials: Sequence[str], template: str, bos: str | None, eos: str, pad: str):
    """``backend`` as a fast tokenizer with ``template``; every special token but bos/eos/pad is an
    additional special token."""
    from transformers import PreTrainedTokenizerFast

    named = {bos, eos, pad}
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad,
                                   additional_special_tokens=[t for t in specials if t not in named],
                                   chat_template=template)

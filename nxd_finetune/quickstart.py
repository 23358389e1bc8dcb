"""The quickstart's tiny local model (``model.path: builtin:tiny-llama``) and its accuracy metric.

``ensure_tiny_model()`` builds, once per machine, an HF-format directory holding

- a byte-level BPE tokenizer (``tokenizers``) trained on ``nxd_finetune/assets/quickstart/corpus.txt``
  (package data, so an installed package builds it too), with ``<|bos|>``, ``<|eos|>``, ``<|pad|>``
  and a chat template using ``<|system|>``, ``<|user|>`` and ``<|assistant|>`` markers; digits are
  split one per token so number tasks stay learnable;
- a randomly initialised (fixed seed) ``LlamaForCausalLM`` of ~4M parameters saved as safetensors.

Nothing is downloaded. The directory lives under ``$NXD_FINETUNE_CACHE`` (default
``~/.cache/nxd-finetune``) in ``models/tiny-llama-<hash>``, the hash covering everything that
defines the model (this module's recipe version, the config, the corpus), so a change rebuilds it.
It is written to a temporary directory and renamed into place, so concurrent callers (several
ranks) never see a half-written model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_finetune.assets import BUILTIN_PREFIX, QUICKSTART_CORPUS
from nxd_finetune.data.formats import render_chat
from nxd_finetune.errors import ModelLoadError
from nxd_finetune.storage.atomic import publish_dir
from nxd_finetune.storage.cache import models_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

TINY_LLAMA = "builtin:tiny-llama"
CORPUS = QUICKSTART_CORPUS  # package data: found in an installed package too

_VERSION = 1  # bump when the build below changes in a way the hash would not see
SEED = 0
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>")
MODEL_CONFIG: dict[str, Any] = {  # LlamaConfig keyword arguments
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}
# The output layer is initialised LM_HEAD_SCALE times wider than the rest (std 0.02): the final norm
# and the head stay frozen under LoRA, and with std 0.02 the largest reachable logit is ~5, which caps
# a LoRA fine-tune of the random model at ~7% probability for the right token (loss >= 2.6).
LM_HEAD_SCALE = 4.0
# Every assistant turn ends with <|eos|>, so a model trained on it stops after its answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}<|user|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _build_key() -> str:
    if not CORPUS.is_file():
        raise ModelLoadError(f"quickstart corpus not found: {CORPUS} (reinstall nxd-finetune, or run "
                             "recipes/quickstart/make_data.py in a checkout)")
    spec = {
        "version": _VERSION,
        "seed": SEED,
        "vocab_size": VOCAB_SIZE,
        "special_tokens": SPECIAL_TOKENS,
        "config": MODEL_CONFIG,
        "lm_head_scale": LM_HEAD_SCALE,
        "chat_template": CHAT_TEMPLATE,
        "corpus_sha256": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def build_tokenizer(corpus: Path = CORPUS) -> PreTrainedTokenizerFast:
    """Train the quickstart tokenizer on ``corpus``; returns a ``PreTrainedTokenizerFast``.

    Plain calls (``tok(text)``) prepend ``<|bos|>`` like Llama tokenizers do; the chat template
    writes ``bos_token`` itself (``apply_chat_template`` tokenizes without special tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    bos_id = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        padding_side="right",
    )


def _build(out_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_CONFIG,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(LM_HEAD_SCALE)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the quickstart's console
    model.save_pretrained(out_dir, safe_serialization=True)


def ensure_tiny_model(cache_root: str | os.PathLike | None = None) -> Path:
    """Path of the quickstart model directory, building it first if absent (a few seconds).

    Returns ``<cache>/models/tiny-llama-<hash>``, loadable with
    ``transformers.AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
    Raises ModelLoadError if the shipped corpus is missing.
    """
    final = models_cache(cache_root) / f"tiny-llama-{_build_key()}"
    if (final / "config.json").is_file():
        return final
    # Another process may publish the same model first: then its copy is kept.
    with publish_dir(final, already_published=lambda d: (d / "config.json").is_file()) as tmp:
        _build(tmp)
    return final


def resolve_model_path(path: str | os.PathLike) -> Path | str:
    """Map ``builtin:tiny-llama`` to :func:`ensure_tiny_model`; return any other path unchanged.

    Other ``builtin:`` names raise ModelLoadError listing the known ones.
    """
    text = str(path)
    if not text.startswith(BUILTIN_PREFIX):
        return path if isinstance(path, str) else Path(path)
    if text != TINY_LLAMA:
        raise ModelLoadError(f"unknown built-in model {text!r}; known: {TINY_LLAMA}")
    return ensure_tiny_model()


def _answer_positions(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]],
                      chat_template: str | None) -> tuple[list[int], int]:
    """Token ids of the whole conversation and the index where the final answer starts.

    The answer is the content of the last (assistant) message, without the end-of-turn tokens.
    """
    prompt = render_chat(tokenizer, messages[:-1], chat_template, add_generation_prompt=True)
    answer = tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer, len(prompt_ids)


@torch.no_grad()
def answer_accuracy(
    model_fn: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: PreTrainedTokenizerBase,
    rows: Iterable[Mapping[str, Sequence[Mapping[str, str]]]],
    chat_template: str | None = None,
    batch_size: int = 16,
    messages_field: str = "messages",
) -> float:
    """Fraction of conversations whose final answer the model predicts exactly (teacher forced).

    For each row (``messages`` format, last message from the assistant), the prompt is the chat
    rendering of the earlier messages plus the generation prompt; a row counts as correct when,
    at every answer token, ``argmax`` of the logits at the previous position equals that token.
    ``model_fn(input_ids [B, T] long) -> logits [B, T, V]`` must be causal: rows are right-padded
    with the pad (or eos) token and padding only follows the positions that are read.
    """
    encoded = []
    for row in rows:
        messages = row[messages_field]
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError("answer_accuracy needs conversations that end with an assistant message")
        encoded.append(_answer_positions(tokenizer, messages, chat_template))
    if not encoded:
        return 0.0
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    correct = 0
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for i, (ids, _) in enumerate(chunk):
            input_ids[i, : len(ids)] = torch.tensor(ids)
        predicted = model_fn(input_ids).argmax(dim=-1)  # predicted[:, t] is the guess for t + 1
        for i, (ids, answer_start) in enumerate(chunk):
            target = input_ids[i, answer_start : len(ids)]
            guess = predicted[i, answer_start - 1 : len(ids) - 1]
            correct += bool(torch.equal(target, guess))
    return correct / len(encoded)

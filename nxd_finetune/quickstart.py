"""The quickstart's tiny local models (``model.path: builtin:tiny-llama``, ``builtin:tiny-qwen3`` or
``builtin:tiny-qwen3-moe``) and its accuracy metric.

``ensure_tiny_model(name=...)`` builds, once per machine, an HF-format directory holding

- a byte-level BPE tokenizer (``tokenizers``) trained on ``nxd_finetune/assets/quickstart/corpus.txt``
  (package data, so an installed package builds it too); digits are split one per token so number
  tasks stay learnable;
- a randomly initialised (fixed seed) model of ~4M parameters saved as safetensors.

``builtin:tiny-llama``: ``LlamaForCausalLM``; ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` and a chat template
using ``<|system|>``, ``<|user|>`` and ``<|assistant|>`` markers. ``builtin:tiny-qwen3``:
``Qwen3ForCausalLM`` (q/k norms, head_dim set apart from hidden / heads) with Qwen3's tokens
(``<|im_start|>``, ``<|im_end|>`` as eos, ``<|endoftext|>`` as pad, ``<think>`` / ``</think>``, no bos)
and Qwen3's released chat template (``nxd_finetune/assets/qwen3_chat_template.jinja``: ChatML, an
empty ``<think>`` block in the last assistant turn, ``enable_thinking``). ``builtin:tiny-qwen3-moe``:
``Qwen3MoeForCausalLM``, tiny-qwen3's attention and tokens with a mixture-of-experts block in every
layer (8 experts of width 128, top 2, renormalised), the model of the MoE quickstart.

Nothing is downloaded. The directory lives under ``$NXD_FINETUNE_CACHE`` (default
``~/.cache/nxd-finetune``) in ``models/tiny-<family>-<hash>``, the hash covering everything that
defines the model (this module's recipe version, the config, the tokens, the template, the corpus),
so a change rebuilds it. It is written to a temporary directory and renamed into place, so
concurrent callers (several ranks) never see a half-written model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_finetune.assets import BUILTIN_PREFIX, QUICKSTART_CORPUS, QWEN3_CHAT_TEMPLATE
from nxd_finetune.data.formats import render_chat
from nxd_finetune.errors import ModelLoadError
from nxd_finetune.storage.atomic import publish_dir
from nxd_finetune.storage.cache import models_cache

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

TINY_LLAMA = "builtin:tiny-llama"
TINY_QWEN3 = "builtin:tiny-qwen3"
TINY_QWEN3_MOE = "builtin:tiny-qwen3-moe"
CORPUS = QUICKSTART_CORPUS  # package data: found in an installed package too

_VERSION = 1  # bump when the build below changes in a way the hash would not see
SEED = 0
VOCAB_SIZE = 2048  # BPE merges; tokens added after training (Qwen3's <think>, </think>) come on top
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


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """What defines one built-in model: its transformers config class and keyword arguments, its
    tokens (``special``: atomic, skipped when decoding; ``added``: atomic, kept), its chat template,
    and whether plain tokenizer calls prepend ``bos`` (as Llama tokenizers do)."""

    family: str
    config_class: str
    config: Mapping[str, Any]
    special: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    chat_template: str
    added: tuple[str, ...] = ()
    bos_in_plain_calls: bool = False

    def spec(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "config": dict(self.config)}


TINY_MODELS: dict[str, TinyModel] = {
    TINY_LLAMA: TinyModel("llama", "LlamaConfig", MODEL_CONFIG, SPECIAL_TOKENS, "<|bos|>", "<|eos|>", "<|pad|>",
                          CHAT_TEMPLATE, bos_in_plain_calls=True),
    # Qwen3-8B's shape, shrunk: untied head, q/k norms, head_dim 32 (hidden / heads would also be 32:
    # it is set explicitly as Qwen3 configs do); bos_token_id is <|endoftext|> as in Qwen3's config
    TINY_QWEN3: TinyModel("qwen3", "Qwen3Config", {**MODEL_CONFIG, "head_dim": 32, "rms_norm_eps": 1e-6},
                          ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
                          QWEN3_CHAT_TEMPLATE.read_text(encoding="utf-8"), added=("<think>", "</think>")),
}
# Qwen3-30B-A3B's block, shrunk: every layer sparse, top 2 of 8 experts renormalised (norm_topk_prob),
# experts narrower than a dense MLP (moe_intermediate_size); attention and tokens are tiny-qwen3's
TINY_MODELS[TINY_QWEN3_MOE] = dataclasses.replace(
    TINY_MODELS[TINY_QWEN3], family="qwen3-moe", config_class="Qwen3MoeConfig",
    config={**TINY_MODELS[TINY_QWEN3].config, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 128, "norm_topk_prob": True, "decoder_sparse_step": 1})


def _tiny_model(name: str) -> TinyModel:
    if name not in TINY_MODELS:
        raise ModelLoadError(f"unknown built-in model {name!r}; known: {', '.join(TINY_MODELS)}")
    return TINY_MODELS[name]


def _build_key(model: TinyModel) -> str:
    if not CORPUS.is_file():
        raise ModelLoadError(f"quickstart corpus not found: {CORPUS} (reinstall nxd-finetune, or run "
                             "recipes/quickstart/make_data.py in a checkout)")
    spec = {
        "version": _VERSION,
        "seed": SEED,
        "vocab_size": VOCAB_SIZE,
        "model": model.spec(),
        "lm_head_scale": LM_HEAD_SCALE,
        "corpus_sha256": hashlib.sha256(CORPUS.read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def build_tokenizer(corpus: Path = CORPUS, name: str = TINY_LLAMA) -> PreTrainedTokenizerFast:
    """Train the tokenizer of built-in model ``name`` on ``corpus``; returns a ``PreTrainedTokenizerFast``.

    For ``builtin:tiny-llama`` plain calls (``tok(text)``) prepend ``<|bos|>`` like Llama tokenizers
    do; its chat template writes ``bos_token`` itself (``apply_chat_template`` tokenizes without
    special tokens). ``builtin:tiny-qwen3`` adds nothing, as Qwen tokenizers.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = _tiny_model(name)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(spec.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    if spec.bos_in_plain_calls and spec.bos is not None:
        bos_id = tok.token_to_id(spec.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[(spec.bos, bos_id)]
        )
    named = {spec.bos, spec.eos, spec.pad}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        additional_special_tokens=[t for t in spec.special if t not in named],
        chat_template=spec.chat_template,
        model_max_length=spec.config["max_position_embeddings"],
        padding_side="right",
    )


def _build(out_dir: Path, name: str) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    spec = _tiny_model(name)
    tokenizer = build_tokenizer(name=name)
    tokenizer.save_pretrained(out_dir)
    ids = tokenizer.convert_tokens_to_ids
    config = getattr(transformers, spec.config_class)(
        vocab_size=len(tokenizer),
        bos_token_id=ids(spec.bos if spec.bos is not None else spec.pad),
        eos_token_id=ids(spec.eos),
        pad_token_id=ids(spec.pad),
        **spec.config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in the quickstart's console
    model.save_pretrained(out_dir, safe_serialization=True)


def ensure_tiny_model(cache_root: str | os.PathLike | None = None, name: str = TINY_LLAMA) -> Path:
    """Path of built-in model ``name``'s directory, building it first if absent (a few seconds).

    Returns ``<cache>/models/tiny-<family>-<hash>``, loadable with
    ``transformers.AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
    Raises ModelLoadError for an unknown name or if the shipped corpus is missing.
    """
    spec = _tiny_model(name)
    final = models_cache(cache_root) / f"tiny-{spec.family}-{_build_key(spec)}"
    if (final / "config.json").is_file():
        return final
    # Another process may publish the same model first: then its copy is kept.
    with publish_dir(final, already_published=lambda d: (d / "config.json").is_file()) as tmp:
        _build(tmp, name)
    return final


def resolve_model_path(path: str | os.PathLike) -> Path | str:
    """Map the :data:`TINY_MODELS` names (``builtin:tiny-llama``, ``builtin:tiny-qwen3``,
    ``builtin:tiny-qwen3-moe``) to :func:`ensure_tiny_model` and ``builtin:smollm2-135m-instruct`` to
    :func:`nxd_finetune.smollm2.ensure_smollm2`; return any other path unchanged. Other ``builtin:``
    names raise ModelLoadError listing the known ones.
    """
    from nxd_finetune.smollm2 import SMOLLM2, ensure_smollm2

    text = str(path)
    if not text.startswith(BUILTIN_PREFIX):
        return path if isinstance(path, str) else Path(path)
    if text == SMOLLM2:
        return ensure_smollm2()
    if text not in TINY_MODELS:
        raise ModelLoadError(f"unknown built-in model {text!r}; known: {', '.join([*TINY_MODELS, SMOLLM2])}")
    return ensure_tiny_model(name=text)


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

"""Dataset formats: one row -> text plus the character spans that are trained -> token ids and labels.

Every format goes through the same two steps:

1. :func:`render_row` turns a row into ``Rendered(text, spans, add_bos, add_eos)``: the full text
   and the half-open character ranges whose tokens carry loss.
2. :func:`tokenize_rendered` tokenizes the full text once (fast tokenizer, offsets) and gives a
   token a label iff its character range overlaps a trained span. Tokenizing the whole text, rather
   than prompt and answer separately, keeps exactly the tokens the model sees at training time and
   avoids tokenizer-specific artefacts at the join (SentencePiece prefix spaces, merges across it).

Formats (``fields`` maps these canonical names to the dataset's column names):

- ``messages``: a list of ``{role, content}`` rendered with the tokenizer's chat template (or the
  recipe's ``chat_template``). The trained spans are the assistant turns, found by rendering the
  conversation prefix by prefix: turn ``i`` spans from the end of
  ``render(messages[:i], add_generation_prompt=True)`` to the end of ``render(messages[:i+1])``, so
  it includes the template's end-of-turn marker (what the model must learn to emit to stop).
  TRL's convention (``return_assistant_tokens_mask`` on ``{% generation %}`` templates): when the
  turn ends with a special token (``<|im_end|>``, ``<|eot_id|>``, ``</s>``) followed by whitespace
  (ChatML's ``"\n"``), that whitespace is not trained; the end-of-turn token is. Nor is an eos the
  template prints after the whole conversation (Phi-3's ``<|end|>\n<|endoftext|>``).
  Templates for which these renders are not prefixes of each other raise DataError. A released
  template that drops earlier turns' content (Qwen3's: ``<think>`` blocks before the last user
  message) is swapped for TRL's training variant of it, as TRL's ``get_training_chat_template`` does
  for assistant-only loss (:func:`training_chat_template`): every assistant turn keeps its block.
  A template that marks its assistant turns with ``{% generation %}`` (TRL's training variants) is
  not rendered prefix by prefix: its marked blocks are the turns, TRL's rule (what
  ``apply_chat_template(return_assistant_tokens_mask=True)`` masks), less the same whitespace after
  a closing special token. Where a generation prompt prints part of the answer's own text (Qwen3's
  empty ``<think>`` block under ``enable_thinking: false``) the two rules differ, and the markers are
  the one TRL trains with.
  Optional ``fields.role`` / ``fields.content`` rename the keys inside messages (ShareGPT's
  ``from``/``value``); the roles ``human``/``gpt`` are read as ``user``/``assistant``.
- ``alpaca``: ``instruction``, optional ``input``, ``output`` with the standard Alpaca prompt;
  the response is trained.
- ``prompt_completion``: ``prompt`` + ``completion`` concatenated as is (put any separator in the
  data); the completion is trained.
- ``text``: plain language modelling, every token trained.
- ``preference``: ``prompt``, ``chosen``, ``rejected`` pairs for DPO / ORPO (``prompt`` optional:
  TRL's implicit-prompt form); tokenized as TRL's ``DPOTrainer`` does, by :mod:`.preference`, not
  through :func:`render_row`.

BOS: the non-chat formats prepend the tokenizer's BOS when the tokenizer itself adds one to plain
text (as Llama's do); chat templates write their own. EOS: appended (and trained with the answer) to
every non-chat sample, and to a chat sample whose rendering ends neither with ``eos_token`` nor with
the template's own end-of-turn token (the special token closing its assistant turns): no eos is
added after a template's end-of-turn, even where the tokenizer's eos is another token (Llama 3's
``<|eot_id|>`` vs ``<|end_of_text|>``), as in TRL.
With ``train_on_prompt`` every token of the text is trained.

``data.chat_template_kwargs`` (:data:`TemplateKwargs`: ``enable_thinking: false`` for Qwen3) are
passed to every render of a chat template, as TRL's ``chat_template_kwargs``: training and eval
rows, preference prompts and completions, generation prompts.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from nxd_finetune.assets import QWEN3_CHAT_TEMPLATE, QWEN3_TRAINING_CHAT_TEMPLATE
from nxd_finetune.errors import DataError
from nxd_finetune.loss import IGNORE_INDEX

FORMATS = ("messages", "alpaca", "prompt_completion", "text", "preference", "prompt")
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "preference": ("chosen", "rejected"),
    "prompt": ("prompt",),  # GRPO's prompts (data/prompts.py), read by its batch source, not the loaders
}
OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "alpaca": ("input",), "messages": ("role", "content"), "preference": ("prompt", "role", "content"),
}
ROLE_ALIASES = {"human": "user", "gpt": "assistant"}

TemplateValue = str | int | float | bool | None
TemplateKwargs = Mapping[str, TemplateValue]
"""``data.chat_template_kwargs``: variables every chat-template render sees (``enable_thinking``)."""
RESERVED_TEMPLATE_KWARGS = (
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
)
"""``apply_chat_template``'s own arguments (and the template's ``messages``): not template variables."""
Spans = list[tuple[int, int]]  # half-open character ranges of a rendering
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test for {% generation %}

ALPACA_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


@dataclass(frozen=True)
class Rendered:
    """A sample as text: ``spans`` are the trained ``[start, end)`` character ranges, in order."""

    text: str
    spans: tuple[tuple[int, int], ...]
    add_bos: bool = False
    add_eos: bool = True
    eos_trained: bool = True


def load_chat_template(value: str | None, base_dir: str | Path | None = None) -> str | None:
    """The recipe's ``chat_template``: a Jinja string, or a path to a file holding one.

    A value containing ``{{`` or ``{%`` is a template; anything else must be an existing file
    (relative paths are taken from ``base_dir``), else DataError.
    """
    if value is None or "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    if not path.is_file():
        raise DataError(f"data.chat_template: {value!r} is neither a Jinja template nor an existing file")
    return path.read_text(encoding="utf-8")


def template_kwargs_problem(value: object, name: str = "data.chat_template_kwargs") -> str | None:
    """Why ``value`` is not a :data:`TemplateKwargs` mapping (names to strings, numbers, booleans or
    null, none of them an argument of ``apply_chat_template``), as one line; None when it is one."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return f"{name} must be a mapping of template variables (e.g. enable_thinking: false), got {value!r}"[:300]
    for key, item in value.items():
        if not isinstance(key, str) or not key.isidentifier():
            return f"{name}: {key!r} is not a template variable name"
        if key in RESERVED_TEMPLATE_KWARGS:
            return f"{name}.{key} is an argument of apply_chat_template, not a template variable"
        if item is not None and not isinstance(item, (str, int, float, bool)):
            return (f"{name}.{key} must be a string, number, true/false or null, "
                    f"got {type(item).__name__} {item!r}"[:300])
    return None


def render_chat(
    tokenizer, messages: Sequence[Mapping], chat_template: str | None = None, add_generation_prompt: bool = False,
    template_kwargs: TemplateKwargs | None = None,
) -> str:
    """``messages`` rendered to text with ``chat_template`` or the tokenizer's own template, the
    template seeing ``template_kwargs`` as variables."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise DataError("the tokenizer has no chat template; set data.chat_template (a Jinja string or file)")
    try:
        return tokenizer.apply_chat_template(
            list(messages),
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **dict(template_kwargs or {}),
        )
    except Exception as e:  # jinja errors, template-raised exceptions
        raise DataError(f"chat template failed: {type(e).__name__}: {e}".splitlines()[0]) from e


def _marked_turns(tokenizer, messages: Sequence[Mapping], chat_template: str | None,
                  template_kwargs: TemplateKwargs | None) -> tuple[str, Spans] | None:
    """The rendering and its ``{% generation %}`` blocks (character ranges), as
    ``apply_chat_template(return_assistant_tokens_mask=True)`` finds them; None when the template
    has no such markers."""
    try:
        template = tokenizer.get_chat_template(chat_template)
    except ValueError as e:
        raise DataError(f"chat template: {e}".splitlines()[0]) from e
    if not _GENERATION_TAG.search(template):
        return None
    # transformers' renderer of apply_chat_template (imported here: formats is read by the recipe's
    # validation, which does not load transformers)
    from transformers.utils.chat_template_utils import render_jinja_template

    variables = {**tokenizer.special_tokens_map, **dict(template_kwargs or {})}
    try:  # (rendered texts, their generation blocks) per conversation; transformers annotates it as str
        texts, indices = cast(Any, render_jinja_template(conversations=[[dict(m) for m in messages]],
                                                         chat_template=template, return_assistant_tokens_mask=True,
                                                         **variables))
    except Exception as e:  # jinja errors, template-raised exceptions
        raise DataError(f"chat template failed: {type(e).__name__}: {e}".splitlines()[0]) from e
    return texts[0], [(int(a), int(b)) for a, b in indices[0] if b > a]


# released chat templates -> TRL's training variants (trl/chat_templates: qwen3.jinja -> qwen3_training.jinja)
TRAINING_TEMPLATES: tuple[tuple[Path, Path], ...] = ((QWEN3_CHAT_TEMPLATE, QWEN3_TRAINING_CHAT_TEMPLATE),)


@functools.cache
def _training_templates() -> dict[str, str]:
    return {a.read_text(encoding="utf-8"): b.read_text(encoding="utf-8") for a, b in TRAINING_TEMPLATES}


def training_chat_template(tokenizer, chat_template: str | None) -> str | None:
    """The template a conversation is rendered with for training: TRL's training variant when
    ``chat_template`` (None: the tokenizer's own) is a released template TRL swaps (the same text),
    else ``chat_template`` unchanged."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named variants: the default one
        template = template.get("default")
    if isinstance(template, str):
        return _training_templates().get(template, chat_template)
    return chat_template


def resolve_columns(column_names: Sequence[str], fmt: str, fields: Mapping[str, str] | None) -> dict[str, str]:
    """Canonical field name -> dataset column (or message key) for ``fmt``.

    Raises DataError for an unknown format, an unknown key in ``fields``, or a required column that
    the dataset lacks (listing the available columns).
    """
    if fmt not in FORMATS:
        raise DataError(f"unknown data.format {fmt!r}; use one of {', '.join(FORMATS)}")
    fields = dict(fields or {})
    known = REQUIRED_FIELDS[fmt] + OPTIONAL_FIELDS.get(fmt, ())
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise DataError(f"data.fields: {', '.join(unknown)} not used by format {fmt!r} (it uses {', '.join(known)})")
    columns = {name: fields.get(name, name) for name in known}
    missing = [f"{columns[n]!r}" for n in REQUIRED_FIELDS[fmt] if columns[n] not in column_names]
    if missing:
        raise DataError(
            f"format {fmt!r} needs column(s) {', '.join(missing)}; the dataset has: "
            f"{', '.join(column_names) or '(none)'} (map them with data.fields)"
        )
    if fmt == "alpaca" and columns["input"] not in column_names:
        columns.pop("input")
    if fmt == "preference" and columns["prompt"] not in column_names:
        if "prompt" in fields:
            raise DataError(f"data.fields.prompt names column {fields['prompt']!r}; the dataset has: "
                            f"{', '.join(column_names)}")
        columns.pop("prompt")  # TRL's implicit prompt: the turns chosen and rejected share
    return columns


def normalize_messages(raw: object, columns: Mapping[str, str]) -> list[dict[str, str]]:
    role_key, content_key = columns["role"], columns["content"]
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise DataError(f"messages must be a list of {{{role_key}, {content_key}}} dicts, got {type(raw).__name__}")
    messages = []
    for m in raw:
        if not isinstance(m, Mapping) or role_key not in m or content_key not in m:
            raise DataError(f"each message needs keys {role_key!r} and {content_key!r}; got {m!r}"[:300])
        role = ROLE_ALIASES.get(m[role_key], m[role_key])
        messages.append({"role": role, "content": m[content_key]})
    return messages


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens as text (eos, bos, additional and added special tokens)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            found.add(str(token.content))
    return tuple(sorted(t for t in found if t))


def _turn_end(through: str, start: int, specials: tuple[str, ...]) -> int:
    """Where an assistant turn's trained span ends: the end of ``through``, less the whitespace the
    template prints after a closing special token (TRL's assistant mask stops at that token)."""
    stripped = through.rstrip()
    if len(stripped) > start and stripped.endswith(specials):
        return len(stripped)
    return len(through)


def _without_closing_eos(rendered: str, eos: str | None, specials: tuple[str, ...]) -> str:
    """``rendered`` less the eos a template prints after the whole conversation when no generation
    prompt is asked for, after the turn's own closing special token (Phi-3: ``<|end|>\n<|endoftext|>``):
    it closes the conversation, not the turn, so a turn's span and the prefix test stop before it, as
    TRL's assistant mask does. An eos right after the answer (Mistral's ``</s>``) is the turn's end
    and stays."""
    if not eos or not rendered.endswith(eos):
        return rendered
    head = rendered[: -len(eos)]
    return head if head.rstrip().endswith(tuple(t for t in specials if t != eos)) else rendered


def _prefix_turns(tokenizer, messages: list[dict[str, str]], chat_template: str | None,
                  template_kwargs: TemplateKwargs | None, specials: tuple[str, ...]) -> tuple[str, Spans]:
    """The rendering and its assistant turns located prefix by prefix (the module docstring)."""

    def render(part: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return render_chat(tokenizer, part, chat_template, add_generation_prompt, template_kwargs)

    text = render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            before = render(messages[:i], add_generation_prompt=True)
        except DataError:
            if i:
                raise
            # conversation opens with the assistant and the template cannot render zero messages:
            # the turn starts where its content does
            found = render(messages[:1]).find(str(message["content"]))
            before = render(messages[:1])[: max(found, 0)]
        through = _without_closing_eos(render(messages[: i + 1]), tokenizer.eos_token, specials)
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(
                "the chat template renders conversation prefixes inconsistently (turn "
                f"{i} is not a prefix of the full rendering), so assistant turns cannot be located; "
                "set data.chat_template to a prefix-stable template"
            )
        spans.append((len(before), _turn_end(through, len(before), specials)))
    return text, spans


def _render_messages(
    row: Mapping, columns: Mapping[str, str], tokenizer, chat_template: str | None, train_on_prompt: bool,
    template_kwargs: TemplateKwargs | None = None,
) -> Rendered:
    messages = normalize_messages(row[columns["messages"]], columns)
    chat_template = training_chat_template(tokenizer, chat_template)
    specials = special_tokens(tokenizer)
    marked = _marked_turns(tokenizer, messages, chat_template, template_kwargs)
    if marked is not None:
        text, blocks = marked
        spans = [(start, _turn_end(text[:end], start, specials)) for start, end in blocks]
    else:
        text, spans = _prefix_turns(tokenizer, messages, chat_template, template_kwargs, specials)
    eos = tokenizer.eos_token
    end_of_turn = _closing_specials(text, spans, specials)
    add_eos = bool(eos) and not text.rstrip().endswith((eos, *end_of_turn))
    ends_with_answer = bool(messages) and messages[-1]["role"] == "assistant"
    if train_on_prompt:
        spans = [(0, len(text))]
    return Rendered(text, tuple(spans), add_bos=False, add_eos=add_eos, eos_trained=ends_with_answer or train_on_prompt)


def _closing_specials(text: str, spans: Sequence[tuple[int, int]], specials: tuple[str, ...]) -> tuple[str, ...]:
    """The template's own end-of-turn tokens: the special tokens that close its assistant turns."""
    return tuple(t for t in specials if any(text[:end].endswith(t) for _, end in spans))


# a one-turn conversation whose rendering shows how the template closes an assistant turn
_PROBE = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


def end_of_turn_tokens(tokenizer, chat_template: str | None = None,
                       template_kwargs: TemplateKwargs | None = None) -> tuple[str, ...]:
    """The special tokens ``chat_template`` (None: the tokenizer's) closes an assistant turn with
    (Gemma's ``<end_of_turn>``, ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Mistral's
    ``</s>``), found as training finds them (:func:`render_row` on a one-turn conversation); ()
    when the template closes its turns with no special token or cannot render that conversation."""
    try:
        rendered = _render_messages(_PROBE, {"messages": "messages", "role": "role", "content": "content"},
                                    tokenizer, chat_template, False, template_kwargs)
    except DataError:
        return ()
    return _closing_specials(rendered.text, rendered.spans, special_tokens(tokenizer))


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer prepends BOS to plain text by itself (Llama does, Qwen does not)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def render_row(
    row: Mapping,
    fmt: str,
    columns: Mapping[str, str],
    tokenizer,
    chat_template: str | None = None,
    train_on_prompt: bool = False,
    add_bos: bool | None = None,
    template_kwargs: TemplateKwargs | None = None,
) -> Rendered:
    """One dataset row as a :class:`Rendered` sample (see the module docstring for each format).

    ``add_bos`` (non-chat formats): prepend BOS; None asks the tokenizer (:func:`adds_bos`).
    ``template_kwargs``: the chat template's variables (``data.chat_template_kwargs``).
    """
    if fmt == "messages":
        return _render_messages(row, columns, tokenizer, chat_template, train_on_prompt, template_kwargs)
    if add_bos is None:
        add_bos = adds_bos(tokenizer)
    if fmt == "text":
        text = str(row[columns["text"]])
        return Rendered(text, ((0, len(text)),), add_bos=add_bos)
    if fmt == "alpaca":
        values = {
            "instruction": row[columns["instruction"]],
            "input": row[columns["input"]] if "input" in columns else "",
        }
        template = ALPACA_PROMPT if values["input"] else ALPACA_PROMPT_NO_INPUT
        prompt, answer = template.format(**values), str(row[columns["output"]])
    else:
        prompt, answer = str(row[columns["prompt"]]), str(row[columns["completion"]])
    text = prompt + answer
    start = 0 if train_on_prompt else len(prompt)
    return Rendered(text, ((start, len(text)),), add_bos=add_bos)


def _label_tokens(
    ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[int]:
    """Token ``i`` keeps its id as label iff ``offsets[i]`` overlaps a span, else -100."""
    labels = []
    k = 0
    for tok, (start, end) in zip(ids, offsets, strict=True):
        while k < len(spans) and spans[k][1] <= start:  # spans wholly before this token
            k += 1
        # spans[k] ends after ``start``; it overlaps the token iff it starts before the token ends
        # (a zero-width token counts as the single character at ``start``)
        trained = k < len(spans) and spans[k][0] < max(end, start + 1)
        labels.append(tok if trained else IGNORE_INDEX)
    return labels


def tokenize_rendered(tokenizer, samples: Sequence[Rendered]) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` for each sample, untruncated; one batched tokenizer call.

    Needs a fast (Rust) tokenizer for character offsets; a slow one raises DataError.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{type(tokenizer).__name__} is a slow tokenizer; SFT needs a fast one (tokenizer.json)")
    if not samples:
        return []
    # verbose=False: rows longer than the tokenizer's model_max_length are ours to truncate (to
    # data.max_seq_len, counted in the summary); no "Token indices sequence length" line from transformers
    enc = tokenizer([s.text for s in samples], add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    out = []
    for sample, ids, offsets in zip(samples, enc["input_ids"], enc["offset_mapping"], strict=True):
        ids = list(ids)
        labels = _label_tokens(ids, offsets, sample.spans)
        if sample.add_bos:
            ids.insert(0, tokenizer.bos_token_id)
            labels.insert(0, IGNORE_INDEX)
        if sample.add_eos and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
            labels.append(tokenizer.eos_token_id if sample.eos_trained else IGNORE_INDEX)
        out.append((ids, labels))
    return out

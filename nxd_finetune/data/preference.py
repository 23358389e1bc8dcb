"""Preference pairs (DPO / ORPO): dataset rows -> prompt, chosen and rejected token ids, exactly as
TRL's trainer of the objective makes them, then one training sequence per completion. DPO
(``sigmoid``, ``ipo``, ``hinge``) as ``DPOTrainer`` (``_prepare_dataset`` and
``DataCollatorForPreference``, TRL 1.x); ORPO and SimPO as ``ORPOTrainer`` / ``CPOTrainer`` (their
common ``tokenize_row``), see "ORPO and SimPO" below (``trl_tokenization``: ``dpo`` / ``orpo``).

Forms of a row (``data.fields`` maps ``prompt`` / ``chosen`` / ``rejected`` to column names, and
``role`` / ``content`` to message keys as for ``messages``):

- standard: three strings. The completions get the tokenizer's eos text appended unless they end
  with it, and ``prompt``, ``prompt + chosen``, ``prompt + rejected`` are tokenized as plain text
  with the tokenizer's special tokens (BOS where the tokenizer adds one).
- conversational: ``prompt`` a list of messages, ``chosen`` / ``rejected`` lists holding the
  answer turn(s). Rendered with the chat template: the prompt with the generation prompt, the
  conversations ``prompt + chosen`` / ``prompt + rejected`` without; no eos is added.
- implicit prompt (no ``prompt`` column): ``chosen`` and ``rejected`` hold the whole conversation (or
  text); the prompt is their common leading turns (characters), as TRL's ``extract_prompt``.

The completion's tokens are those after the longest common token prefix of the prompt's tokens and
each full sequence's (TRL: templates that render a prompt alone differently, merges across the
join); that is the whole of what the template prints after the prompt, end-of-turn and what follows
it included (TRL's DPO mask, unlike the ``messages`` format's assistant mask). Truncation:
``max_prompt_length`` keeps the prompt's last tokens (TRL 0.x; TRL 1.x has no such setting); a
pair whose prompt fills ``max_seq_len`` is dropped under ``keep_start`` (as TRL); each sequence
longer than ``max_seq_len`` keeps its first (``keep_start``) or last (``keep_end``) tokens.

ORPO and SimPO (``trl_tokenization: orpo``): TRL's ``ORPOTrainer`` and ``CPOTrainer`` render a
conversation to text first (``maybe_apply_chat_template``: the prompt with the generation prompt, or
continuing a final assistant turn; the completions are what ``prompt + chosen`` / ``prompt +
rejected`` print after the characters the three renderings share), then tokenize text without
special tokens (``tokenize_row``): a completion starts after the prompt's tokens (one token earlier
where the last prompt token merged across the join), the tokenizer's bos goes before each prompt
that does not start with it, and its eos after each completion that does not end with it, for
conversations too: after ChatML's ``<|im_end|>\n`` comes the eos (``DPOTrainer`` adds none to
conversations). Truncation stays the rule above for every objective (``ORPOTrainer`` cuts the
completion at ``max_length`` and keeps a pair whose prompt alone fills it, with an empty completion).

A row with a field missing, chosen equal to rejected, an empty completion or mixed forms is one
DataError line naming the row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from nxd_finetune.data.formats import TemplateKwargs, TemplateValue, normalize_messages, render_chat
from nxd_finetune.errors import DataError
from nxd_finetune.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRUNCATION_MODES = ("keep_start", "keep_end")
TRL_TOKENIZATIONS = ("dpo", "orpo")  # TRL's DPOTrainer; ORPOTrainer and CPOTrainer (the same tokenize_row)
Completion = str | list[dict[str, str]]
Sample = tuple[list[int], list[int]]  # input_ids, labels (HF-aligned, -100 on the prompt)
Split = tuple[list[int], list[int]]  # a sequence's prompt ids and completion ids


class PreferenceSettings(Protocol):
    """The settings that change a pair's tokens (``data.datasets.DataSpec`` has them)."""

    chat_template_kwargs: dict[str, TemplateValue] | None
    max_seq_len: int
    max_prompt_length: int | None
    truncation_mode: str
    trl_tokenization: str


@dataclass(frozen=True)
class Pair:
    """One row read: ``prompt``, ``chosen``, ``rejected`` all strings or all message lists."""

    prompt: Completion
    chosen: Completion
    rejected: Completion

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


def extract_prompt(chosen: Completion, rejected: Completion) -> tuple[Completion, Completion, Completion]:
    """TRL's ``extract_prompt``: the leading elements (characters or messages) the two share become
    the prompt, a space before the split staying with the completions. As in TRL, when one is a
    prefix of the other the split is at the shorter one's last element."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _value(row: Mapping, column: str, what: str, where: str) -> Any:
    value = row.get(column)
    if value is None:
        raise DataError(f"{where}: no {what!r} (column {column!r} is missing or null)")
    return value


def _empty(value: Completion) -> bool:
    if isinstance(value, str):
        return not value.strip()
    return not any(str(m["content"]).strip() for m in value)


def read_pair(row: Mapping, columns: Mapping[str, str], where: str) -> Pair:
    """The row's pair (implicit prompts extracted, messages normalized); DataError naming ``where``
    (e.g. ``data.train row 7``) for a missing field, mixed forms, chosen equal to rejected or an
    empty completion."""
    names = ("prompt", "chosen", "rejected") if "prompt" in columns else ("chosen", "rejected")
    values = {name: _value(row, columns[name], name, where) for name in names}
    kinds = {name: isinstance(v, str) for name, v in values.items()}
    for name, v in values.items():
        if not isinstance(v, (str, list)):
            raise DataError(f"{where}: {name!r} is {type(v).__name__}; expected a string or a list of messages")
    if len(set(kinds.values())) > 1:
        raise DataError(f"{where}: mix of strings ({', '.join(n for n, s in kinds.items() if s)}) and message lists "
                        f"({', '.join(n for n, s in kinds.items() if not s)}); use one form")
    if not kinds["chosen"]:
        try:
            values = {name: normalize_messages(v, columns) for name, v in values.items()}
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
    if values["chosen"] == values["rejected"]:
        raise DataError(f"{where}: chosen and rejected are the same")
    if "prompt" in values:
        prompt, chosen, rejected = values["prompt"], values["chosen"], values["rejected"]
    else:
        prompt, chosen, rejected = extract_prompt(values["chosen"], values["rejected"])
    for name, completion in (("chosen", chosen), ("rejected", rejected)):
        if _empty(completion):
            raise DataError(f"{where}: the {name} completion is empty")
    return Pair(prompt, chosen, rejected)


def row_problem(row: Mapping, columns: Mapping[str, str]) -> str | None:
    """What :func:`read_pair` refuses in ``row``, without the row's name (``validate``); None if fine."""
    try:
        read_pair(row, columns, "")
    except DataError as e:
        return str(e).removeprefix(": ")
    return None


def _common_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize_pairs(tokenizer: PreTrainedTokenizerBase, pairs: Sequence[Pair], chat_template: str | None = None,
                   template_kwargs: TemplateKwargs | None = None,
                   trl_tokenization: str = "dpo") -> list[tuple[Split, Split]]:
    """``((prompt_ids, chosen_ids), (prompt_ids, rejected_ids))`` of each pair, untruncated, as
    TRL's ``DPOTrainer`` (``dpo``: its dataset columns, one prompt for both) or ``ORPOTrainer`` /
    ``CPOTrainer`` (``orpo``: :func:`_orpo_pairs`) makes them. Two batched tokenizer calls for
    ``dpo`` (plain text with special tokens; rendered chats without, as
    ``apply_chat_template(tokenize=True)``, the template seeing ``template_kwargs`` as TRL's
    ``chat_template_kwargs``)."""
    if trl_tokenization == "orpo":
        return _orpo_pairs(tokenizer, pairs, chat_template, template_kwargs)
    eos = tokenizer.eos_token
    texts: list[list[str]] = []
    for pair in pairs:
        if isinstance(pair.prompt, list):
            texts.append([render_chat(tokenizer, pair.prompt, chat_template, True, template_kwargs),
                          *(render_chat(tokenizer, pair.prompt + c, chat_template, False, template_kwargs)
                            for c in (pair.chosen, pair.rejected) if isinstance(c, list))])
        else:
            ends = [str(c) if not eos or str(c).endswith(eos) else str(c) + eos for c in (pair.chosen, pair.rejected)]
            texts.append([pair.prompt, pair.prompt + ends[0], pair.prompt + ends[1]])
    encoded: list[list[list[int]]] = [[] for _ in pairs]
    for chat in (False, True):
        which = [i for i, pair in enumerate(pairs) if pair.conversational == chat]
        if which:
            flat = tokenizer([t for i in which for t in texts[i]], add_special_tokens=not chat,
                             verbose=False)["input_ids"]
            for k, i in enumerate(which):
                encoded[i] = [list(ids) for ids in flat[3 * k:3 * k + 3]]
    out = []
    for prompt_ids, with_chosen, with_rejected in encoded:
        n = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
        out.append(((prompt_ids[:n], with_chosen[n:]), (prompt_ids[:n], with_rejected[n:])))
    return out


def _orpo_texts(tokenizer: PreTrainedTokenizerBase, pair: Pair, chat_template: str | None,
                template_kwargs: TemplateKwargs | None) -> tuple[str, str, str]:
    """``(prompt, chosen, rejected)`` as text: TRL's ``maybe_apply_chat_template`` for a
    conversation (the prompt continues a final assistant turn, else ends with the generation
    prompt; the completions are what follows the characters the three renderings share)."""
    if not isinstance(pair.prompt, list):
        return pair.prompt, str(pair.chosen), str(pair.rejected)
    if pair.prompt and pair.prompt[-1].get("role") == "assistant":
        # apply_chat_template's own argument, reached through the template keyword arguments
        prompt = render_chat(tokenizer, pair.prompt, chat_template, False,
                             {**(template_kwargs or {}), "continue_final_message": True})
    else:
        prompt = render_chat(tokenizer, pair.prompt, chat_template, True, template_kwargs)
    full = [render_chat(tokenizer, pair.prompt + c, chat_template, False, template_kwargs)
            for c in (pair.chosen, pair.rejected) if isinstance(c, list)]
    n = min(_common_prefix(prompt, full[0]), _common_prefix(prompt, full[1]))
    return prompt[:n], full[0][n:], full[1][n:]


def _orpo_pairs(tokenizer: PreTrainedTokenizerBase, pairs: Sequence[Pair], chat_template: str | None,
                template_kwargs: TemplateKwargs | None) -> list[tuple[Split, Split]]:
    """TRL's ``ORPOTrainer.tokenize_row`` (``CPOTrainer``'s is the same) on :func:`_orpo_texts`:
    text without special tokens (one batched call); a completion starts after the prompt's tokens,
    one earlier where the prompt's last token merged across the join (``build_tokenized_answer``);
    bos before a prompt that does not start with it, eos after a completion that does not end
    with it."""
    texts = [_orpo_texts(tokenizer, pair, chat_template, template_kwargs) for pair in pairs]
    flat = tokenizer([t for p, c, r in texts for t in (p, p + c, p + r)], add_special_tokens=False,
                     verbose=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = []
    for k in range(len(pairs)):
        prompt_ids = list(flat[3 * k])
        splits = []
        for full in (list(flat[3 * k + 1]), list(flat[3 * k + 2])):
            start = len(prompt_ids) if full[:len(prompt_ids)] == prompt_ids else len(prompt_ids) - 1
            prompt, completion = full[:start], full[start:]
            if bos is not None and (not prompt or prompt[0] != bos):
                prompt = [bos, *prompt]
            if eos is not None and (not completion or completion[-1] != eos):
                completion = [*completion, eos]
            splits.append((prompt, completion))
        out.append((splits[0], splits[1]))
    return out


def pair_samples(chosen: Split, rejected: Split, settings: PreferenceSettings) -> tuple[Sample, Sample, bool] | None:
    """The chosen and the rejected training sequence of a pair (each a prompt and a completion)
    and whether either was truncated; None when the pair is dropped (a prompt fills
    ``max_seq_len`` under ``keep_start``)."""
    limit, keep_start = settings.max_seq_len, settings.truncation_mode == "keep_start"
    samples = []
    truncated = False
    for prompt_ids, completion in (chosen, rejected):
        if settings.max_prompt_length is not None:
            prompt_ids = prompt_ids[-settings.max_prompt_length:]
        if keep_start and len(prompt_ids) >= limit:
            return None
        ids = prompt_ids + completion
        labels = [IGNORE_INDEX] * len(prompt_ids) + completion
        if len(ids) > limit:
            truncated = True
            cut = slice(None, limit) if keep_start else slice(-limit, None)
            ids, labels = ids[cut], labels[cut]
        samples.append((ids, labels))
    return samples[0], samples[1], truncated


def tokenize_chunk(rows: Sequence[Mapping], first: int, columns: Mapping[str, str], tokenizer: PreTrainedTokenizerBase,
                   chat_template: str | None, settings: PreferenceSettings,
                   split: str) -> tuple[list[Sample], int, int]:
    """Rows ``first, first + 1, ...`` of ``split``: their kept sequences (chosen then rejected of
    each kept pair), the number of pairs truncated and the number dropped."""
    pairs = [read_pair(row, columns, f"{split} row {first + k + 1}") for k, row in enumerate(rows)]
    samples: list[Sample] = []
    truncated = dropped = 0
    tokenized = tokenize_pairs(tokenizer, pairs, chat_template, settings.chat_template_kwargs,
                               settings.trl_tokenization)
    for k, (chosen, rejected) in enumerate(tokenized):
        if not chosen[1] or not rejected[1]:
            raise DataError(f"{split} row {first + k + 1}: a completion has no token of its own after the prompt")
        got = pair_samples(chosen, rejected, settings)
        if got is None:
            dropped += 1
            continue
        samples += [got[0], got[1]]
        truncated += got[2]
    return samples, truncated, dropped

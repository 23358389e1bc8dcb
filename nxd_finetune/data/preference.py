"""Preference pairs (DPO / ORPO): dataset rows -> prompt, chosen and rejected token ids, exactly as
TRL's ``DPOTrainer`` makes them (``_prepare_dataset`` and ``DataCollatorForPreference``, TRL 1.x),
then one training sequence per completion.

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
Completion = str | list[dict[str, str]]
Sample = tuple[list[int], list[int]]  # input_ids, labels (HF-aligned, -100 on the prompt)


class PreferenceSettings(Protocol):
    """The settings that change a pair's tokens (``data.datasets.DataSpec`` has them)."""

    chat_template_kwargs: dict[str, TemplateValue] | None
    max_seq_len: int
    max_prompt_length: int | None
    truncation_mode: str


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


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def tokenize_pairs(tokenizer: PreTrainedTokenizerBase, pairs: Sequence[Pair], chat_template: str | None = None,
                   template_kwargs: TemplateKwargs | None = None) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` of each pair, untruncated: TRL's ``DPOTrainer``
    dataset columns. Two batched tokenizer calls (plain text with special tokens; rendered chats
    without, as ``apply_chat_template(tokenize=True)``, the template seeing ``template_kwargs`` as
    TRL's ``chat_template_kwargs``)."""
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
        out.append((prompt_ids[:n], with_chosen[n:], with_rejected[n:]))
    return out


def pair_samples(prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int],
                 settings: PreferenceSettings) -> tuple[Sample, Sample, bool] | None:
    """The chosen and the rejected training sequence of a pair and whether either was truncated;
    None when the pair is dropped (its prompt fills ``max_seq_len`` under ``keep_start``)."""
    if settings.max_prompt_length is not None:
        prompt_ids = prompt_ids[-settings.max_prompt_length:]
    limit, keep_start = settings.max_seq_len, settings.truncation_mode == "keep_start"
    if keep_start and len(prompt_ids) >= limit:
        return None
    samples = []
    truncated = False
    for completion in (chosen_ids, rejected_ids):
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
    tokenized = tokenize_pairs(tokenizer, pairs, chat_template, settings.chat_template_kwargs)
    for k, (prompt_ids, chosen_ids, rejected_ids) in enumerate(tokenized):
        if not chosen_ids or not rejected_ids:
            raise DataError(f"{split} row {first + k + 1}: a completion has no token of its own after the prompt")
        got = pair_samples(prompt_ids, chosen_ids, rejected_ids, settings)
        if got is None:
            dropped += 1
            continue
        samples += [got[0], got[1]]
        truncated += got[2]
    return samples, truncated, dropped

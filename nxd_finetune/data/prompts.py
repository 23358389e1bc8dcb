"""The ``prompt`` data format (GRPO): rows whose ``prompt`` column is a string or a list of
messages, tokenized as TRL 1.x's ``GRPOTrainer`` does -- a string by the tokenizer as it is (its
BOS included), messages through the chat template with the generation prompt (the template writes
any BOS itself) -- and cut to their last ``max_prompt_length`` tokens when longer. Every other
column of a row is kept, for the reward functions (they get it by name)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import cast

from transformers import PreTrainedTokenizerBase

from nxd_finetune.data.datasets import jsonl_values, load_rows, resolve_sources
from nxd_finetune.data.formats import TemplateKwargs, normalize_messages, render_chat
from nxd_finetune.errors import DataError

PromptValue = str | list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """A row of ``prompt`` data: the prompt as written (string or messages), its token ids, and the
    row's other columns."""

    prompt: PromptValue
    ids: list[int]
    columns: dict[str, object]


def load_prompt_data(spec: str | Sequence[str], base_dir: str | Path | None = None) -> Sequence[Mapping[str, object]]:
    """The rows of prompt data (``data.train``). Local ``.jsonl`` files are read here, as
    ``datasets`` reads them (a column some rows lack is None in those), which keeps ``datasets``
    and what it imports (pandas, pyarrow, scipy: ~110 MB resident) out of a GRPO run; any other
    source through :func:`~nxd_finetune.data.datasets.load_rows`. DataError: a line that is not a
    JSON object, sources whose columns differ."""
    sources = resolve_sources(spec, base_dir)
    if not sources or not all(s.lower().endswith(".jsonl") and Path(s).is_file() for s in sources):
        return load_rows(spec, base_dir)
    parts = [_jsonl_objects(Path(s)) for s in sources]
    columns = [list(dict.fromkeys(key for row in part for key in row)) for part in parts]
    if any(set(c) != set(columns[0]) for c in columns[1:]):
        raise DataError(f"data sources {', '.join(sources)} do not share the same columns")
    return [{key: row.get(key) for key in columns[0]} for part in parts for row in part]


def _jsonl_objects(path: Path) -> list[dict[str, object]]:
    try:
        rows = jsonl_values(path)
    except ValueError as e:  # the line datasets' path gives (load_rows)
        raise DataError(f"cannot load dataset {str(path)!r}: {e}") from None
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"cannot load dataset {str(path)!r}: row {n}: not a JSON object")
    return cast(list[dict[str, object]], rows)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: PromptValue, chat_template: str | None = None,
                  template_kwargs: TemplateKwargs | None = None) -> list[int]:
    """A prompt's token ids (see the module docstring)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    rendered = render_chat(tokenizer, prompt, chat_template, True, template_kwargs)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def prompt_rows(rows: Iterable[Mapping[str, object]], tokenizer: PreTrainedTokenizerBase, column: str = "prompt",
                chat_template: str | None = None, template_kwargs: TemplateKwargs | None = None,
                max_prompt_length: int | None = None) -> list[PromptRow]:
    """``rows`` (a ``datasets.Dataset`` or mappings) as :class:`PromptRow` s; DataError (one line,
    the row's index) for a row without ``column``, a prompt that is neither a string nor a list of
    ``{role, content}`` messages, or an empty one."""
    out = []
    for index, row in enumerate(rows):
        if column not in row:
            raise DataError(f"prompt data row {index} has no column {column!r} (columns: {', '.join(row) or 'none'}; "
                            "map another with data.fields.prompt)")
        prompt = _prompt_value(row[column], index)
        ids = encode_prompt(tokenizer, prompt, chat_template, template_kwargs)
        if max_prompt_length is not None:
            ids = ids[-max_prompt_length:]
        out.append(PromptRow(prompt, ids, {k: v for k, v in row.items() if k != column}))
    return out


def _prompt_value(raw: object, index: int) -> PromptValue:
    if isinstance(raw, str):
        if not raw:
            raise DataError(f"prompt data row {index}: the prompt is empty")
        return raw
    if not isinstance(raw, Sequence) or not raw:
        raise DataError(f"prompt data row {index}: a prompt is a string or a non-empty list of messages, "
                        f"got {type(raw).__name__}")
    try:
        return normalize_messages(raw, {"role": "role", "content": "content"})
    except DataError as e:
        raise DataError(f"prompt data row {index}: {e}") from None


def columns_of(rows: Sequence[PromptRow], repeat: int = 1) -> dict[str, list[object]]:
    """The rows' other columns by name, each value repeated ``repeat`` times (a prompt's group of
    completions): what reward functions get as keyword arguments."""
    names = list(rows[0].columns) if rows else []
    return {name: [row.columns.get(name) for row in rows for _ in range(repeat)] for name in names}

"""Data checks of ``validate``: read the first rows of every local data file (JSON lines or array,
CSV, Parquet, Arrow / ``save_to_disk``; the file types ``data.datasets`` reads) without converting
the whole file, and check that they fit ``data.format`` and ``data.fields``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nxd_finetune.data.datasets import DataSpec, prepare_datasets
from nxd_finetune.data.formats import resolve_columns
from nxd_finetune.data.inputs import load_tokenizer
from nxd_finetune.data.packing import make_rows
from nxd_finetune.data.preference import row_problem as pair_problem
from nxd_finetune.errors import DataError
from nxd_finetune.loss import IGNORE_INDEX
from nxd_finetune.storage.cache import data_cache
from nxd_finetune.storage.fetch import fetch_object
from nxd_finetune.storage.schemes import data_scheme

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe


def _data_sources(key: str, spec: str | list[str], fetch_dir: Path) -> list[Path]:
    """The local files or ``save_to_disk`` directories behind ``data.<key>`` (the sources
    ``data.datasets.load_rows`` reads): ``s3://`` objects (any scheme whose data files are
    fetched) fetched into ``fetch_dir`` as ``run`` fetches them; other remote ones (``hf://...``)
    are reported and skipped."""
    sources: list[Path] = []
    for item in [spec] if isinstance(spec, str) else spec:
        if data_scheme(item) is not None:
            sources.append(fetch_object(item, fetch_dir))
            continue
        if "://" in item:
            print(f"note: data.{key} {item} is remote; not checked", file=sys.stderr)
            continue
        path = Path(item)
        if not path.exists():
            raise DataError(f"data.{key}: not found: {path}")
        sources.append(path)
    return sources


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def _rows_jsonl(path: Path, n: int) -> list[dict]:
    import json

    rows = []
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):  # a JSON array, not JSON lines
            data = json.load(f)
            return data[:n] if isinstance(data, list) else [data]
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            if len(rows) >= n:
                break
    return rows


def _rows_csv(path: Path, n: int) -> list[dict]:
    import csv
    import itertools

    with path.open(encoding="utf-8", newline="") as f:
        return list(itertools.islice(csv.DictReader(f), n))


def _rows_parquet(path: Path, n: int) -> list[dict]:
    import pyarrow.parquet as pq

    batch = next(pq.ParquetFile(path).iter_batches(batch_size=n), None)
    return batch.to_pylist() if batch is not None else []


def _rows_arrow(path: Path, n: int) -> list[dict]:
    import datasets

    if path.is_dir():  # a save_to_disk directory
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(f"{path} holds splits {', '.join(loaded)}; expected a 'train' split")
            loaded = loaded["train"]
    else:
        loaded = datasets.Dataset.from_file(str(path))
    return loaded.select(range(min(n, len(loaded)))).to_list()


# the file types of data.datasets.LOCAL_BUILDERS, read a few rows at a time (no full conversion)
_READERS = {".jsonl": _rows_jsonl, ".json": _rows_jsonl, ".csv": _rows_csv, ".parquet": _rows_parquet,
            ".arrow": _rows_arrow}


def check_data(recipe: Recipe, key: str, spec: str | list[str], n_rows: int = 5) -> None:
    """Read the first rows of every file of ``data.<key>`` and check they fit ``data.format``:
    the mapped columns exist (``data.formats.resolve_columns``) and hold the right kind of value.
    Raises DataError naming the file and row."""
    fmt = recipe.data.format
    fetch_dir = Path(recipe.data.cache_dir).expanduser() if recipe.data.cache_dir else data_cache()
    for path in _data_sources(key, spec, fetch_dir):
        reader = _rows_arrow if path.is_dir() else _READERS.get(path.suffix.lower())
        if reader is None:
            raise DataError(f"data.{key}: {path}: unsupported file type; use {', '.join(_READERS)}")
        try:
            rows = reader(path, n_rows)
        except DataError:
            raise
        except Exception as e:  # parse errors of csv/parquet/arrow/json: one line naming the file
            raise DataError(f"data.{key}: cannot read {path}: {type(e).__name__}: {first_line(e)}") from None
        if not rows:
            raise DataError(f"data.{key}: {path} is empty")
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                raise DataError(f"data.{key}: {path} row {i} is {type(row).__name__}, not an object")
            try:
                columns = resolve_columns(list(row), fmt, recipe.data.fields)
            except DataError as e:
                raise DataError(f"data.{key}: {path} row {i}: {e}") from None
            problem = _row_problem(row, fmt, columns)
            if problem:
                raise DataError(f"data.{key}: {path} row {i}: {problem}")


def _row_problem(row: dict, fmt: str, columns: dict[str, str]) -> str | None:
    if fmt == "preference":
        return pair_problem(row, columns)
    if fmt == "prompt":  # GRPO: the run's prompt reader (data/prompts.py) checks messages in full
        value = row[columns["prompt"]]
        return None if isinstance(value, str | list) and value else \
            f"column {columns['prompt']!r} (prompt) must be a non-empty string or list of messages"
    if fmt != "messages":
        for name, column in columns.items():
            if not isinstance(row[column], str):
                return f"column {column!r} ({name}) holds {type(row[column]).__name__}, expected a string"
        return None
    messages, role, content = row[columns["messages"]], columns["role"], columns["content"]
    if not isinstance(messages, list) or not messages:
        return f"column {columns['messages']!r} must be a non-empty list of messages"
    for m in messages:
        if not isinstance(m, dict) or role not in m or content not in m:
            return f"every message needs keys {role!r} and {content!r} (map them with data.fields.role/content)"
    return None


def micro_batch_targets(recipe: Recipe, model_dir: Path) -> int | None:
    """The most target positions one training micro-batch holds: the ``micro_batch_size`` rows
    (packed as ``run`` packs them, or one sample each) with the most targets, from the tokenized
    training data (tokenized here into the cache ``run`` reads, or read from it). None when a
    source is on the Hub (not read by ``validate``; ``s3://`` ones are fetched). The loss's logits
    are that many rows, not one per position: in SFT, prompts and padding are not targets. A
    preference micro-batch holds ``micro_batch_size`` pairs: twice as many unpacked sequences. A
    GRPO micro-batch (``prompt`` data) holds ``micro_batch_size`` completions of at most
    ``rl.max_completion_length`` targets."""
    if recipe.rl is not None:
        return recipe.training.micro_batch_size * recipe.rl.max_completion_length
    spec = recipe.data.train
    sources = [spec] if isinstance(spec, str) else spec or []
    if spec is None or any("://" in s and data_scheme(s) is None for s in sources):
        return None
    train, _ = prepare_datasets(DataSpec.from_recipe(recipe), load_tokenizer(recipe, model_dir))
    per_sample = sample_targets(train.labels, train.offsets)
    pairs = recipe.data.format == "preference"
    rows = make_rows(train.lengths.tolist(), recipe.data.max_seq_len, recipe.data.packing and not pairs)
    per_row = sorted((sum(per_sample[i] for i in row) for row in rows), reverse=True)
    return sum(per_row[: recipe.training.micro_batch_size * (2 if pairs else 1)])


def sample_targets(labels: torch.Tensor, offsets: torch.Tensor) -> list[int]:
    """Targets of each sample of a tokenized dataset (flat int32 ``labels``, int64 ``offsets``):
    labels other than -100 after the sample's first position, which is never a target once a
    packed row's labels are shifted."""
    import numpy as np

    starts = offsets[:-1].numpy()
    if not len(starts):
        return []
    mask = labels.numpy() != IGNORE_INDEX
    mask[starts] = False
    return np.add.reduceat(mask, starts, dtype=np.int64).tolist()

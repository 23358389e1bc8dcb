"""Tokenizing rows into :class:`TokenizedDataset` (flat int32 arrays + offsets), in one process
or in forked workers over contiguous shares (``data.num_proc``); :mod:`.datasets` loads and caches."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file, save_file

from nxd_finetune.data import formats, preference
from nxd_finetune.errors import NxdWarning
from nxd_finetune.loss import IGNORE_INDEX


class TokenizeSpec(Protocol):
    """The data settings tokenizing reads (``nxd_finetune.data.datasets.DataSpec`` has them)."""

    format: str
    fields: dict[str, str]
    chat_template_kwargs: dict[str, formats.TemplateValue] | None
    max_seq_len: int
    train_on_prompt: bool
    num_proc: int | str
    max_prompt_length: int | None
    truncation_mode: str
    trl_tokenization: str

_CHUNK = 1000


class TokenizedDataset:
    """Tokenized samples stored flat: ``input_ids``/``labels`` int32 [N_tokens], ``offsets`` int64 [n+1].

    Sample ``i`` is ``input_ids[offsets[i]:offsets[i+1]]``; ``stats`` holds the counts of
    :func:`tokenize_rows`.
    """

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor, offsets: torch.Tensor, stats: dict[str, int]):
        self.input_ids, self.labels, self.offsets, self.stats = input_ids, labels, offsets, stats

    @classmethod
    def from_samples(cls, samples: Sequence[tuple[list[int], list[int]]], stats: dict[str, int]) -> TokenizedDataset:
        lengths = torch.tensor([len(ids) for ids, _ in samples], dtype=torch.int64)
        offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        flat_ids = [t for ids, _ in samples for t in ids]
        flat_labels = [t for _, labels in samples for t in labels]
        return cls(
            torch.tensor(flat_ids, dtype=torch.int32), torch.tensor(flat_labels, dtype=torch.int32), offsets, stats
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"input_ids": self.input_ids[a:b].tolist(), "labels": self.labels[a:b].tolist()}

    def tensors(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``i`` as (input_ids, labels) int32 views."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[a:b], self.labels[a:b]

    def save(self, path: Path) -> None:
        save_file(
            {"input_ids": self.input_ids, "labels": self.labels, "offsets": self.offsets},
            str(path),
            metadata={"stats": json.dumps(self.stats)},
        )

    @classmethod
    def load(cls, path: Path) -> TokenizedDataset:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            stats = json.loads(f.metadata()["stats"])
        t = load_file(str(path))
        return cls(t["input_ids"], t["labels"], t["offsets"], stats)


def tokenize_rows(rows, spec: TokenizeSpec, tokenizer, chat_template: str | None = None,
                  split: str = "data") -> TokenizedDataset:
    """Tokenize a ``datasets.Dataset`` (or list of dict rows) in ``spec.format``.

    ``preference`` rows (:mod:`.preference`) give two samples each, the chosen then the rejected
    sequence of the pair, and ``stats["pairs"]``; their ``truncated`` / ``dropped`` count pairs.
    ``split`` names the rows in errors (``data.train row 7: ...``).

    Samples longer than ``max_seq_len`` are truncated (keeping the start) and counted in
    ``stats["truncated"]``; samples with no trainable token left are dropped and counted in
    ``stats["dropped"]``. Raises DataError for missing columns or malformed rows.

    Rows go through the tokenizer ``_CHUNK`` at a time (one batched call each) and every chunk's
    tokens are appended to int32 files in a temporary directory, read at the end into tensors
    allocated once: memory holds the rows, the finished arrays and one chunk. ``spec.num_proc``
    worker processes (forked; ``auto``: one per core once there are :data:`ROWS_PER_PROC` rows per
    process) each take a contiguous share of the rows; the result is the same, in the same order,
    whatever the number of processes.
    """
    column_names = list(rows.column_names) if hasattr(rows, "column_names") else list(rows[0]) if rows else []
    columns = formats.resolve_columns(column_names, spec.format, spec.fields)
    procs = worker_count(spec.num_proc, len(rows))
    with tempfile.TemporaryDirectory(prefix="nxd-tokenize-") as spill:
        job = _TokenizeJob(rows, spec, tokenizer, chat_template, columns, spill, split)
        if procs == 1:
            parts = [job.run(0, len(rows))]
        else:
            import multiprocessing

            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked workers: no Rust pool warning
            bounds = [len(rows) * i // procs for i in range(procs + 1)]
            global _JOB
            _JOB = job
            try:
                pool = multiprocessing.get_context("fork").Pool(procs, initializer=_default_signals)
                try:
                    parts = pool.starmap(_run_job, zip(bounds[:-1], bounds[1:], strict=True))
                    pool.close()  # the workers exit on their own: no SIGTERM to one holding the queue's lock
                except BaseException:
                    pool.terminate()
                    raise
                finally:
                    pool.join()
            finally:
                _JOB = None
        out = _join(parts)
    if spec.format == "preference":
        out.stats["pairs"] = len(out) // 2
    return out


def _default_signals() -> None:
    """In a forked worker: SIGTERM / SIGINT back to their defaults. A parent's Python handler (the
    training loop's stop-after-this-step flag) would otherwise make ``Pool.terminate`` wait forever
    for a worker blocked on the task queue."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


ROWS_PER_PROC = 2000
"""``data.num_proc: auto`` starts a process per core only where each gets at least this many rows
(below that, starting them costs more than it saves)."""


def worker_count(num_proc: int | str, rows: int) -> int:
    """Processes for tokenizing ``rows`` rows: ``num_proc`` as given, at most one per available
    core (a larger number is capped with a one-line NxdWarning: a recipe written for a bigger
    machine still runs) and one per row; under ``auto`` one per core, at most one per
    :data:`ROWS_PER_PROC` rows. At least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if num_proc != "auto":
        if int(num_proc) > cores:
            _warn_capped(int(num_proc), cores)
        return max(1, min(int(num_proc), cores, max(rows, 1)))
    return max(1, min(cores, rows // ROWS_PER_PROC))


@functools.cache
def _warn_capped(num_proc: int, cores: int) -> None:
    """Once per process (train and eval sets are tokenized one after the other)."""
    warnings.warn(f"data.num_proc={num_proc} is more than the {cores} core(s) this process may use; "
                  f"tokenizing with {cores}", NxdWarning, stacklevel=3)


@dataclasses.dataclass
class _Part:
    """One contiguous share of the rows, tokenized: its ids and labels spilled to two int32 files
    (``tokens`` each), per-sample lengths, counts."""

    ids_path: str
    labels_path: str
    tokens: int
    lengths: Any  # numpy int64 [samples]
    trainable: int
    truncated: int
    dropped: int


@dataclasses.dataclass
class _TokenizeJob:
    rows: Any
    spec: TokenizeSpec
    tokenizer: Any
    chat_template: str | None
    columns: dict[str, str]
    spill_dir: str
    split: str = "data"

    def run(self, begin: int, end: int) -> _Part:
        """Rows ``[begin, end)``, ``_CHUNK`` at a time, each chunk's int32 tokens appended to this
        share's two files (memory holds one chunk, whatever the number of rows)."""
        import numpy as np

        spec = self.spec
        adds_bos = formats.adds_bos(self.tokenizer) if spec.format not in ("messages", "preference") else False
        length_parts: list[int] = []
        truncated = dropped = tokens = trainable = 0
        ids_path = os.path.join(self.spill_dir, f"{begin}.ids")
        labels_path = os.path.join(self.spill_dir, f"{begin}.labels")
        ids_file, labels_file = open(ids_path, "wb"), open(labels_path, "wb")
        with ids_file, labels_file:
            for start in range(begin, end, _CHUNK):
                got = self._chunk(start, min(start + _CHUNK, end), adds_bos, length_parts)
                truncated, dropped = truncated + got[2], dropped + got[3]
                tokens += len(got[0])
                np.asarray(got[0], dtype=np.int32).tofile(ids_file)
                chunk_labels = np.asarray(got[1], dtype=np.int32)
                chunk_labels.tofile(labels_file)
                trainable += _trainable(chunk_labels, length_parts[len(length_parts) - got[4]:])
        return _Part(ids_path, labels_path, tokens, np.asarray(length_parts, dtype=np.int64), trainable, truncated,
                     dropped)

    def _chunk(self, start: int, stop: int, adds_bos: bool,
               lengths: list[int]) -> tuple[list[int], list[int], int, int, int]:
        """Rows ``[start, stop)``: their kept tokens and labels, flat (lengths appended to
        ``lengths``), the truncated and dropped counts, and the number of samples kept."""
        kept_ids: list[int] = []
        kept_labels: list[int] = []
        if start >= stop:
            return kept_ids, kept_labels, 0, 0, 0
        chunk = self.rows[start:stop]
        if isinstance(chunk, Mapping):  # datasets slices are column-major
            chunk = [dict(zip(chunk, values, strict=True)) for values in zip(*chunk.values(), strict=True)]
        if self.spec.format == "preference":
            samples, truncated, dropped = preference.tokenize_chunk(
                chunk, start, self.columns, self.tokenizer, self.chat_template, self.spec, self.split)
        else:
            samples, truncated, dropped = self._samples(chunk, adds_bos)
        for ids, labels in samples:
            kept_ids.extend(ids)
            kept_labels.extend(labels)
            lengths.append(len(ids))
        return kept_ids, kept_labels, truncated, dropped, len(samples)

    def _samples(self, chunk: Sequence[Mapping], adds_bos: bool) -> tuple[list[preference.Sample], int, int]:
        """SFT rows: rendered, tokenized, truncated to ``max_seq_len``; rows left with nothing to
        train dropped. The kept samples and the truncated and dropped counts."""
        spec = self.spec
        truncated = dropped = 0
        samples = []
        rendered = [
            formats.render_row(row, spec.format, self.columns, self.tokenizer, self.chat_template,
                               spec.train_on_prompt, adds_bos, spec.chat_template_kwargs)
            for row in chunk
        ]
        for ids, labels in formats.tokenize_rendered(self.tokenizer, rendered):
            if len(ids) > spec.max_seq_len:
                truncated += 1
                ids, labels = ids[: spec.max_seq_len], labels[: spec.max_seq_len]
            if all(t == IGNORE_INDEX for t in labels[1:]):
                dropped += 1
                continue
            samples.append((ids, labels))
        return samples, truncated, dropped


_JOB: _TokenizeJob | None = None  # the job forked workers inherit (not pickled: the rows stay shared)


def _run_job(begin: int, end: int) -> _Part:
    assert _JOB is not None
    return _JOB.run(begin, end)


def _trainable(labels: Any, lengths: Sequence[int]) -> int:
    """Trainable tokens of consecutive samples of ``lengths`` whose labels are ``labels`` (a numpy
    int32 chunk): labels other than -100 after each sample's first position. Counted per chunk so
    that no whole-dataset mask (or the int64 copy ``bool.sum()`` makes of it) is ever allocated."""
    import numpy as np

    if not lengths:
        return 0
    starts = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
    return int(np.count_nonzero(labels != IGNORE_INDEX)) - int(np.count_nonzero(labels[starts] != IGNORE_INDEX))


def _join(parts: list[_Part]) -> TokenizedDataset:
    """The shares' files read into one pair of int32 tensors (allocated once, at their final size)."""
    import numpy as np

    total = sum(p.tokens for p in parts)
    ids = torch.empty(total, dtype=torch.int32)
    labels = torch.empty(total, dtype=torch.int32)
    at = 0
    for p in parts:
        for path, out in ((p.ids_path, ids), (p.labels_path, labels)):
            with open(path, "rb") as f:
                f.readinto(memoryview(out[at:at + p.tokens].numpy()))  # type: ignore[arg-type]
        at += p.tokens
    lengths = torch.from_numpy(np.concatenate([p.lengths for p in parts]))
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    stats = {"samples": len(lengths), "tokens": int(lengths.sum()), "trainable_tokens": sum(p.trainable for p in parts),
             "truncated": sum(p.truncated for p in parts), "dropped": sum(p.dropped for p in parts)}
    return TokenizedDataset(ids, labels, offsets, stats)

"""Packing tokenized samples into rows and collating rows into micro-batches.

A *row* is a list of sample indices laid end to end in one sequence. Without packing every row
holds one sample; with packing :func:`pack_bins` fills rows of ``max_seq_len`` tokens.

Packing is **best-fit decreasing**: samples are taken longest first and each goes into the open row
with the least room that still fits it (a new row if none does). It runs once per dataset
(deterministic: ties broken by sample index), so rows are fixed across epochs and the sampler
shuffles rows, not samples; a sample is never split across rows. Best-fit decreasing leaves rows
nearly full (within a few % of optimal), and costs O(n log max_seq_len).

:func:`collate` lays rows out as ``[B, T]`` long tensors:

- ``input_ids``; padding is ``pad_id`` (the tokenizer's pad token, else eos);
- ``labels``: the samples' labels, except that the **first token of every sample is -100**, so no
  loss crosses a sample boundary (labels are HF-aligned: the loss predicts ``labels[t]`` from
  position ``t-1``, which for a sample's first token lies in the previous sample); padding is -100;
- ``position_ids``: restart at 0 at each sample (and at the padding);
- ``segment_ids``: 1..k for the k samples of a row; padding is segment 0, a segment of its own
  (the model gives segment 0 no special meaning: padding attends only to padding).

``T`` is ``max_seq_len`` for packed rows and with ``fixed_shape`` (static shapes for XLA), else the
longest row of the batch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from nxd_finetune.errors import DataError
from nxd_finetune.loss import IGNORE_INDEX


def pack_bins(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Best-fit-decreasing bins of sample indices, each summing to at most ``max_seq_len`` tokens.

    Rows come in creation order (longest samples first); indices within a row ascend.
    Raises DataError if a sample is longer than ``max_seq_len`` (samples are truncated before).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    by_room: dict[int, list[int]] = {}  # free tokens -> rows with exactly that much room
    rooms: list[int] = []  # sorted keys of by_room
    for i in order:
        n = int(lengths[i])
        if n > max_seq_len:
            raise DataError(f"sample {i} has {n} tokens, more than max_seq_len={max_seq_len}")
        j = bisect.bisect_left(rooms, n)
        if j < len(rooms):
            room = rooms[j]
            b = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(j)
        else:
            room, b = max_seq_len, len(bins)
            bins.append([])
        bins[b].append(i)
        room -= n
        if room > 0:
            if room not in by_room:
                by_room[room] = []
                bisect.insort(rooms, room)
            by_room[room].append(b)
    return [sorted(b) for b in bins]


def make_rows(lengths: Sequence[int], max_seq_len: int, packing: bool) -> list[list[int]]:
    """Rows of sample indices: packed bins, or one sample per row in dataset order."""
    if packing:
        return pack_bins(lengths, max_seq_len)
    return [[i] for i in range(len(lengths))]


def collate(dataset, rows: Sequence[Sequence[int]], pad_id: int, seq_len: int | None = None) -> dict[str, torch.Tensor]:
    """Micro-batch of ``rows`` (lists of sample indices into ``dataset``) as [B, T] long tensors.

    ``dataset`` provides ``tensors(i) -> (input_ids, labels)`` (a TokenizedDataset). ``seq_len``
    fixes T (rows longer than it raise DataError); None pads to the longest row. An empty row is
    all padding (eval uses it to give every data-parallel rank the same number of rows).
    """
    pieces = [[dataset.tensors(i) for i in row] for row in rows]
    lengths = [sum(len(ids) for ids, _ in row) for row in pieces]
    width = seq_len if seq_len is not None else max(lengths, default=1) or 1
    if max(lengths, default=0) > width:
        raise DataError(f"a row of {max(lengths)} tokens does not fit seq_len={width}")
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment_ids = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(pieces):
        t = 0
        for k, (ids, lab) in enumerate(row, start=1):
            n = len(ids)
            input_ids[r, t : t + n] = ids
            labels[r, t : t + n] = lab
            labels[r, t] = IGNORE_INDEX
            position_ids[r, t : t + n] = torch.arange(n)
            segment_ids[r, t : t + n] = k
            t += n
        position_ids[r, t:] = torch.arange(width - t)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "segment_ids": segment_ids}


def packing_stats(lengths: Sequence[int], rows: Sequence[Sequence[int]], seq_len: int) -> dict[str, float]:
    """``rows`` and ``fill`` (fraction of the ``rows x seq_len`` slots holding tokens)."""
    total = sum(int(lengths[i]) for row in rows for i in row)
    return {"rows": len(rows), "fill": total / max(1, len(rows) * seq_len)}

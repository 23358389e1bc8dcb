"""Preference micro-batches and the reference log-probs stored with the tokenized pairs.

A tokenized preference split is a :class:`TokenizedDataset` whose sample ``2i`` is the chosen and
``2i + 1`` the rejected sequence of pair ``i`` (:mod:`.preference`). A micro-batch of ``P`` pairs
(:func:`collate_pairs`, TRL's ``concatenated_forward`` order):

- ``input_ids`` [2P, T] long: rows ``0..P-1`` the chosen sequences, rows ``P..2P-1`` the rejected
  ones of the same pairs in the same order, right-padded with ``pad_id`` to the longest row (or to
  ``seq_len``: fixed shapes);
- ``labels`` [2P, T] long: the completion tokens' ids (HF-aligned with ``input_ids``), -100 on the
  prompt and the padding; no packing, no ``segment_ids``;
- ``ref_logps`` float32 [2P] (same row order), once reference log-probs are attached.

Pair ``-1`` is an all-padding pair (labels -100, ``ref_logps`` 0): eval gives every data-parallel
rank the same number of batches with it.

Reference log-probs live in the tokenized data's cache entry (``datasets.cache_entry``), under
``ref-<key>/`` where ``key`` (:func:`ref_logps_key`) hashes what else decides them (the base
weights, the resolved starting adapter and its content, dtype): the entry itself is keyed by the
tokenizer, the data and the settings that change tokens, so a resumed run finds them again. The
store and its integrity record: :mod:`.ref_store`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence

import torch

from nxd_finetune.data.sampler import one_pass
from nxd_finetune.data.tokenize import TokenizedDataset
from nxd_finetune.errors import DataError
from nxd_finetune.loss import IGNORE_INDEX


class PreferencePairs:
    """A tokenized preference split: ``len()`` pairs; ``ref_logps`` float32 [2 * pairs] (sample
    order: chosen, rejected of pair 0, ...) or None."""

    def __init__(self, dataset: TokenizedDataset) -> None:
        if len(dataset) % 2:
            raise DataError(f"a preference split holds {len(dataset)} sequences; expected chosen/rejected pairs")
        self.dataset = dataset
        self.ref_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.dataset) // 2

    def set_ref_logps(self, values: torch.Tensor) -> None:
        """Attach per-sequence reference log-probs (sample order, [2 * pairs])."""
        values = torch.as_tensor(values).detach().to("cpu", torch.float32).reshape(-1)
        if values.numel() != len(self.dataset):
            raise DataError(f"reference log-probs: {values.numel()} values for {len(self.dataset)} sequences")
        if not torch.isfinite(values).all():
            raise DataError("reference log-probs hold NaN or inf")
        self.ref_logps = values


def collate_pairs(pairs: PreferencePairs, pair_ids: Sequence[int], pad_id: int,
                  seq_len: int | None = None) -> dict[str, torch.Tensor]:
    """The micro-batch of ``pair_ids`` (see the module docstring). ``seq_len`` fixes T (a longer
    sequence raises DataError); None pads to the longest row."""
    order = [2 * i for i in pair_ids] + [2 * i + 1 for i in pair_ids]  # -2 / -1: padding rows
    pieces = [pairs.dataset.tensors(s) if s >= 0 else None for s in order]
    longest = max((len(p[0]) for p in pieces if p is not None), default=1)
    width = seq_len if seq_len is not None else longest
    if longest > width:
        raise DataError(f"a sequence of {longest} tokens does not fit seq_len={width}")
    input_ids = torch.full((len(order), width), pad_id, dtype=torch.long)
    labels = torch.full((len(order), width), IGNORE_INDEX, dtype=torch.long)
    for r, piece in enumerate(pieces):
        if piece is not None:
            ids, lab = piece
            input_ids[r, :len(ids)] = ids
            labels[r, :len(lab)] = lab
    batch = {"input_ids": input_ids, "labels": labels}
    if pairs.ref_logps is not None:
        index = torch.tensor(order, dtype=torch.long)
        batch["ref_logps"] = torch.where(index >= 0, pairs.ref_logps[index.clamp(min=0)], 0.0)
    return batch


def pair_tokens(labels: torch.Tensor) -> int:
    """The real (non-padding) tokens of a preference micro-batch from its ``labels`` [2P, T]: each
    row up to its last completion token, since every sequence ends with one (truncation keeps a
    completion's start or its end; an empty completion is refused); all-padding rows count none."""
    positions = torch.arange(1, labels.shape[1] + 1, device=labels.device)
    return int(torch.where(labels != IGNORE_INDEX, positions, 0).amax(1).sum()) if labels.numel() else 0


class PairBatches:
    """How one data-parallel rank cuts a preference split into micro-batches of
    ``micro_batch_size`` pairs (``pad_id``, ``seq_len`` as :func:`collate_pairs`). ``with_ids``:
    each micro-batch also carries its ``pair_ids`` [P] long (-1: padding), for whoever fills in
    its ``ref_logps`` when it is drawn (:mod:`nxd_finetune.sft.ref_source`, which removes them)."""

    def __init__(self, pairs: PreferencePairs, micro_batch_size: int, pad_id: int, seq_len: int | None,
                 dp_rank: int = 0, dp_world: int = 1) -> None:
        self.pairs, self.micro_batch_size, self.pad_id, self.seq_len = pairs, micro_batch_size, pad_id, seq_len
        self.dp_rank, self.dp_world = dp_rank, dp_world
        self.with_ids = False

    def __call__(self, pair_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        batch = collate_pairs(self.pairs, pair_ids, self.pad_id, self.seq_len)
        if self.with_ids:
            batch["pair_ids"] = torch.tensor(list(pair_ids), dtype=torch.long)
        return batch

    def one_pass(self) -> list[list[int]]:
        """This rank's micro-batches of every pair once over the dp ranks (``sampler.one_pass``:
        pairs ``r, r + w, ...``, padded with pair -1, the same number of micro-batches on every rank)."""
        return one_pass(len(self.pairs), self.micro_batch_size, self.dp_rank, self.dp_world, self.seq_len is not None)

    def reference_batches(self) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """For the one reference pass before training: ``(pair_ids [P] long, micro-batch)`` over
        :meth:`one_pass`. A row's log-prob goes to sample ``2 * id`` (chosen, rows ``0..P-1``) or
        ``2 * id + 1`` (rejected); ids -1 are padding. :func:`assemble_ref_logps` puts the values
        gathered from every rank in sample order."""
        for ids in self.one_pass():
            yield torch.tensor(ids, dtype=torch.long), collate_pairs(self.pairs, ids, self.pad_id, self.seq_len)


def assemble_ref_logps(num_pairs: int, pair_ids: Sequence[torch.Tensor],
                       row_logps: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sequence log-probs in sample order [2 * num_pairs] from micro-batches' ``pair_ids`` [P]
    and their rows' log-probs [2P] (chosen rows then rejected rows), e.g. gathered from every dp
    rank. Padding ids (-1) are skipped; a pair missing raises DataError."""
    out = torch.full((2 * num_pairs,), float("nan"), dtype=torch.float32)
    for ids, logps in zip(pair_ids, row_logps, strict=True):
        ids = ids.reshape(-1).long()
        logps = logps.detach().reshape(2, -1).to("cpu", torch.float32)
        keep = ids >= 0
        out[2 * ids[keep]] = logps[0][keep]
        out[2 * ids[keep] + 1] = logps[1][keep]
    if torch.isnan(out).any():
        missing = int(torch.isnan(out).nonzero()[0]) // 2
        raise DataError(f"reference log-probs: pair {missing} was not computed (or is NaN)")
    return out


def ref_logps_key(reference: Mapping[str, object]) -> str:
    """Hex key of reference log-probs over what decides them beyond the tokenized data (JSON
    values: base weights fingerprint, starting adapter, dtype, objective settings...)."""
    return hashlib.sha256(json.dumps(dict(reference), sort_keys=True, default=str).encode()).hexdigest()[:24]

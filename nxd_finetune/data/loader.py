"""From the recipe's ``data`` section to micro-batches for one data-parallel rank.

The trainer calls :func:`build_dataloaders` once::

    data = build_dataloaders(recipe.data, tokenizer, micro_batch_size=mbs, dp_rank=r, dp_world=w,
                             seed=recipe.training.seed, base_dir=recipe_dir)
    batches = iter(data.train)           # endless: epoch after epoch
    batch = next(batches)                # dict of [mbs, T] long tensors
    state = data.train.state_dict()      # save with the checkpoint ...
    data.train.load_state_dict(state)    # ... and restore before iter() to continue exactly
    for batch in data.eval: ...          # one pass, same number of batches on every rank

Each batch holds ``input_ids``, ``labels``, ``position_ids``, ``segment_ids`` (packing.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_finetune.data.datasets import DataSpec, TokenizedDataset, prepare_datasets
from nxd_finetune.data.packing import collate, make_rows, packing_stats
from nxd_finetune.data.sampler import ResumableSampler

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.recipe import DataSection


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token, else its eos token (padding is masked, its id does not matter)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if tid is not None:
            return int(tid)
    return 0


class TrainLoader:
    """Endless, resumable micro-batches of the training rows for one dp rank (see sampler.py)."""

    def __init__(
        self,
        dataset: TokenizedDataset,
        rows: list[list[int]],
        sampler: ResumableSampler,
        pad_id: int,
        seq_len: int | None,
    ):
        self.dataset, self.rows, self.sampler = dataset, rows, sampler
        self.pad_id, self.seq_len = pad_id, seq_len

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch on each rank (a global step takes ``grad_accum`` of them)."""
        return self.sampler.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.sampler.state_dict()["epoch"]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch_rows in self.sampler:
            yield collate(self.dataset, [self.rows[i] for i in batch_rows], self.pad_id, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


class EvalLoader:
    """One ordered pass over the eval rows; rank ``r`` takes rows ``r, r + w, ...``.

    Every rank yields the same number of micro-batches (ranks short of a row get an all-padding row,
    which holds no target), so collective ops in the eval loop stay in step. The last micro-batch
    may have fewer rows unless ``fixed_shape``.
    """

    def __init__(
        self,
        dataset: TokenizedDataset,
        rows: list[list[int]],
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        pad_id: int,
        seq_len: int | None,
        fixed_shape: bool,
    ):
        per_rank = math.ceil(len(rows) / dp_world)
        mine = [rows[j] if j < len(rows) else [] for j in range(dp_rank, per_rank * dp_world, dp_world)]
        self.batches = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
        if fixed_shape and self.batches:
            self.batches[-1] += [[]] * (micro_batch_size - len(self.batches[-1]))
        self.dataset, self.pad_id, self.seq_len = dataset, pad_id, seq_len

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch_rows in self.batches:
            yield collate(self.dataset, batch_rows, self.pad_id, self.seq_len)


@dataclasses.dataclass
class DataLoaders:
    """``train`` and ``eval`` (None without eval data); ``stats[split]``: samples, truncated, dropped,
    tokens, trainable_tokens, rows, fill."""

    train: TrainLoader
    eval: EvalLoader | None
    stats: dict[str, dict[str, Any]]


def build_dataloaders(
    data: DataSpec | DataSection | Mapping[str, object],
    tokenizer: PreTrainedTokenizerBase,
    *,
    micro_batch_size: int,
    dp_rank: int = 0,
    dp_world: int = 1,
    seed: int = 0,
    base_dir: str | Path | None = None,
    fixed_shape: bool = False,
    use_cache: bool = True,
) -> DataLoaders:
    """Tokenize (or load from cache), pack, and shard the data of ``data`` (the recipe's section).

    ``seed`` drives the per-epoch shuffle (``data.shuffle``); ``base_dir`` resolves relative paths;
    ``fixed_shape`` pads every batch to ``max_seq_len`` rows (static shapes, as XLA wants; packed
    batches always are). Raises DataError for unreadable data or too little of it.
    """
    spec = DataSpec.of(data)
    train_ds, eval_ds = prepare_datasets(spec, tokenizer, base_dir=base_dir, use_cache=use_cache)
    pad_id = pad_token_id(tokenizer)
    seq_len = spec.max_seq_len if (spec.packing or fixed_shape) else None
    stats = {}

    def rows_of(ds: TokenizedDataset, split: str) -> list[list[int]]:
        lengths = ds.lengths.tolist()
        rows = make_rows(lengths, spec.max_seq_len, spec.packing)
        stats[split] = {**ds.stats, **packing_stats(lengths, rows, spec.max_seq_len)}
        return rows

    train_rows = rows_of(train_ds, "train")
    sampler = ResumableSampler(
        len(train_rows), micro_batch_size, seed=seed, shuffle=spec.shuffle, dp_rank=dp_rank, dp_world=dp_world
    )
    train = TrainLoader(train_ds, train_rows, sampler, pad_id, seq_len)
    evaluator = None
    if eval_ds is not None and len(eval_ds):
        evaluator = EvalLoader(
            eval_ds, rows_of(eval_ds, "eval"), micro_batch_size, dp_rank, dp_world, pad_id, seq_len, fixed_shape
        )
    return DataLoaders(train, evaluator, stats)

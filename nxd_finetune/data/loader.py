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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nxd_finetune.data.datasets import DataSpec, TokenizedDataset, cache_entry, prepare_datasets
from nxd_finetune.data.packing import collate, make_rows, packing_stats
from nxd_finetune.data.pairs import PairBatches, PreferencePairs
from nxd_finetune.data.prompts import load_prompt_data
from nxd_finetune.data.ref_store import load_ref_logps, save_ref_logps
from nxd_finetune.data.sampler import ResumableSampler, one_pass
from nxd_finetune.errors import DataError

Batch = dict[str, torch.Tensor]

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.recipe import DataSection


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token, else its eos token (padding is masked, its id does not matter)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if tid is not None:
            return int(tid)
    return 0


class RowBatches:
    """Micro-batches of packed (or one-sample) rows: ``__call__(row indices)``; -1 is an
    all-padding row."""

    def __init__(self, dataset: TokenizedDataset, rows: list[list[int]], pad_id: int, seq_len: int | None):
        self.dataset, self.rows, self.pad_id, self.seq_len = dataset, rows, pad_id, seq_len

    def __call__(self, indices: Sequence[int]) -> Batch:
        return collate(self.dataset, [self.rows[i] if i >= 0 else [] for i in indices], self.pad_id, self.seq_len)


class TrainLoader:
    """Endless, resumable micro-batches of the training items (rows, or preference pairs) for one
    dp rank (see sampler.py); ``batch_of`` makes a micro-batch of item indices."""

    def __init__(self, sampler: ResumableSampler, batch_of: Callable[[Sequence[int]], Batch]):
        self.sampler, self.batch_of = sampler, batch_of

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per epoch on each rank (a global step takes ``grad_accum`` of them)."""
        return self.sampler.batches_per_epoch

    @property
    def epoch(self) -> int:
        return self.sampler.state_dict()["epoch"]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for items in self.sampler:
            yield self.batch_of(items)

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)


class EvalLoader:
    """One ordered pass over the eval items (rows, or preference pairs; ``sampler.one_pass``): rank
    ``r`` takes items ``r, r + w, ...``. Every rank yields the same number of micro-batches (ranks
    short of an item get an all-padding one, which holds no target), so collective ops in the eval
    loop stay in step. The last micro-batch may have fewer rows unless ``fixed_shape``.
    """

    def __init__(self, batches: list[list[int]], batch_of: Callable[[Sequence[int]], Batch]):
        self.batches, self.batch_of = batches, batch_of

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        for items in self.batches:
            yield self.batch_of(items)


@dataclasses.dataclass
class DataLoaders:
    """``train`` and ``eval`` (None without eval data); ``stats[split]``: samples, truncated, dropped,
    tokens, trainable_tokens, rows, fill (and pairs for ``preference``, whose truncated / dropped
    count pairs and samples sequences). ``pairs[split]``: a preference split's batching (empty for
    other formats); ``cache_entry``: where the tokenized data is cached (None without the cache)."""

    train: TrainLoader
    eval: EvalLoader | None
    stats: dict[str, dict[str, Any]]
    pairs: dict[str, PairBatches] = dataclasses.field(default_factory=dict)
    cache_entry: Path | None = None

    def attach_ref_logps(self, values: Mapping[str, torch.Tensor]) -> None:
        """Per-split reference log-probs (sample order, see pairs.py): every later micro-batch of
        the split carries its rows' ``ref_logps``."""
        for split, v in values.items():
            if split not in self.pairs:
                raise DataError(f"reference log-probs for {split!r}: no such preference split")
            self.pairs[split].pairs.set_ref_logps(v)

    def load_ref_logps(self, key: str) -> bool:
        """Attach the reference log-probs stored under ``key`` (``pairs.ref_logps_key``) with the
        cached data, of each split stored complete; False unless every split's are (compute the
        rest, then :meth:`save_ref_logps`). A store that fails its integrity checks raises
        ``ref_store.RefStoreError`` (one line naming it)."""
        if self.cache_entry is None:
            return False
        sizes = {split: 2 * len(b.pairs) for split, b in self.pairs.items()}
        stored = load_ref_logps(self.cache_entry, key, sizes)
        if stored is None:
            return False
        self.attach_ref_logps(stored)
        return set(stored) == set(sizes)

    def save_ref_logps(self, key: str, values: Mapping[str, torch.Tensor],
                       reference: Mapping[str, object] | None = None, *, replace: bool = False,
                       partial: bool = False) -> None:
        """Attach ``values`` and store them with the cached data under ``key`` (without the cache
        they are only attached; ``replace``: in place of a store that failed its checks, or of the
        splits stored before). Every split of :attr:`pairs` needs its values unless ``partial``:
        then the complete splits' (the others' stored parts are kept)."""
        missing = sorted(set(self.pairs) - set(values))
        if missing and not partial:
            raise DataError(f"reference log-probs: no values for {', '.join(missing)}")
        self.attach_ref_logps(values)
        if self.cache_entry is not None:
            save_ref_logps(self.cache_entry, key, values, reference, replace=replace)


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
    batches always are). Raises DataError for unreadable data or too little of it. ``preference``
    data gives micro-batches of ``micro_batch_size`` pairs (pairs.py), never packed.
    """
    spec = DataSpec.of(data)
    if spec.format == "prompt":
        return _prompt_loaders(spec, dp_rank, dp_world, seed, base_dir)
    train_ds, eval_ds = prepare_datasets(spec, tokenizer, base_dir=base_dir, use_cache=use_cache)
    pad_id = pad_token_id(tokenizer)
    if spec.format == "preference":
        entry = cache_entry(spec, tokenizer, base_dir) if use_cache else None
        shape = Shape(micro_batch_size, dp_rank, dp_world, spec.max_seq_len if fixed_shape else None)
        return _pair_loaders(spec, train_ds, eval_ds, pad_id, shape, seed, entry)
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
    train = TrainLoader(sampler, RowBatches(train_ds, train_rows, pad_id, seq_len))
    evaluator = None
    if eval_ds is not None and len(eval_ds):
        eval_rows = rows_of(eval_ds, "eval")
        evaluator = EvalLoader(one_pass(len(eval_rows), micro_batch_size, dp_rank, dp_world, fixed_shape),
                               RowBatches(eval_ds, eval_rows, pad_id, seq_len))
    return DataLoaders(train, evaluator, stats)


def _prompt_loaders(spec: DataSpec, dp_rank: int, dp_world: int, seed: int,
                    base_dir: str | Path | None) -> DataLoaders:
    """The ``prompt`` format (GRPO): its batch source (``rl/source.py``) reads, orders and samples
    the prompts itself; the train loader here only counts them (one prompt per item)."""
    if spec.train is None:
        raise DataError("data.train is not set")
    n = len(load_prompt_data(spec.train, base_dir))
    sampler = ResumableSampler(n, 1, seed=seed, shuffle=spec.shuffle, dp_rank=dp_rank, dp_world=dp_world)
    return DataLoaders(TrainLoader(sampler, lambda items: {"prompt_index": torch.tensor(list(items))}), None,
                       {"train": {"samples": n}})


@dataclasses.dataclass(frozen=True)
class Shape:
    """How a rank cuts its micro-batches: pairs per micro-batch, its dp rank and world, and the
    fixed sequence length (None: the longest row of the micro-batch)."""

    micro_batch_size: int
    dp_rank: int
    dp_world: int
    seq_len: int | None


def _pair_loaders(spec: DataSpec, train_ds: TokenizedDataset, eval_ds: TokenizedDataset | None, pad_id: int,
                  shape: Shape, seed: int, entry: Path | None) -> DataLoaders:
    """Loaders of a preference set: the sampler shuffles pairs; a micro-batch is pairs.py's."""
    stats: dict[str, dict[str, Any]] = {}
    pairs: dict[str, PairBatches] = {}
    for split, ds in (("train", train_ds), ("eval", eval_ds)):
        if ds is not None and len(ds):
            pairs[split] = PairBatches(PreferencePairs(ds), shape.micro_batch_size, pad_id, shape.seq_len,
                                       shape.dp_rank, shape.dp_world)
            lengths = ds.lengths.tolist()
            stats[split] = {**ds.stats, **packing_stats(lengths, [[i] for i in range(len(lengths))],
                                                         spec.max_seq_len)}
    sampler = ResumableSampler(len(pairs["train"].pairs), shape.micro_batch_size, seed=seed, shuffle=spec.shuffle,
                               dp_rank=shape.dp_rank, dp_world=shape.dp_world)
    train = TrainLoader(sampler, pairs["train"])
    evaluator = EvalLoader(pairs["eval"].one_pass(), pairs["eval"]) if "eval" in pairs else None
    return DataLoaders(train, evaluator, stats, pairs, entry)

"""Reference log-probs computed when the run first needs them: at the step that uses a pair.

A DPO run's reference pass used to go over every pair of the data set before the first step;
a short run over a large set paid for pairs it never trained on. Here a step's micro-batches
(from the run's :class:`~nxd_finetune.sft.source.BatchSource`, wrapped by :class:`ReferenceSource`)
get their ``ref_logps`` right before the step: the micro-batches holding a pair without a value
go through the engine once, forward only, in eval mode, under the reference weights
(:func:`~nxd_finetune.sft.reference.row_logps`: the adapter off, or the starting adapter swapped
in), batched as the step is; the values are gathered over dp (every rank holds the same table) and
the logger stores them with the tokenized data as a part of the store
(:func:`~nxd_finetune.data.ref_store.save_part`), so a resumed run and later epochs read them back;
once every pair of the split has its values they move into the store's file of complete splits.
The eval split is computed whole before the first eval (:meth:`LazyReference.complete`).

A resumed run finds what it stored before the kill; a pair it had not reached is computed at the
same step, in the same micro-batch, from the same weights, so the values (and the run) are the
uninterrupted run's, byte for byte.

Full fine-tuning keeps the one pass before training: its reference (the initial model) is gone
after the first step, and a copy of it would be a second model in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nxd_finetune.data.ref_store import save_part
from nxd_finetune.sft.reference import (
    Identity,
    OpenReference,
    attach_reference,
    open_reference,
    row_logps,
    split_logps,
)
from nxd_finetune.sft.step import StepItem

if TYPE_CHECKING:
    from nxd_finetune.data.loader import DataLoaders
    from nxd_finetune.recipe import Recipe
    from nxd_finetune.sft.engine import Engine
    from nxd_finetune.sft.source import BatchSource

TRAIN = "train"


class LazyReference:
    """The pending reference values of a run (:class:`~nxd_finetune.sft.reference.OpenReference`):
    :meth:`fill` gives a step's micro-batches theirs, computing what is missing; :meth:`complete`
    a whole split's."""

    def __init__(self, engine: Engine, data: DataLoaders, ref: OpenReference) -> None:
        self.engine, self.data, self.ref = engine, data, ref
        self.reference = str(ref.ident["reference"])
        data.pairs[TRAIN].with_ids = True  # micro-batches name their pairs (fill removes them)

    def fill(self, batches: list[dict[str, torch.Tensor]]) -> None:
        """Every micro-batch of a step (``pair_ids`` [P], on any device) gets its ``ref_logps``
        [2P]; the micro-batches with a pair not computed yet go through the reference pass first.
        Collective over dp while the train split is not complete (every rank calls it each step)."""
        table = self.ref.pending.get(TRAIN)
        if table is not None:
            ids = [b["pair_ids"].cpu() for b in batches]
            todo = [i for i, pair_ids in enumerate(ids) if _missing(table, _rows(pair_ids))]
            stripped = ({k: v for k, v in batches[i].items() if k != "pair_ids"} for i in todo)
            got = list(row_logps(self.engine, stripped, self.reference, self.ref.weights))
            self._record(table, [ids[i] for i in todo], got)
        values = self.ref.pending.get(TRAIN)
        if values is None:
            values = self.data.pairs[TRAIN].pairs.ref_logps
        assert values is not None
        for b in batches:
            rows = _rows(b.pop("pair_ids").cpu())
            b["ref_logps"] = torch.where(rows >= 0, values[rows.clamp(min=0)], 0.0).to(b["labels"].device)

    def complete(self, split: str) -> None:
        """The values of every pair of ``split`` (one pass over the pairs, each dp rank its share),
        attached and stored. Collective; nothing to do for a split already complete."""
        if split in self.ref.pending:
            self.ref.complete(split, split_logps(self.engine, self.data, split, self.ref.weights))

    def _record(self, table: torch.Tensor, ids: list[torch.Tensor], got: list[torch.Tensor]) -> None:
        """This step's new values (every dp rank's) into ``table`` (only where it has none), stored
        as one part; the split complete: attached and stored whole."""
        if self.engine.state.size("dp") > 1:
            gathered: list[object] = [None] * self.engine.state.size("dp")
            dist.all_gather_object(gathered, (ids, got), group=self.engine.state.host_group("dp"))
            ids = [t for part in gathered for t in part[0]]  # type: ignore[index]
            got = [t for part in gathered for t in part[1]]  # type: ignore[index]
        rows = torch.cat([_rows(i) for i in ids]) if ids else torch.zeros(0, dtype=torch.long)
        values = torch.cat([g.reshape(-1).float() for g in got]) if got else torch.zeros(0)
        new = (rows >= 0) & torch.isnan(table[rows.clamp(min=0)])
        rows, values = rows[new], values[new]
        table[rows] = values
        entry = self.data.cache_entry
        if not torch.isnan(table).any():
            self.ref.complete(TRAIN, table)
        elif rows.numel() and self.engine.is_logger and entry is not None:
            save_part(Path(entry), self.ref.key, TRAIN, rows, values)


def _missing(table: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether a row of ``rows`` (sample ids, -1: padding) has no value in ``table`` yet."""
    rows = rows[rows >= 0]
    return bool(torch.isnan(table[rows]).any())


def _rows(pair_ids: torch.Tensor) -> torch.Tensor:
    """The sample ids of a micro-batch's rows from its pair ids: chosen rows ``2 id``, then
    rejected rows ``2 id + 1``; -1 for padding pairs' rows."""
    pair_ids = pair_ids.reshape(-1).long()
    return torch.cat([torch.where(pair_ids >= 0, 2 * pair_ids, -1), torch.where(pair_ids >= 0, 2 * pair_ids + 1, -1)])


class ReferenceSource:
    """A :class:`~nxd_finetune.sft.source.BatchSource` whose steps carry their ``ref_logps``
    (:meth:`LazyReference.fill`, right before the step); its state is ``inner``'s."""

    def __init__(self, inner: BatchSource, reference: LazyReference) -> None:
        self.inner, self.reference = inner, reference

    def next_step(self, engine: Engine, step: int) -> StepItem:
        batches, tokens = self.inner.next_step(engine, step)
        self.reference.fill(batches)
        return batches, tokens

    def state_dict(self) -> dict[str, object]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()


def lazy_reference(recipe: Recipe, engine: Engine, data: DataLoaders, model_dir: Path,
                   started: Identity | None = None) -> tuple[Identity | None, LazyReference | None]:
    """A training run's reference (``started``: a resumed run's, as its checkpoint records) and,
    where values remain to compute, the :class:`LazyReference` that computes them as the run
    needs them (None: every value stored, or full fine-tuning, whose values are computed here, in
    one pass before training). Collective."""
    if engine.lora_config is None:
        return attach_reference(recipe, engine, data, model_dir, started=started), None
    ref = open_reference(recipe, engine, data, model_dir, started=started)
    if ref is None:
        return None, None
    return ref.ident, LazyReference(engine, data, ref) if ref.pending else None

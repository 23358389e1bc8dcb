"""Deterministic, resumable order of rows for each data-parallel rank.

Epoch ``e`` visits the rows in ``torch.randperm(n, generator=Generator().manual_seed(seed + e))``
order (identity order without shuffling). Of the first ``per_rank * dp_world`` rows of that order
(``per_rank = n // dp_world``, the remainder is dropped so all ranks step together), rank ``r`` takes
the strided share ``order[r::dp_world]`` and cuts it into micro-batches of ``micro_batch_size``
(an incomplete last micro-batch is dropped: every step sees the same shape).

So micro-step ``k`` of all ranks together covers exactly ``order[k*G:(k+1)*G]`` with
``G = micro_batch_size * dp_world``. The state is ``(epoch, position)``, position counting
micro-batches already produced in the epoch; it also records ``samples_seen = position * G``, which
lets a run resume with a different ``dp_world``/``micro_batch_size`` as long as ``samples_seen`` is a
multiple of the new ``G`` (same global order, re-cut).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nxd_finetune.errors import DataError


class ResumableSampler:
    """Yields this rank's micro-batches of row indices, epoch after epoch, without end.

    The state advances *before* a micro-batch is handed out, so ``state_dict()`` taken after
    consuming a batch resumes at the next one.
    """

    def __init__(
        self,
        num_items: int,
        micro_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        dp_rank: int = 0,
        dp_world: int = 1,
    ):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank={dp_rank} is outside dp_world={dp_world}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.num_items, self.micro_batch_size = num_items, micro_batch_size
        self.seed, self.shuffle, self.dp_rank, self.dp_world = seed, shuffle, dp_rank, dp_world
        self.batches_per_epoch = (num_items // dp_world) // micro_batch_size
        if self.batches_per_epoch == 0:
            raise DataError(
                f"{num_items} training rows cannot fill one micro-batch of {micro_batch_size} on each of "
                f"{dp_world} data-parallel ranks; add data or lower training.micro_batch_size"
            )
        self.epoch = 0
        self.position = 0

    @property
    def global_batch_rows(self) -> int:
        return self.micro_batch_size * self.dp_world

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The global row order of ``epoch`` (same on every rank)."""
        if not self.shuffle:
            return torch.arange(self.num_items)
        return torch.randperm(self.num_items, generator=torch.Generator().manual_seed(self.seed + epoch))

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches for ``epoch``."""
        per_rank = self.num_items // self.dp_world
        share = self.epoch_order(epoch)[: per_rank * self.dp_world][self.dp_rank :: self.dp_world]
        m = self.micro_batch_size
        return [share[i * m : (i + 1) * m].tolist() for i in range(self.batches_per_epoch)]

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            if self.position >= self.batches_per_epoch:
                self.epoch, self.position = self.epoch + 1, 0
            epoch, batches = self.epoch, self.rank_batches(self.epoch)
            while self.epoch == epoch and self.position < self.batches_per_epoch:
                batch = batches[self.position]
                self.position += 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        epoch, position = self.epoch, self.position
        if position >= self.batches_per_epoch:
            epoch, position = epoch + 1, 0
        return {
            "epoch": epoch,
            "position": position,
            "samples_seen": position * self.global_batch_rows,
            "seed": self.seed,
            "num_items": self.num_items,
            "micro_batch_size": self.micro_batch_size,
            "dp_world": self.dp_world,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state``; raises DataError when it cannot describe the same order."""
        if state["seed"] != self.seed or state["num_items"] != self.num_items:
            raise DataError(
                f"data order cannot resume: checkpoint has seed={state['seed']}, rows={state['num_items']}; "
                f"this run has seed={self.seed}, rows={self.num_items} (did the data or packing change?)"
            )
        seen, g = int(state["samples_seen"]), self.global_batch_rows
        if seen % g:
            raise DataError(
                f"cannot resume: {seen} rows seen this epoch is not a multiple of micro_batch_size x dp_world = {g}"
            )
        self.epoch, self.position = int(state["epoch"]), seen // g


def one_pass(n: int, micro_batch_size: int, dp_rank: int = 0, dp_world: int = 1,
             fixed_shape: bool = False) -> list[list[int]]:
    """Rank ``dp_rank``'s micro-batches of one ordered pass over ``n`` items (eval, the reference
    pass): items ``r, r + w, ...``, padded with -1 so that every rank has the same number of
    micro-batches (collectives stay in step); the last one filled up to ``micro_batch_size`` with
    -1 when ``fixed_shape``."""
    per_rank = -(-n // dp_world)
    mine = [j if j < n else -1 for j in range(dp_rank, per_rank * dp_world, dp_world)]
    batches = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
    if fixed_shape and batches:
        batches[-1] += [-1] * (micro_batch_size - len(batches[-1]))
    return batches

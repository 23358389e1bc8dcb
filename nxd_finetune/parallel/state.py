"""Parallel dimensions and the process groups that realise them.

Rank layout (as Megatron-LM and NeuronX Distributed): tensor-parallel ranks vary fastest, then
data-parallel, then pipeline::

    global_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the ranks of one TP group are consecutive (one node / one NeuronLink ring holds them), the
ranks of one DP group are ``tp`` apart and those of one PP group ``dp * tp`` apart. Example,
world 8 with tp=2, pp=2, dp=2: tp groups [0,1] [2,3] [4,5] [6,7]; dp groups [0,2] [1,3] [4,6]
[5,7]; pp groups [0,4] [1,5] [2,6] [3,7].

:class:`ParallelState` owns the groups and is passed to whoever needs them; nothing here is a
module-level global. Groups of size one are real (size-one) process groups when a default group
is initialised, so collectives on them are well defined; the collectives in
:mod:`nxd_finetune.parallel.mappings` skip size-one groups entirely. With no process group
initialised (a plain single process) every group is ``None`` and every size is 1.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from nxd_finetune.errors import NxdError

ProcessGroup = dist.ProcessGroup


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Degrees of tensor (``tp``), pipeline (``pp``) and data (``dp``) parallelism.

    Raises NxdError (one line, with the numbers) when a degree is not a positive integer.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise NxdError(f"parallel.{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> ParallelDims:
        """Dims with ``dp = world_size / (tp * pp)``; NxdError when that does not divide."""
        cls(tp=tp, pp=pp)  # validates the degrees
        if world_size % (tp * pp):
            raise NxdError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a global rank (see the module docstring)."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """Global rank at the given coordinates (inverse of :meth:`coords`)."""
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def tp_ranks(self, pp_rank: int, dp_rank: int) -> list[int]:
        return [self.rank_of(pp_rank, dp_rank, t) for t in range(self.tp)]

    def dp_ranks(self, pp_rank: int, tp_rank: int) -> list[int]:
        return [self.rank_of(pp_rank, d, tp_rank) for d in range(self.dp)]

    def pp_ranks(self, dp_rank: int, tp_rank: int) -> list[int]:
        return [self.rank_of(p, dp_rank, tp_rank) for p in range(self.pp)]


class ParallelState:
    """The tp / dp / pp process groups of this rank, built from the initialised default group.

    Construction is collective: every rank of the world must build its ``ParallelState`` with the
    same dims, in the same order relative to other group creation (``dist.new_group`` rule).
    Raises NxdError when ``dims.world_size`` differs from the world size. Without an initialised
    default group, only ``world_size == 1`` is accepted and all groups are ``None``.

    Attributes: ``dims``, ``rank``, ``world_size``; for each of ``tp``, ``dp``, ``pp``:
    ``<x>_rank`` (rank inside the group), ``<x>_size``, ``<x>_group`` and ``<x>_ranks`` (the
    global ranks of this rank's group, in group-rank order; pipeline send/recv needs them).
    """

    def __init__(self, dims: ParallelDims) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        if dims.world_size != world:
            raise NxdError(
                f"tp*pp*dp = {dims.tp}*{dims.pp}*{dims.dp} = {dims.world_size} ranks, "
                f"but the world has {world} process(es)"
            )
        self.dims = dims
        self.world_size = world
        self.rank = dist.get_rank() if initialised else 0
        self.pp_rank, self.dp_rank, self.tp_rank = dims.coords(self.rank)
        self.tp_size, self.dp_size, self.pp_size = dims.tp, dims.dp, dims.pp
        self.tp_ranks = dims.tp_ranks(self.pp_rank, self.dp_rank)
        self.dp_ranks = dims.dp_ranks(self.pp_rank, self.tp_rank)
        self.pp_ranks = dims.pp_ranks(self.dp_rank, self.tp_rank)
        self._initialised = initialised
        # new_group must be called by every rank for every group, in the same order
        self.tp_group = self._make_groups([dims.tp_ranks(p, d) for p in range(dims.pp) for d in range(dims.dp)])
        self.dp_group = self._make_groups([dims.dp_ranks(p, t) for p in range(dims.pp) for t in range(dims.tp)])
        self.pp_group = self._make_groups([dims.pp_ranks(d, t) for d in range(dims.dp) for t in range(dims.tp)])
        self._tp_subgroups: dict[int, ProcessGroup | None] = {dims.tp: self.tp_group}

    def _make_groups(self, all_ranks: list[list[int]]) -> ProcessGroup | None:
        if not self._initialised:
            return None
        mine = None
        for ranks in all_ranks:
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine = group
        return mine

    def tp_subgroup(self, size: int) -> ProcessGroup | None:
        """The group of ``size`` consecutive TP ranks holding this rank (``size`` divides tp).

        Used for tensors replicated over a block of TP ranks (KV heads when tp exceeds the KV head
        count). Collective on the first call for a given ``size``: every rank of the world must
        make it (``apply_tp_plan`` does, for the sizes the plan needs); later calls are cached.
        Raises ValueError when ``size`` does not divide tp.
        """
        if size < 1 or self.tp_size % size:
            raise ValueError(f"TP subgroup size {size} does not divide tp={self.tp_size}")
        if size not in self._tp_subgroups:
            d = self.dims
            blocks = [
                [d.rank_of(p, q, b * size + i) for i in range(size)]
                for p in range(d.pp)
                for q in range(d.dp)
                for b in range(d.tp // size)
            ]
            self._tp_subgroups[size] = self._make_groups(blocks)
        return self._tp_subgroups[size]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        """One line for logs: ``rank 3/8: tp 1/2, dp 1/2, pp 0/2``."""
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, "
            f"dp {self.dp_rank}/{self.dp_size}, pp {self.pp_rank}/{self.pp_size}"
        )

    def __repr__(self) -> str:
        return f"ParallelState({self.describe()})"

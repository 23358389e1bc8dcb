"""Process groups for collectives on host (CPU) values, beside the device's main groups."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from nxd_finetune.parallel.state import ParallelState


@dataclasses.dataclass(frozen=True)
class HostGroups:
    """Process groups for collectives on CPU tensors and pickled objects (parameter counts, the
    stop-signal flag, RNG states, checkpoint ids and barriers, the pipeline stages' adapter parts):
    ``world`` (None: the default group) and this rank's ``tp`` / ``pp`` / ``dp`` groups, over the
    same ranks as :class:`ParallelState`'s. Single process: all None (no collective is made).

    Under gloo they are the main groups. The ``xla`` backend takes XLA tensors only (a CPU tensor
    raises ``Expected XLA tensor``) and its barrier returns at once, nccl takes CUDA tensors only:
    under those backends :meth:`for_state` creates gloo groups over the same ranks beside the main
    ones (as Megatron-LM's ``*_GLOO`` groups).
    """

    world: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None

    @classmethod
    def for_state(cls, state: ParallelState, separate: bool | None = None) -> HostGroups:
        """The host groups of ``state``'s layout. ``separate``: gloo groups of their own (True),
        ``state``'s groups (False), or True unless the default backend is gloo (None). Collective
        when a default group is initialised: every rank calls it, in the same order relative to
        other group creation."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        if not (dist.get_backend() != "gloo" if separate is None else separate):
            return cls(None, state.tp_group, state.pp_group, state.dp_group)
        d = state.dims

        def mine(blocks: list[list[int]]) -> dist.ProcessGroup:
            groups = [(ranks, dist.new_group(ranks, backend="gloo")) for ranks in blocks]
            return next(g for ranks, g in groups if state.rank in ranks)

        world = dist.new_group(backend="gloo")
        return cls(world, mine([d.tp_ranks(p, q) for p in range(d.pp) for q in range(d.dp)]),
                   mine([d.pp_ranks(q, t) for q in range(d.dp) for t in range(d.tp)]),
                   mine([d.dp_ranks(p, t) for p in range(d.pp) for t in range(d.tp)]))

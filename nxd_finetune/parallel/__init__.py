"""Process groups, autograd collectives and tensor/sequence-parallel layers.

- :mod:`.state`: ``Layout`` (named axes: pp, dp, tp) and ``ParallelState`` (the groups by axis
  name; rank layout tp fastest, then dp, then pp).
- :mod:`.placement`: ``Placement`` (a parameter's ``Shard`` / ``Replicate`` / ``Partial`` per
  axis), the slice and gather helpers every reader uses.
- :mod:`.mappings`: collectives as autograd functions with one-line contracts.
- :mod:`.layers`: Column/Row-parallel linears, vocab-parallel embedding (the vocab-parallel cross
  entropy is in :mod:`nxd_finetune.loss`).
- :mod:`.plan`: ``apply_tp_plan`` (the families' plans are data in
  :mod:`nxd_finetune.models.families`), the checkpoint slice reader and the gradient sync of
  replicated parameters.
- :mod:`.recompute`: activation checkpointing of a module's forward.

Nothing here is imported by ``nxd_finetune.models``.
"""

from nxd_finetune.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from nxd_finetune.parallel.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    gather_full,
    iter_placements,
    placement_map,
    shard_slice,
    shard_tensor,
)
from nxd_finetune.parallel.plan import (
    allreduce_replicated_grads,
    apply_tp_plan,
    check_tp_config,
    kv_replication,
    make_slice_reader,
    tp_plan_for,
)
from nxd_finetune.parallel.state import Layout, ParallelState

__all__ = [
    "ColumnParallelLinear",
    "Layout",
    "ParallelState",
    "Partial",
    "Placement",
    "Replicate",
    "RowParallelLinear",
    "Shard",
    "VocabParallelEmbedding",
    "allreduce_replicated_grads",
    "apply_tp_plan",
    "check_tp_config",
    "gather_full",
    "iter_placements",
    "kv_replication",
    "make_slice_reader",
    "placement_map",
    "shard_slice",
    "shard_tensor",
    "tp_plan_for",
]

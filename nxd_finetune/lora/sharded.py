"""LoRA on tensor-parallel bases: the factors follow the base layer's sharding.

The layers run their base layer's own steps (``parallel_input`` / ``local_output`` / ``finish`` of
:class:`ColumnParallelLinear`, ``parallel_input`` / ``local_partial`` / ``reduce`` / ``add_bias`` of
:class:`RowParallelLinear`) and add the adapter path between them, as PEFT's tensor-parallel LoRA
calls its base layer: every collective lives in ``parallel/``, none is written here.

:class:`ColumnParallelLoraLinear` and :class:`RowParallelLoraLinear` are registered with
:func:`~nxd_finetune.lora.layers.register_lora_layer` when this module is imported (importing
``nxd_finetune.lora`` does), so ``inject_lora`` wraps sharded bases like plain ones, with the same
parameter names. Each factor's ``nn.Linear`` carries ``placements = {"weight": Placement}``,
derived from the base weight's (:func:`factor_placements`, axis by axis): ``iter_placements``
finds it, ``load_adapter`` reads only this rank's slice, export gathers it
(``gather_adapter_state_dict``) and ``allreduce_replicated_grads`` sums what ``Partial`` says.
``s`` is the scaling, ``drop`` the LoRA dropout; ``p = tp / replicas`` output chunks.

Column-parallel base (``W [out, in]`` split on out, ``W_l [out/p, in]``)::

    x_in = gather_from_sequence(x) under SP, else copy_to_tp(x)     (the base's own collective)
    y_l  = x_in W_l^T + b_l + s * B_l A drop(x_in)
    lora_A [r, in] replicated                   Partial on tp
    lora_B [out/p, r] split like W              the base weight's Shard (replicas: partial over them)

The LoRA path reads the base's communicated input, so its input gradient joins the base's partial
sums in the base's one backward collective (all-reduce; reduce-scatter under SP). ``h = A x_in`` is
replicated, but ``dL/dh = B_l^T dy_l`` on one rank is a partial sum over the output shards, so
``lora_A``'s gradient is a TP partial sum (``copy_to_tp`` on the input does not change that: it
sums ``dL/dx``, not ``dL/dA``). It is summed once per optimizer step by
``allreduce_replicated_grads`` (one flat all-reduce of ``r * in`` per layer), not by an all-reduce
of ``dL/dh`` in every micro-batch's backward. ``lora_B``'s gradient is exact for its rows; with KV
replication the ``replicas`` ranks sharing a chunk back-propagate different query heads, so it is a
partial sum over them, like the base's K/V weight.

Row-parallel base (``W [out, in]`` split on in, ``W_l [out, in/tp]``)::

    x_l = x if input_is_parallel else scatter_to_tp(x)
    y   = R(x_l W_l^T) + b + s * B R(A_l drop(x)_l)
    R   = all-reduce (reduce_from_tp), under SP reduce-scatter on the sequence dim
          (reduce_scatter_to_sequence); the r-wide LoRA reduction is a second, small collective
    lora_A [r, in/tp] split on in               the base weight's Shard on dim 1, exact gradient
    lora_B [out, r] replicated                  Partial on tp under SP, else replicated

The LoRA term is added after the reduction, so the bias is added once; ``dL/dh`` after R's
backward (identity / all-gather) is the full value, so ``lora_A``'s gradient is exact. Under SP
each rank sees only its sequence chunk of ``dy``, so ``lora_B``'s gradient is a partial sum.

Initialisation: the full factors are built and initialised exactly as :class:`LoraLinear` would
(same values, same draws from the global RNG), then sliced; with the same seed on every rank a tp
run starts from the tp=1 adapter, and replicated factors are equal on all TP ranks. Ranks seeded
differently would hold different replicated ``lora_A`` (nothing here checks it).

Dropout (``lora_dropout > 0``) draws from the global RNG, as the unsharded layer does. Column:
``drop`` acts on the replicated ``x_in`` ``[*, in]``, the tensor the unsharded layer drops. Row:
the ``[*, in]`` mask of the unsharded layer is drawn in full and this rank keeps its slice. With
the same RNG state on the TP ranks (same seed, same draws, which the model guarantees: every TP
rank runs the same ops) the masks are bit-for-bit those of the unsharded model, and activation
checkpointing (which restores the global RNG) recomputes them. What differs: a row layer draws
``tp`` times the random numbers it uses and holds the full-width mask transiently; ranks with
different RNG states would drop different features of one replicated input. Verified on CPU
(``F.dropout``'s mask equals ``bernoulli_`` on ``empty_like``); fused accelerator dropout kernels
may draw differently.

``merge()`` / ``unmerge()`` are :class:`LoraLinear`'s: each rank folds ``B_l @ A_l`` (the shape of
its base shard) into its shard; replicas fold identical chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nxd_finetune.lora.layers import LoraLinear, init_lora_factors, register_lora_layer
from nxd_finetune.parallel.layers import ColumnParallelLinear, RowParallelLinear
from nxd_finetune.parallel.placement import AxisPlacement, Partial, Placement, Shard

__all__ = ["ColumnParallelLoraLinear", "RowParallelLoraLinear", "factor_placements"]


def factor_placements(weight: Placement, r: int, b_partial_on_input: bool) -> tuple[Placement, Placement]:
    """``lora_A [r, in]`` and ``lora_B [out, r]`` placed after the base ``weight [out, in]``, axis by
    axis: where the weight is split on its output dim, ``lora_B`` is split alike and ``lora_A``'s
    gradient is partial (``dL/dh`` on one rank covers its output features only); where it is split
    on its input dim, ``lora_A`` is split alike and ``lora_B`` is whole, its gradient partial when
    ``b_partial_on_input`` (the base runs on sequence shards); elsewhere both as the weight."""
    out, inp = weight.full_shape
    on_a: list[tuple[str, AxisPlacement]] = []
    on_b: list[tuple[str, AxisPlacement]] = []
    for axis, p in weight.on:
        if isinstance(p, Shard) and p.dim == 0:
            on_a.append((axis, Partial()))
            on_b.append((axis, p))
        elif isinstance(p, Shard):
            on_a.append((axis, p))
            if b_partial_on_input:
                on_b.append((axis, Partial()))
        else:
            on_a.append((axis, p))
            on_b.append((axis, p))
    return Placement((r, inp), tuple(on_a)), Placement((out, r), tuple(on_b))


def _placement(linear: nn.Linear) -> Placement:
    """The factor's placement; a whole-tensor one while the factor is still full (during ``__init__``)."""
    placement = getattr(linear, "placements", {}).get("weight")
    return placement if placement is not None else Placement(tuple(linear.weight.shape))


def _keep_slice(linear: nn.Linear, placement: Placement) -> None:
    """Replace a full factor by this rank's slice and attach ``placement``."""
    w = linear.weight
    linear.weight = nn.Parameter(placement.take(w.detach()).clone(), requires_grad=w.requires_grad)
    linear.out_features, linear.in_features = placement.local_shape
    # torch's stub types Module.__setattr__ for tensors and modules only; plain attributes are fine
    linear.placements = {"weight": placement}  # type: ignore[assignment]


class _ShardedLoraLinear(LoraLinear):
    """Common parts: full-size init then slicing, and the LoRA term on a prepared input."""

    base_layer: ColumnParallelLinear | RowParallelLinear

    def __init__(
        self,
        base: nn.Module,
        r: int,
        lora_alpha: float,
        lora_dropout: float = 0.0,
        use_rslora: bool = False,
        init_lora_weights: str = "default",
    ) -> None:
        super().__init__(base, r, lora_alpha, lora_dropout, use_rslora, init_lora_weights)  # full factors
        spec_a, spec_b = self._factor_placements()
        _keep_slice(self.lora_A, spec_a)
        _keep_slice(self.lora_B, spec_b)

    def _factor_placements(self) -> tuple[Placement, Placement]:
        base = self.base_layer
        return factor_placements(base.placements["weight"], self.r,
                                 isinstance(base, RowParallelLinear) and base.sequence_parallel)

    @torch.no_grad()
    def reset_lora_parameters(self, init_lora_weights: str = "default") -> None:
        """:class:`LoraLinear`'s init on full-size factors (the same RNG draws on every rank, and
        as at tp=1), then this rank's slices are kept."""
        a, b = self.lora_A.weight, self.lora_B.weight
        spec_a, spec_b = _placement(self.lora_A), _placement(self.lora_B)
        full_a, full_b = a.new_empty(spec_a.full_shape), b.new_empty(spec_b.full_shape)
        init_lora_factors(full_a, full_b, self.r, init_lora_weights)
        a.copy_(spec_a.take(full_a))
        b.copy_(spec_b.take(full_b))

    def _lora(self, dropped: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.lora_A(dropped)) * self.scaling


class ColumnParallelLoraLinear(_ShardedLoraLinear):
    """LoRA around a :class:`ColumnParallelLinear`: ``lora_A [r, in]`` replicated, ``lora_B
    [out/p, r]`` split like the base's output. Input and output as the base's (``[*, out/p]``,
    or gathered with ``gather_output``). See the module docstring for the collectives."""

    base_layer: ColumnParallelLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.merged:
            return base(x)
        x_in = base.parallel_input(x)
        y = base.local_output(x_in)
        lora_x = x_in if self._autocast_keeps(x_in) else x_in.to(self.lora_A.weight.dtype)
        return base.finish((y + self._added(y, lora_x)).to(y.dtype))

    def _added(self, y: torch.Tensor, lora_x: torch.Tensor) -> torch.Tensor:
        """What the adapter adds to the local output ``y``; ``lora_x``: the input in the factors' dtype."""
        return self._lora(self.lora_dropout(lora_x))


class RowParallelLoraLinear(_ShardedLoraLinear):
    """LoRA around a :class:`RowParallelLinear`: ``lora_A [r, in/tp]`` split like the base's
    input, its ``r``-wide output reduced over TP, then ``lora_B [out, r]`` replicated, added after
    the base's reduction. Input and output as the base's. See the module docstring."""

    base_layer: RowParallelLinear

    def _drop_local(self, x_l: torch.Tensor) -> torch.Tensor:
        """Dropout on this rank's input slice with its slice of the full-width mask (the mask the
        unsharded layer would draw from the same RNG state)."""
        drop = self.lora_dropout
        if not isinstance(drop, nn.Dropout) or not drop.training or drop.p == 0:
            return x_l
        placement = _placement(self.lora_A)
        noise = F.dropout(x_l.new_ones((*x_l.shape[:-1], placement.full_shape[1])), drop.p, training=True)
        # contiguous copy of the slice (the factor's columns): autograd keeps only it, the full mask is freed here
        cols = placement.pieces()[0][1]
        return x_l * noise[..., cols].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if self.merged:
            return base(x)
        x_l = base.parallel_input(x)
        y = base.add_bias(base.reduce(base.local_partial(x_l)))
        lora_x = x_l if self._autocast_keeps(x_l) else x_l.to(self.lora_A.weight.dtype)
        h = base.reduce(self.lora_A(self._drop_local(lora_x)))
        return (y + self.lora_B(h) * self.scaling).to(y.dtype)


register_lora_layer(ColumnParallelLinear, ColumnParallelLoraLinear)
register_lora_layer(RowParallelLinear, RowParallelLoraLinear)

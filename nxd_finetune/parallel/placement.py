"""Where a parameter lives on each parallel axis: its :class:`Placement`.

A placement maps axis names to :class:`Shard` (split on a dim), :class:`Replicate` (whole, and an
equal gradient, on every rank of the axis; the default for an axis not named) or :class:`Partial`
(whole on every rank, but the gradient one rank computes is a partial sum over the axis). Every
reader asks the placement instead of naming an axis:

- gradient sums: :meth:`Placement.partial_sums` (model axes, before the data-parallel reduction)
  and :meth:`Placement.summed_over` (the data axes of the layout it is not sharded on: dense
  weights over every data axis, an expert weight sharded over ``ep`` over the others);
- ZeRO-1 partitions a parameter over :meth:`Placement.summed_over`;
- the gradient norm counts a parameter on the ranks :meth:`Placement.counted_at` names;
- checkpoints read :meth:`Placement.pieces` of the full tensor, export and checkpoint saves gather
  with :func:`gather_full`.

Placements live on modules (``module.placements: dict[str, Placement]``, one per parameter
attribute; :func:`iter_placements`), not on parameters, because checkpoint materialisation replaces
the parameter objects. Shards of several axes compose: each cuts what the axes before it (in the
placement's order, outermost first) left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.parallel.mappings import all_gather, group_size
from nxd_finetune.parallel.state import Layout, ParallelState, ProcessGroup

if TYPE_CHECKING:
    from nxd_finetune.models.loading import TensorSlice


class Indexable(Protocol):
    """A full tensor or anything sliced like it (a safetensors slice)."""

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class Shard:
    """Split on ``dim`` into ``pieces`` equal contiguous chunks; this rank holds chunk ``index``.

    ``replicas``: how many consecutive ranks of the axis hold the same chunk (axis degree ==
    ``pieces * replicas``; >1 for KV heads when tp exceeds their count); their gradients are
    partial sums over that block. ``parts``: a fused tensor (Phi's ``qkv_proj``: q, k and v rows)
    as the sizes of its pieces along ``dim``; each is split on its own and this rank holds its chunk
    of every piece, in order."""

    dim: int
    pieces: int
    index: int
    replicas: int = 1
    parts: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Whole on every rank of the axis (on a data axis: its gradient is summed over the axis)."""


@dataclasses.dataclass(frozen=True)
class Partial:
    """Whole on every rank of the axis, its gradient a partial sum over the whole axis (a norm
    that runs on sequence shards, a LoRA factor that multiplies sharded features)."""


AxisPlacement = Shard | Replicate | Partial
REPLICATE = Replicate()


def shard_slice(full_shape: tuple[int, ...], partition_dim: int, rank: int, world: int) -> tuple[slice, ...]:
    """Slices selecting chunk ``rank`` of ``world`` equal chunks of ``full_shape`` along
    ``partition_dim``; for ``safe_open(...).get_slice(key)[shard_slice(...)]``.

    Raises NxdError when the dim does not divide by ``world``.
    """
    size = full_shape[partition_dim]
    if size % world:
        raise NxdError(f"dim {partition_dim} of a {tuple(full_shape)} tensor ({size}) is not divisible by {world}")
    step = size // world
    index = [slice(None)] * len(full_shape)
    index[partition_dim] = slice(rank * step, (rank + 1) * step)
    return tuple(index)


@dataclasses.dataclass(frozen=True)
class Placement:
    """A parameter's ``full_shape`` (unsharded, as checkpoints hold it) and its placement per axis
    (``on``: ``((axis, Shard | Replicate | Partial), ...)`` outermost first; axes not named:
    :class:`Replicate`)."""

    full_shape: tuple[int, ...]
    on: tuple[tuple[str, AxisPlacement], ...] = ()

    def along(self, axis: str) -> AxisPlacement:
        """The placement on ``axis`` (:class:`Replicate` when not named)."""
        return dict(self.on).get(axis, REPLICATE)

    def shards(self) -> list[tuple[str, Shard]]:
        """``(axis, Shard)`` for the axes that split it, outermost first."""
        return [(axis, p) for axis, p in self.on if isinstance(p, Shard)]

    @property
    def sharded(self) -> bool:
        """Whether a rank holds less than the whole tensor."""
        return bool(self.shards())

    def with_shape(self, full_shape: tuple[int, ...]) -> Placement:
        """The same placement for a tensor of another full shape (a bias, a LoRA factor)."""
        return dataclasses.replace(self, full_shape=tuple(full_shape))

    def partial_sums(self, layout: Layout) -> list[tuple[str, int]]:
        """``(axis, block)``: the gradient must be summed over blocks of ``block`` consecutive ranks
        of each model axis (a :class:`Partial` axis whole, a replicated :class:`Shard` its
        ``replicas``); axes of degree one are left out."""
        out = []
        for axis, p in self.on:
            if layout.kind(axis) != "model" or layout.degree(axis) == 1:
                continue
            if isinstance(p, Partial):
                out.append((axis, layout.degree(axis)))
            elif isinstance(p, Shard) and p.replicas > 1:
                out.append((axis, p.replicas))
        return out

    def summed_over(self, layout: Layout) -> tuple[str, ...]:
        """The data axes its gradient is summed over (data parallel; ZeRO-1 partitions it over
        them): every data axis of ``layout`` it is not sharded on."""
        return tuple(axis for axis in layout.data_axes if not isinstance(self.along(axis), Shard))

    def counted_at(self, coords: Mapping[str, int], axes: Iterable[str], layout: Layout,
                   partitioned: tuple[str, ...] = ()) -> bool:
        """Whether this rank's copy enters a sum over ``axes`` (a gradient norm, a parameter count):
        on a stage axis and on ``partitioned`` ones (ZeRO-1 slices) every rank's, on a sharded axis
        the first replica of each chunk, elsewhere coordinate 0's."""
        for axis in axes:
            if layout.kind(axis) == "stage" or axis in partitioned:
                continue
            p = self.along(axis)
            if coords[axis] % (p.replicas if isinstance(p, Shard) else layout.degree(axis)):
                return False
        return True

    def _region(self) -> tuple[list[list[tuple[int, int]]], int | None]:
        """This rank's intervals of every dim (several only on a fused dim) and that dim."""
        region = [[(0, n)] for n in self.full_shape]
        fused = None
        for _, s in self.shards():
            spans = region[s.dim]
            if len(spans) > 1:
                raise NxdError(f"a {self.full_shape} tensor is split twice on its fused dim {s.dim}")
            start, stop = spans[0]
            if len(s.parts) > 1:
                if sum(s.parts) != stop - start:
                    raise NxdError(f"fused parts {s.parts} do not add up to dim {s.dim} of {self.full_shape}")
                out, offset = [], start
                for size in s.parts:
                    piece = shard_slice((size,), 0, s.index, s.pieces)[0]
                    out.append((offset + piece.start, offset + piece.stop))
                    offset += size
                region[s.dim], fused = out, s.dim
            else:
                piece = shard_slice((stop - start,), 0, s.index, s.pieces)[0]
                region[s.dim] = [(start + piece.start, start + piece.stop)]
        return region, fused

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in spans) for spans in self._region()[0])

    @property
    def cat_dim(self) -> int:
        """The dim along which :meth:`pieces` are concatenated (a fused dim; 0 otherwise)."""
        return self._region()[1] or 0

    def pieces(self) -> list[tuple[slice, ...]]:
        """The indices of this rank's chunks in the full tensor, concatenated along :attr:`cat_dim`
        (one unless fused)."""
        region, fused = self._region()
        single = [slice(*spans[0]) for spans in region]
        if fused is None:
            return [tuple(single)]
        return [tuple(slice(a, b) if d == fused else single[d] for d in range(len(region))) for a, b in region[fused]]

    def take(self, source: torch.Tensor | TensorSlice | Indexable) -> torch.Tensor:
        """This rank's part of ``source`` (the full tensor, or anything indexable like it: a
        safetensors slice), its pieces concatenated."""
        chunks = [source[index] for index in self.pieces()]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=self.cat_dim)


def shard_tensor(full: torch.Tensor, placement: Placement) -> torch.Tensor:
    """This rank's part of ``full`` (a copy, contiguous)."""
    if tuple(full.shape) != placement.full_shape:
        raise NxdError(f"tensor of shape {tuple(full.shape)} does not match the sharded shape {placement.full_shape}")
    return placement.take(full).clone().contiguous()


def _gather_axis(local: torch.Tensor, s: Shard, group: ProcessGroup | None) -> torch.Tensor:
    gathered = all_gather(local, s.dim, group)
    if len(s.parts) > 1:  # every rank's chunk is its pieces in order: regroup piece by piece
        sizes = [size // s.pieces for size in s.parts]
        per_rank = [c.split(sizes, dim=s.dim) for c in gathered.chunk(s.pieces, s.dim)]
        return torch.cat([r[i] for i in range(len(sizes)) for r in per_rank], dim=s.dim)
    if s.replicas == 1:
        return gathered
    return torch.cat(gathered.chunk(s.pieces * s.replicas, dim=s.dim)[:: s.replicas], dim=s.dim)


def gather_full(local: torch.Tensor, placement: Placement | None, state: ParallelState) -> torch.Tensor:
    """The full tensor from every rank's ``local`` part (no autograd): gathered over each sharding
    axis's group, innermost first; replicated chunks taken once. Collective over those groups."""
    out = local.detach()
    for axis, s in reversed(placement.shards() if placement is not None else []):
        group = state.group(axis)
        if group_size(group) > 1:
            out = _gather_axis(out, s, group)
    return out


def iter_placements(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, Placement]]:
    """``(parameter_name, module, attribute, placement)`` for every parameter with a placement, in
    ``named_modules`` order (the same on every rank)."""
    for module_name, module in model.named_modules():
        for attr, placement in getattr(module, "placements", {}).items():
            if module._parameters.get(attr) is not None:
                yield (f"{module_name}.{attr}" if module_name else attr), module, attr, placement


def placement_map(model: nn.Module) -> dict[int, Placement]:
    """``{id(parameter): Placement}`` for the parameters of ``model`` that carry one."""
    return {id(module._parameters[attr]): pl for _, module, attr, pl in iter_placements(model)}


def placement_of(param: torch.Tensor, placements: Mapping[int, Placement]) -> Placement:
    """``param``'s placement in ``placements`` (:func:`placement_map`), else replicated everywhere."""
    found = placements.get(id(param))
    return found if found is not None else Placement(tuple(param.shape))

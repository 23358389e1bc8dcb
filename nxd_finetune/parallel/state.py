"""Named parallel axes (:class:`Layout`) and the process groups that realise them (:class:`ParallelState`).

A layout is an ordered list of named axes with a degree each, outermost first. A global rank is
the row-major index of its coordinates, so the last axis varies fastest. The default order is
Megatron-LM's and NeuronX Distributed's, ``pp``, ``dp``, ``tp``::

    global_rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

so the ranks of one TP group are consecutive (one node / one NeuronLink ring holds them), the
ranks of one DP group are ``tp`` apart and those of one PP group ``dp * tp`` apart. Example,
world 8 with tp=2, pp=2, dp=2: tp groups [0,1] [2,3] [4,5] [6,7]; dp groups [0,2] [1,3] [4,6]
[5,7]; pp groups [0,4] [1,5] [2,6] [3,7]. Every question about the layout is asked by axis name
(``layout.degree("tp")``, ``state.group("dp")``), so a new axis (experts, context) is one more
entry in :data:`AXES`, not a new attribute on every reader.

:class:`ParallelState` owns the groups and is passed to whoever needs them; nothing here is a
module-level global. The device groups come from a torch :class:`~torch.distributed.device_mesh.DeviceMesh`
over the layout's axes (group bookkeeping only, no DTensor). Groups of size one are real (size-one)
process groups when a default group is initialised, so collectives on them are well defined; the
collectives in :mod:`nxd_finetune.parallel.mappings` skip size-one groups entirely. With no
process group initialised (a plain single process) every group is ``None`` and every size is 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping
from typing import Literal

import torch.distributed as dist

from nxd_finetune.device import mesh_device_type
from nxd_finetune.errors import NxdError

ProcessGroup = dist.ProcessGroup

AXES: tuple[str, ...] = ("pp", "dp", "tp")
"""The parallel axes, outermost first (the last varies fastest over global ranks)."""
AxisKind = Literal["stage", "data", "model"]
KINDS: dict[str, AxisKind] = {"pp": "stage", "dp": "data", "tp": "model"}
"""What an axis splits: ``stage`` the layers (each rank holds its stage's parameters only),
``data`` the batch (a parameter's gradient is summed over the axis unless the parameter is sharded
on it), ``model`` the parameters of one batch (sharded, replicated or partial, see
:mod:`.placement`)."""
SHOWN: tuple[str, ...] = ("tp", "pp", "dp")
"""The order messages name axes in (the recipe's ``parallel`` section's)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """The degree of each named parallel axis, outermost first (``axes``: ``((name, degree), ...)``).

    Build it with :meth:`of` (degrees by name, 1 where not given) or :meth:`for_world`. An axis
    beyond :data:`AXES` is given with its kind in ``extra`` (``(("ep", "data"),)``): nothing that
    reads placements needs to know it. Raises NxdError (one line, with the numbers) when a degree
    is not a positive integer or an axis name is unknown.
    """

    axes: tuple[tuple[str, int], ...]
    extra: tuple[tuple[str, AxisKind], ...] = ()
    unions: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """Named groups of axes asked about as one axis (``(("dp", ("edp", "ep")),)`` under expert
    parallel: ``degree`` / ``coords`` / ``groups`` of ``dp`` are those of the axes together)."""

    def __post_init__(self) -> None:
        kinds = self._kinds()
        for name, value in self.axes:
            if name not in kinds:
                raise NxdError(f"unknown parallel axis {name!r} (known: {', '.join(kinds)})")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise NxdError(f"parallel.{name} must be a positive integer, got {value!r}")

    @classmethod
    def of(cls, **degrees: int) -> Layout:
        """The layout with these degrees (``Layout.of(tp=2, dp=2)``); axes not named have degree 1.

        ``ep`` (expert parallel, > 1) is carved out of ``dp``, as torchtitan and Megatron-LM do: the
        axes are then ``pp, edp, ep, tp`` (``edp = dp / ep``, both data axes) and ``dp`` is their
        union, so a dense weight is summed over the whole ``dp`` and an expert sharded over ``ep``
        over ``edp`` (the ranks holding the same experts). NxdError when ``ep`` does not divide ``dp``."""
        ep = degrees.pop("ep", 1)
        unknown = sorted(set(degrees) - set(AXES))
        if unknown:
            raise NxdError(f"unknown parallel axis {unknown[0]!r} (known: {', '.join(AXES)}, ep)")
        plain = cls(tuple((name, degrees.get(name, 1)) for name in AXES))
        cls((("ep", ep),), extra=(("ep", "data"),))  # validates ep
        if ep == 1:
            return plain
        dp = plain.degree("dp")
        if dp % ep:
            raise NxdError(f"parallel.ep={ep} does not divide the data-parallel degree dp={dp} "
                           "(expert-parallel ranks are carved out of dp)")
        axes = (("pp", plain.degree("pp")), ("edp", dp // ep), ("ep", ep), ("tp", plain.degree("tp")))
        return cls(axes, extra=(("edp", "data"), ("ep", "data")), unions=(("dp", ("edp", "ep")),))

    @classmethod
    def for_world(cls, world_size: int, **degrees: int) -> Layout:
        """The layout with these degrees and ``dp`` taking the rest of ``world_size``; NxdError when
        the product of the given degrees does not divide it."""
        fixed = cls.of(**{k: v for k, v in degrees.items() if k != "ep"})  # validates the degrees
        others = math.prod(d for name, d in fixed.axes if name != "dp")
        if world_size % others:
            raise NxdError(f"world size {world_size} is not divisible by {fixed.product(skip='dp')} = {others}")
        return cls.of(**{**degrees, "dp": world_size // others})

    def product(self, skip: str | None = None) -> str:
        """``tp*pp*dp = 2*1*2`` for messages: the axes in the recipe's order (``parallel.tp``, ``pp``,
        ``dp``, then the others), ``skip`` left out."""
        shown = SHOWN + AXES
        order = sorted((n for n in self.names if n != skip),
                       key=lambda n: shown.index(n) if n in shown else len(shown))
        return "*".join(order) + " = " + "*".join(str(self.degree(n)) for n in order)

    def parts(self, axis: str) -> tuple[str, ...]:
        """The axes ``axis`` stands for: a union's, else ``(axis,)``."""
        return dict(self.unions).get(axis, (axis,))

    def _kinds(self) -> dict[str, AxisKind]:
        return {**KINDS, **dict(self.extra)}

    def kind(self, axis: str) -> AxisKind:
        """What ``axis`` splits (:data:`KINDS`)."""
        return self._kinds()[axis]

    def of_kind(self, kind: AxisKind) -> tuple[str, ...]:
        """This layout's axes of ``kind``, innermost (fastest) first."""
        return tuple(name for name in reversed(self.names) if self.kind(name) == kind)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes that split the batch, in layout order (``("dp",)`` by default)."""
        return tuple(name for name in self.names if self.kind(name) == "data")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(degree for _, degree in self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def degree(self, axis: str) -> int:
        """The degree of ``axis`` (a union's: the product of its axes'; KeyError for an axis this
        layout does not have)."""
        degrees = dict(self.axes)
        return math.prod(degrees[a] for a in self.parts(axis))

    def _stride(self, axis: str) -> int:
        names = self.names
        return math.prod(self.shape[names.index(axis) + 1:])

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinate of global ``rank`` on every axis (a union's: row-major over its axes)."""
        out = {name: (rank // self._stride(name)) % degree for name, degree in self.axes}
        for name, parts in self.unions:
            out[name] = 0
            for part in parts:
                out[name] = out[name] * self.degree(part) + out[part]
        return out

    def rank_of(self, coords: Mapping[str, int]) -> int:
        """The global rank at ``coords`` (missing axes: 0); inverse of :meth:`coords`."""
        return sum(coords.get(name, 0) * self._stride(name) for name in self.names)

    def group_ranks(self, axis: str, rank: int) -> list[int]:
        """The global ranks of ``rank``'s group along ``axis`` (same coordinates on every other
        axis), in group-rank order."""
        if axis in dict(self.unions):
            return next(g for g in self.groups(axis) if rank in g)
        base = rank - self.coords(rank)[axis] * self._stride(axis)
        return [base + i * self._stride(axis) for i in range(self.degree(axis))]

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``, in increasing order of their first rank."""
        return self.groups_over((axis,))

    def groups_over(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group spanning ``axes`` together (the ranks that differ only on those axes), each
        in increasing rank order, in increasing order of their first rank."""
        spanned = {part for axis in axes for part in self.parts(axis)}
        out: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coords(rank)
            out.setdefault(tuple(coords[name] for name in self.names if name not in spanned), []).append(rank)
        return list(out.values())

    def blocks(self, axis: str, size: int) -> list[list[int]]:
        """Every group along ``axis`` cut into blocks of ``size`` consecutive coordinates."""
        if size < 1 or self.degree(axis) % size:
            raise ValueError(f"{axis} subgroup size {size} does not divide {axis}={self.degree(axis)}")
        return [ranks[i:i + size] for ranks in self.groups(axis) for i in range(0, len(ranks), size)]


def _make_groups(blocks: list[list[int]], rank: int, backend: str | None = None) -> ProcessGroup:
    """``dist.new_group`` for every block (collective: every rank, same order); this rank's group."""
    mine = None
    for ranks in blocks:
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = group
    assert mine is not None  # the blocks cover the world
    return mine


class ParallelState:
    """This rank's place in a :class:`Layout` and its process groups, looked up by axis name.

    ``group(axis)``: the device group (collectives on the device's tensors); ``host_group(axis)``
    (``axis=None``: the whole world) the group for collectives on CPU tensors and pickled objects
    (parameter counts, the stop-signal flag, RNG states, checkpoint ids and barriers, pipeline
    stages' adapter parts). ``coord(axis)`` / ``size(axis)`` / ``ranks(axis)``: this rank's
    coordinate, the axis degree and the global ranks of this rank's group in group-rank order
    (pipeline send/recv needs them).

    Under gloo the host groups are the device groups. Other backends take their device's tensors
    only (``xla``: a CPU tensor raises ``Expected XLA tensor``, and its barrier returns at once; nccl
    takes CUDA tensors): under those backends gloo groups over the same ranks are made beside the device
    ones (as Megatron-LM's ``*_GLOO`` groups). ``separate_host``: make them (True), never (False),
    or unless the default backend is gloo (None).

    Construction is collective: every rank of the world must build its ``ParallelState`` with the
    same layout, in the same order relative to other group creation (``dist.new_group`` rule).
    Raises NxdError when ``layout.world_size`` differs from the world size. Without an initialised
    default group, only ``world_size == 1`` is accepted and all groups are ``None``.
    """

    def __init__(self, layout: Layout, separate_host: bool | None = None) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        if layout.world_size != world:
            raise NxdError(f"{layout.product()} = {layout.world_size} ranks, "
                           f"but the world has {world} process(es)")
        self.layout = layout
        self.world_size = world
        self.rank = dist.get_rank() if initialised else 0
        self._coords = layout.coords(self.rank)
        self._initialised = initialised
        unions = dict(layout.unions)
        self._groups: dict[str, ProcessGroup | None] = dict.fromkeys((*layout.names, *unions))
        self._host: dict[str | None, ProcessGroup | None] = dict.fromkeys((None, *layout.names, *unions))
        self._subgroups: dict[tuple[str, int], ProcessGroup | None] = {}
        self._over: dict[tuple[str, ...], ProcessGroup | None] = {}
        if not initialised:
            return
        from torch.distributed.device_mesh import init_device_mesh

        backend = dist.get_backend()
        mesh = init_device_mesh(mesh_device_type(backend), layout.shape, mesh_dim_names=layout.names)
        self._groups = {name: mesh.get_group(name) for name in layout.names}
        self._host = {None: None}
        self._host.update(self._groups)
        if separate_host if separate_host is not None else backend != "gloo":
            self._host = {None: dist.new_group(backend="gloo")}
            for name in layout.names:
                self._host[name] = _make_groups(layout.groups(name), self.rank, backend="gloo")
        for name in layout.names:
            self._subgroups[(name, layout.degree(name))] = self._groups[name]
        for n in range(2, len(layout.data_axes) + 1):  # the data-parallel groups of several data axes
            for axes in itertools.combinations(layout.data_axes, n):
                self._over[axes] = _make_groups(layout.groups_over(axes), self.rank)
        for name, parts in layout.unions:  # dp under expert parallel: the group over edp and ep
            self._groups[name] = self._over[parts]
            self._subgroups[(name, layout.degree(name))] = self._over[parts]
            separate = self._host[parts[0]] is not self._groups[parts[0]]
            self._host[name] = (_make_groups(layout.groups(name), self.rank, backend="gloo") if separate
                                else self._over[parts])

    def group(self, axis: str) -> ProcessGroup | None:
        """This rank's device group along ``axis`` (None without a default group)."""
        return self._groups[axis]

    def group_over(self, axes: tuple[str, ...]) -> ProcessGroup | None:
        """The device group spanning ``axes`` together: ``group(axis)`` for one axis, the world's
        (None) for none; for several data axes (in layout order) the group made at construction
        (a parameter's gradient sum over the data axes it is not sharded on). KeyError otherwise."""
        if len(axes) == 1:
            return self._groups[axes[0]]
        if not axes or not self._initialised:
            return None
        return self._over[axes]

    def size_over(self, axes: tuple[str, ...]) -> int:
        """The number of ranks in :meth:`group_over` ``(axes)``."""
        return math.prod(self.size(axis) for axis in axes)

    def host_group(self, axis: str | None = None) -> ProcessGroup | None:
        """This rank's group for CPU tensors along ``axis``; ``None``: the world's (None without a
        separate one: the default group)."""
        return self._host[axis]

    def coord(self, axis: str) -> int:
        """This rank's coordinate on ``axis`` (its rank inside ``group(axis)``)."""
        return self._coords[axis]

    def size(self, axis: str) -> int:
        """The degree of ``axis``."""
        return self.layout.degree(axis)

    def ranks(self, axis: str) -> list[int]:
        """The global ranks of this rank's group along ``axis``, in group-rank order."""
        return self.layout.group_ranks(axis, self.rank)

    def subgroup(self, axis: str, size: int) -> ProcessGroup | None:
        """The group of ``size`` consecutive ``axis`` ranks holding this rank (``size`` divides the
        axis degree).

        Used for tensors replicated over a block of TP ranks (KV heads when tp exceeds the KV head
        count). Collective on the first call for a given ``size``: every rank of the world must
        make it (``apply_tp_plan`` does, for the sizes the plan needs); later calls are cached.
        Raises ValueError when ``size`` does not divide the degree.
        """
        blocks = self.layout.blocks(axis, size)  # validates size
        if (axis, size) not in self._subgroups:
            self._subgroups[(axis, size)] = _make_groups(blocks, self.rank) if self._initialised else None
        return self._subgroups[(axis, size)]

    @property
    def is_first_stage(self) -> bool:
        return self.coord("pp") == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord("pp") == self.size("pp") - 1

    def describe(self) -> str:
        """One line for logs: ``rank 3/8: tp 1/2, dp 1/2, pp 0/2`` (fastest axis first)."""
        axes = ", ".join(f"{name} {self.coord(name)}/{self.size(name)}" for name in reversed(self.layout.names))
        return f"rank {self.rank}/{self.world_size}: {axes}"

    def __repr__(self) -> str:
        return f"ParallelState({self.describe()})"

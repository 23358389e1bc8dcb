"""From a rank's live modules and optimizer to layout-free tensors, and back.

:func:`collect` (collective) turns this rank's trainable parameters and optimizer state into
tensors keyed by global parameter name with full shapes: sharded tensors are gathered over the
axes their ``Placement`` names (``parallel.placement.gather_full``), ZeRO-1 flat shards are
consolidated per parameter (``Zero1Optimizer.export_param_states``). Only the rank that writes a
pipeline stage (coordinate 0 on every other axis) gets the tensors; the others take part in the
collectives only.

:func:`restore` (local, no collective) reads back just this rank's slices for its *current*
layout through a :class:`TensorReader`, so a checkpoint saved at tp=2 loads at tp=1, pp=2 or
dp=2 with ZeRO-1 and the other way round.

Which parameters: every parameter with ``requires_grad`` of the given modules (LoRA factors, or
the whole model for full SFT); frozen base weights come from ``model.path``. A weight tied across
pipeline stages (``lm_head.weight`` / ``model.embed_tokens.weight`` with ``tie_word_embeddings``)
is saved under the name each stage sees; a missing name falls back to its tied twin on load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypedDict

import torch
from torch import nn

from nxd_finetune.checkpoint.format import CheckpointError, optim_key, param_key
from nxd_finetune.parallel.placement import Placement, Shard, gather_full, iter_placements
from nxd_finetune.parallel.state import ParallelState
from nxd_finetune.parallel.zero1 import Zero1Optimizer

TIED_TWINS = {"lm_head.weight": "model.embed_tokens.weight", "model.embed_tokens.weight": "lm_head.weight"}


class SavedGroup(TypedDict):
    """An optimizer param group as a checkpoint stores it: its JSON-able options (lr, betas, ...)
    and the names of its parameters."""

    options: dict[str, Any]  # torch's param-group options, as _json_option stores them
    params: list[str]


@dataclasses.dataclass
class LocalParam:
    """A trainable parameter of this rank: its global ``name``, the live tensor and its placement
    (None: the whole tensor is on every rank)."""

    name: str
    param: nn.Parameter
    placement: Placement | None

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.placement.full_shape if self.placement is not None else tuple(self.param.shape)

    def index(self) -> list[tuple[slice, ...]] | None:
        """This rank's slices of the full tensor (one; several for a fused tensor, see
        ``Shard.parts``); None when it holds the whole tensor."""
        return self.placement.pieces() if self.placement is not None and self.placement.sharded else None


def trainable(modules: Sequence[nn.Module]) -> list[LocalParam]:
    """Trainable parameters of ``modules`` (a model, or this rank's pipeline-stage modules) in
    module order, each once. Raises CheckpointError when two different tensors share a name."""
    out: list[LocalParam] = []
    seen: dict[int, str] = {}
    names: set[str] = set()
    for module in modules:
        specs = {name: placement for name, _, _, placement in iter_placements(module)}
        for name, p in module.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            if name in names:
                raise CheckpointError(f"two different trainable parameters are both named {name!r}")
            seen[id(p)], names = name, names | {name}
            out.append(LocalParam(name, p, specs.get(name)))
    return out


def unwrap(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The optimizer that holds the state: ``ParallelOptimizer.optimizer`` (AdamW or a
    :class:`Zero1Optimizer`), or ``optimizer`` itself."""
    while optimizer is not None and isinstance(inner := getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = inner
    return optimizer


def _json_option(value: object) -> object:
    if isinstance(value, tuple | list):
        return [_json_option(v) for v in value]
    if torch.is_tensor(value) and value.dim() == 0:
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return None  # not storable (callables, tensors): left as the live optimizer has it


def group_options(optimizer: torch.optim.Optimizer | None, params: list[LocalParam]) -> list[SavedGroup]:
    """``[{"options": {lr, betas, ...}, "params": [names]}]`` for the optimizer's param groups.

    Raises CheckpointError when the optimizer holds a parameter that is not among ``params``
    (the modules given to ``save`` must cover what the optimizer steps)."""
    if optimizer is None:
        return []
    names = {id(lp.param): lp.name for lp in params}
    groups: list[SavedGroup] = []
    for group in optimizer.param_groups:
        members = [p for p in group["params"] if p.requires_grad]
        unknown = [tuple(p.shape) for p in members if id(p) not in names]
        if unknown:
            raise CheckpointError(f"the optimizer steps {len(unknown)} parameter(s) (shapes {unknown[:3]}) that are "
                                  "not trainable parameters of the modules given to the checkpoint")
        options = {k: _json_option(v) for k, v in group.items() if k != "params"}
        groups.append({"options": options, "params": [names[id(p)] for p in members]})
    return groups


def _per_param_states(optimizer: torch.optim.Optimizer | None) -> dict[int, dict[str, torch.Tensor]]:
    """``{id(param): {state: tensor}}``: TP-local, dp-complete. Collective over dp for ZeRO-1."""
    if optimizer is None:
        return {}
    if isinstance(optimizer, Zero1Optimizer):
        return {id(p): states for p, states in optimizer.export_param_states()}
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st:
                out[id(p)] = {k: (v if torch.is_tensor(v) else torch.tensor(v)) for k, v in st.items()}
    return out


def _cpu(t: torch.Tensor, copy: bool) -> torch.Tensor:
    """``t`` on the CPU: a copy that no later optimizer step can change (``copy``: async saves
    serialise it later), or else the tensor itself where it already is a contiguous CPU tensor."""
    return t.detach().to("cpu", copy=copy).contiguous()


@dataclasses.dataclass
class _Entry:
    key: str
    local: torch.Tensor
    spec: Placement | None  # None: not sharded (the same on every rank)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.full_shape if self.spec is not None else tuple(self.local.shape)


class StageTensors:
    """This rank's stage as layout-free tensors, ``param/<name>`` and ``optim/<name>/<state>``,
    one at a time.

    Construction is collective over dp for ZeRO-1 (the state export) and local otherwise;
    :meth:`plan` (local) gives every tensor's key, dtype and full shape before anything is gathered,
    so a writer can lay out its file first; :meth:`tensors` (collective over the sharding axes)
    gathers the sharded ones in :meth:`plan`'s order. A ZeRO-1 fp32 master is kept only for parameters that
    are not fp32 (otherwise it equals the parameter). Raises CheckpointError for an optimizer state
    that is neither a scalar nor shaped like its parameter.
    """

    def __init__(self, params: list[LocalParam], optimizer: torch.optim.Optimizer | None,
                 state: ParallelState | None) -> None:
        states = _per_param_states(unwrap(optimizer))
        self.state = state
        self.writes = state is None or all(state.coord(a) == 0 for a in state.layout.names
                                           if state.layout.kind(a) != "stage")
        self.entries: list[_Entry] = []
        for lp in params:
            spec = lp.placement if lp.index() is not None else None
            self.entries.append(_Entry(param_key(lp.name), lp.param, spec))
            for key, value in sorted(states.get(id(lp.param), {}).items()):
                if key == "master" and lp.param.dtype == torch.float32:
                    continue
                if value.dim() == 0:
                    self.entries.append(_Entry(optim_key(lp.name, key), value, None))
                elif tuple(value.shape) == tuple(lp.param.shape):
                    self.entries.append(_Entry(optim_key(lp.name, key), value, spec))
                else:
                    raise CheckpointError(f"optimizer state {key!r} of {lp.name} has shape {tuple(value.shape)}, "
                                          f"neither a scalar nor the parameter's {tuple(lp.param.shape)}")

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(key, dtype, full shape)`` of every tensor, in :meth:`tensors`' order. Local."""
        return [(e.key, e.local.dtype, e.shape) for e in self.entries]

    def _takes_part(self, e: _Entry) -> bool:
        """Whether this rank joins the gather of ``e``: coordinate 0 on every data axis ``e`` is not
        sharded on (the model axes' ranks all do, as the gathers need them)."""
        st = self.state
        if st is None:
            return True
        return all(st.coord(a) == 0 for a in st.layout.data_axes
                   if e.spec is None or not isinstance(e.spec.along(a), Shard))

    @torch.no_grad()
    def tensors(self, copy: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(key, full CPU tensor)`` on the writing rank (coordinate 0 on every axis but the
        stage), ``(key, None)`` on the ranks that take part in a gather only; nothing elsewhere.
        ``copy``: a CPU copy no later optimizer step can change, else the live tensor where no gather
        was needed. Collective over the sharding axes: every rank must consume the iterator to the end."""
        for e in self.entries:
            if not self._takes_part(e):
                continue
            full = gather_full(e.local, e.spec, self.state) if self.state is not None else e.local
            yield e.key, (_cpu(full, copy) if self.writes else None)
            del full


def collect(params: list[LocalParam], optimizer: torch.optim.Optimizer | None, state: ParallelState | None,
            copy: bool = True) -> dict[str, torch.Tensor] | None:
    """Layout-free tensors of this rank's stage at once (see :class:`StageTensors`): a dict on the
    writing rank (tp rank 0, dp rank 0), None elsewhere.

    ``copy=False`` (a save written before training goes on) returns the live CPU tensors where no
    gather was needed, instead of a host copy of the whole stage's parameters and optimizer state.
    Collective: over dp (ZeRO-1 export), then over the sharding axes.
    """
    stage = StageTensors(params, optimizer, state)
    out = {key: t for key, t in stage.tensors(copy) if t is not None}
    return out if stage.writes else None


class TensorReader(Protocol):
    """Where :func:`restore` reads: ``keys`` (every tensor key of the checkpoint), ``shape(key)``
    and ``read(key, index)`` (``index``: a tuple of slices, or None for the whole tensor)."""

    keys: set[str]

    def shape(self, key: str) -> tuple[int, ...]: ...

    def read(self, key: str, index: tuple[slice, ...] | None) -> torch.Tensor: ...


def _stored_name(name: str, keys: set[str]) -> str | None:
    if param_key(name) in keys:
        return name
    twin = TIED_TWINS.get(name)
    return twin if twin is not None and param_key(twin) in keys else None


def _read(reader: TensorReader, key: str, lp: LocalParam) -> torch.Tensor:
    shape = tuple(reader.shape(key))
    if shape == ():
        return reader.read(key, None)
    if shape != lp.full_shape:
        raise CheckpointError(f"checkpoint tensor {key} has shape {shape}, the model's {lp.name} is {lp.full_shape} "
                              "(was the checkpoint saved for another model or LoRA rank?)")
    index = lp.index()
    if index is None:
        return reader.read(key, None)
    chunks = [reader.read(key, piece) for piece in index]
    assert lp.placement is not None  # index() is None without a placement
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=lp.placement.cat_dim)


@torch.no_grad()
def restore(params: list[LocalParam], optimizer: torch.optim.Optimizer | None, reader: TensorReader,
            states: dict[str, list[str]], groups: Iterable[SavedGroup]) -> None:
    """Load this rank's slices of parameters and optimizer state, for its current layout.

    ``states``: ``{stored param name: [state names]}``; ``groups``: the saved param-group options
    (every stage's). Local: no collective. Raises CheckpointError naming the missing or
    misshapen tensors.
    """
    found = {lp.name: _stored_name(lp.name, reader.keys) for lp in params}
    missing = [n for n, s in found.items() if s is None]
    stored = {n: s for n, s in found.items() if s is not None}
    if missing:
        raise CheckpointError(f"the checkpoint has no tensor for {len(missing)} trainable parameter(s), e.g. "
                              f"{', '.join(missing[:3])} (was it saved for another model or LoRA config?)")
    for lp in params:
        lp.param.copy_(_read(reader, param_key(stored[lp.name]), lp))
    opt = unwrap(optimizer)
    if opt is None:
        return
    by_id = {id(lp.param): lp for lp in params}

    def saved_states(p: torch.Tensor) -> dict[str, torch.Tensor]:
        lp = by_id.get(id(p))
        if lp is None:
            raise CheckpointError(f"the optimizer steps a parameter of shape {tuple(p.shape)} that is not a "
                                  "trainable parameter of the modules given to the checkpoint")
        name = stored[lp.name]
        return {k: _read(reader, optim_key(name, k), lp) for k in states.get(name, [])}

    if isinstance(opt, Zero1Optimizer):
        opt.import_param_states(saved_states)
    else:
        _restore_plain(opt, saved_states)
    _restore_group_options(opt, params, stored, groups)


def _restore_plain(opt: torch.optim.Optimizer, saved_states: Callable[[torch.Tensor], dict]) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            loaded = {k: v for k, v in saved_states(p).items() if k != "master"}
            if not loaded:
                opt.state.pop(p, None)
                continue
            opt.state[p] = {k: v.clone() if v.dim() == 0 else v.to(device=p.device, dtype=p.dtype)
                            for k, v in loaded.items()}


def _restore_group_options(opt: torch.optim.Optimizer, params: list[LocalParam], stored: dict[str, str],
                           groups: Iterable[SavedGroup]) -> None:
    """Copy the saved options (lr, betas, ...) onto each live group, matched through the name
    of the group's first parameter; options the live group does not have are ignored."""
    saved = {name: g["options"] for g in groups for name in g["params"]}
    names = {id(lp.param): stored[lp.name] for lp in params}
    for group in opt.param_groups:
        first = next((names[id(p)] for p in group["params"] if id(p) in names), None)
        options = saved.get(first) if first is not None else None
        if options is None and first is not None:
            options = saved.get(TIED_TWINS.get(first, ""))
        for key, value in (options or {}).items():
            if key in group and value is not None:
                group[key] = tuple(value) if isinstance(group[key], tuple) else value

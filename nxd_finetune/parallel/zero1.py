"""ZeRO-1: optimizer states and fp32 master weights sharded over the data-parallel group.

:class:`Zero1Optimizer` wraps any ``torch.optim`` optimizer class. For every (param group, dtype)
pair it lays the group's *trainable* parameters of that dtype end to end in one flat index
space of ``numel`` elements, padded to ``padded_numel`` (a multiple of dp); dp rank ``r`` owns
the contiguous shard ``[r * S, (r + 1) * S)`` with ``S = padded_numel / dp``, and keeps an fp32
master of it. The wrapped optimizer runs over the master shards only, one inner param group
per outer group, so per-group options (weight decay on / off, lr) are preserved. It sees each
master shard as views of at most ``inner_chunk_numel`` elements (one view when the shard is no
larger), because its per-step temporaries are the size of a parameter (``torch.optim.AdamW`` on
CPU: two, ``sqrt`` and the division) and a shard of a large model is one very large parameter.
The wrapped optimizer must be elementwise (Adam, AdamW, SGD...), as for the flat shards anyway.

Flat buffers (parameters on eager devices; on XLA the copying path below is kept):

- *gradients*, when the parameter dtype is the reduce dtype (fp32 parameters, or any dtype with
  ``reduce_dtype=None``): one zeroed buffer of ``padded_numel`` elements per flat space, and every
  parameter's ``.grad`` is a view into it (set at construction, keeping the values of gradients
  that exist, and again by :meth:`zero_grad`, which zeroes the buffer instead of freeing the
  gradients). Autograd accumulates into an existing ``.grad`` in place, so backward fills the
  buffer; a ``.grad`` that something replaced (``p.grad = ...``) is copied in at reduction time.
  Otherwise (bf16 parameters, fp32 reduction) the gradients are copied into a fresh fp32 buffer.
- *parameters*, when they are fp32: the parameters are views into one fp32 buffer (``p.data``
  is replaced at construction: the ``Parameter`` objects, which modules and tied pairs share,
  stay the same) and the master shard is this rank's slice of it, so there is no master copy and
  the wrapped optimizer updates this rank's part of the weights in place. A parameter whose
  ``.data`` something replaced later is put back into the buffer: by :meth:`refresh_master` and
  :meth:`import_param_states` with its values, by ``step`` with the master's (the master wins,
  as when it is a copy).

``step()``:

1. ``reduce_gradients()``: reduce (SUM; see :mod:`.data_parallel` for why the sum is right) the
   flat gradients in ``reduce_dtype`` (fp32 by default, so bf16 gradients are summed in fp32)
   and hand this rank's shard to the master's ``.grad``. On gloo an in-place all-reduce of the
   buffer, since gloo's reduce-scatter is an all-reduce of a copy of its input (same result, a
   whole-buffer copy less; the parameters' ``.grad`` then hold the reduced sum); elsewhere a
   reduce-scatter into a new shard;
2. (optional) clip: :func:`nxd_finetune.parallel.clip.clip_grad_norm_zero1` on the shards;
3. the wrapped optimizer's step on the fp32 master shards;
4. the updated shards to every rank: with a parameter buffer, each rank's shard broadcast in
   place on gloo (gloo's all-gather stages its output in a buffer of the full size), an
   all-gather into the buffer elsewhere; without one, an all-gather cast into the parameters.

Memory per rank, for ``N`` trainable fp32 elements: parameters ``4N`` and gradients ``4N`` bytes
(the buffers; as without ZeRO-1), optimizer states ``k * 4N / dp`` (Adam: k = 2), no master and,
on gloo, no transient buffer beyond the wrapped optimizer's over one chunk. Without ZeRO-1 the
states take ``k * 4N`` on every rank. With bf16
parameters the fp32 master shards add ``4N / dp`` and a step has transient flat buffers of ``N``
elements in ``reduce_dtype`` and in the parameter dtype.

Works with LoRA (frozen parameters are skipped) and with tensor parallelism: parameters are then
this rank's local shards and ``dp_group`` is this TP rank's data-parallel group
(``ParallelState.group("dp")``). A parameter reduced over another group (an expert weight sharded
over an expert axis sums its gradient over the data axes it is not sharded on:
``Placement.summed_over``) is given by ``reduce_group``: its flat spaces are partitioned over that
group instead. A trainable parameter whose ``.grad`` is None counts as a zero
gradient (unlike plain torch optimizers, which skip it): the inner step still applies
momentum and weight decay to it. A parameter listed twice (a tied pair) is stepped once.

The flat spaces, their buffers and the per-shard optimizer state are :mod:`.zero1_flat`.

Build the optimizer after the model weights are loaded and the model is on its device (the
masters are taken at construction), or call :meth:`Zero1Optimizer.refresh_master` afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.optim.optimizer import ParamsT, StateDict

from nxd_finetune.errors import NxdError
from nxd_finetune.parallel.clip import clip_grad_norm_zero1
from nxd_finetune.parallel.mappings import group_rank, group_size
from nxd_finetune.parallel.placement import Placement
from nxd_finetune.parallel.state import ParallelState
from nxd_finetune.parallel.zero1_flat import (
    FlatShard,
    all_gather_single,
    check_state_shape,
    copy_params_to_master,
    is_slot,
    make_flat,
    reduce_scatter_single,
    set_shard_state,
    shard_state,
    slot,
)

# An optimizer hyperparameter as torch's optimizers take them (lr, betas, eps, foreach, ...).
Hyperparameter = float | bool | tuple[float, ...] | None
# A torch param group: {"params": [...], "lr": ..., ...} (torch types it ``dict[str, Any]``).
ParamGroup = dict[str, Any]
# The group a parameter's gradient is reduced over and its size (a size-one reduction: (None, 1)).
ReduceGroup = tuple[ProcessGroup | None, int]


@dataclasses.dataclass(frozen=True)
class _Comm:
    """The group one flat space is reduced and partitioned over, this rank's place in it, and
    whether it is gloo (in-place collectives, see :mod:`.zero1`)."""

    group: ProcessGroup | None
    size: int
    rank: int
    gloo: bool

    @classmethod
    def of(cls, group: ProcessGroup | None, size: int) -> _Comm:
        rank = group_rank(group) if size > 1 else 0
        return cls(group, size, rank, size > 1 and dist.get_backend(group) == "gloo")


class Zero1Optimizer(torch.optim.Optimizer):
    """``optimizer_class`` with states and fp32 master weights sharded over ``dp_group``.

    ``params``: parameters or param-group dicts, as for any optimizer (frozen ones are ignored).
    ``defaults``: the wrapped optimizer's options (``lr``, ``betas``, ``weight_decay``, ...).
    ``average``: divide the reduced gradients by dp (default: sum, see :mod:`.data_parallel`).
    ``reduce_dtype``: dtype of the gradient reduce-scatter (None: the parameter dtype).
    ``inner_chunk_numel``: the largest view of a master shard the wrapped optimizer steps at once
    (its temporaries scale with it; results do not depend on it). ``reduce_group(param)``: the
    group (and size) a parameter's gradient is reduced and partitioned over, when not ``dp_group``
    (``average`` still divides by ``dp_group``'s size, the whole data-parallel degree).

    ``param_groups`` are the model parameters' groups (LR schedulers edit them; their options are
    copied to the inner optimizer before each step). Construction is local (no collective);
    ``step`` is collective over ``dp_group``. Raises NxdError when nothing is trainable.
    """

    def __init__(
        self,
        params: ParamsT,
        optimizer_class: Callable[..., torch.optim.Optimizer],
        dp_group: ProcessGroup | None,
        *,
        average: bool = False,
        reduce_dtype: torch.dtype | None = torch.float32,
        inner_chunk_numel: int = 1 << 22,
        reduce_group: Callable[[torch.Tensor], ReduceGroup] | None = None,
        **defaults: Hyperparameter,
    ) -> None:
        super().__init__(params, defaults)
        self.inner_chunk_numel = inner_chunk_numel
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = group_size(dp_group), group_rank(dp_group)
        self.average, self.reduce_dtype = average, reduce_dtype
        main = _Comm.of(dp_group, self.dp_size)
        self.flats: list[FlatShard] = []
        self._comms: list[_Comm] = []  # per flat space
        inner_groups = []
        for gi, group in enumerate(self.param_groups):
            masters = []
            trainable = list(dict.fromkeys(p for p in group["params"] if p.requires_grad))  # a tied pair once
            for dtype in dict.fromkeys(p.dtype for p in trainable):
                by_group: dict[tuple[int, int], tuple[_Comm, list[torch.Tensor]]] = {}
                for p in trainable:
                    if p.dtype != dtype:
                        continue
                    rg = reduce_group(p) if reduce_group is not None else (dp_group, self.dp_size)
                    gkey = (id(rg[0]), rg[1])
                    if gkey not in by_group:
                        by_group[gkey] = (main if gkey == (id(dp_group), self.dp_size) else _Comm.of(*rg), [])
                    by_group[gkey][1].append(p)
                for comm, members in by_group.values():
                    flat = make_flat(gi, dtype, members, comm.size, comm.rank, self.reduce_dtype,
                                     self.inner_chunk_numel)
                    self.flats.append(flat)
                    self._comms.append(comm)
                    masters.extend(flat.chunks)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        if not self.flats:
            raise NxdError("Zero1Optimizer: no trainable parameters (all have requires_grad=False)")
        self.inner = optimizer_class(inner_groups, **defaults)
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in inner.items():
                if key != "params":
                    outer.setdefault(key, value)  # show the inner defaults (lr, betas...) to schedulers
        self._reduced = False

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-take the master shards from the model parameters (after loading weights into a model
        whose optimizer already exists). Local: no collective."""
        for flat in self.flats:
            copy_params_to_master(flat)

    @property
    def shard_numel(self) -> int:
        """Elements of master weights this rank holds (the padded ``N / dp``)."""
        return sum(f.shard_size for f in self.flats)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers and make every ``.grad`` a view into its buffer again (also
        with ``set_to_none``: the buffers are kept); other gradients as ``torch.optim``."""
        in_buffers = set()
        for flat in self.flats:
            if flat.grad_buffer is None:
                continue
            flat.grad_buffer.zero_()
            for p, off in zip(flat.params, flat.offsets, strict=True):
                p.grad = slot(flat.grad_buffer, off, p)
                in_buffers.add(id(p))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or id(p) in in_buffers:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False)
                    p.grad.zero_()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce (SUM, or mean with ``average``) the parameters' gradients over ``dp_group`` and
        set the fp32 master shards' ``.grad`` to this rank's part. Collective over ``dp_group``;
        ``step`` calls it when it has not been called since the last step (call it yourself to
        clip in between). Afterwards the parameters' ``.grad`` may hold the reduced sum (gloo
        with a gradient buffer) or still this rank's gradients."""
        for flat, comm in zip(self.flats, self._comms, strict=True):
            dtype = self.reduce_dtype or flat.dtype
            buf = flat.grad_buffer
            if buf is not None:
                for p, off in zip(flat.params, flat.offsets, strict=True):
                    if is_slot(p.grad, buf, off, p):
                        continue
                    view = slot(buf, off, p)  # .grad replaced (or set to None) since zero_grad
                    if p.grad is None:
                        view.zero_()
                    else:
                        view.copy_(p.grad)
            else:
                buf = torch.zeros(flat.padded_numel, dtype=dtype, device=flat.master.device)
                for p, off in zip(flat.params, flat.offsets, strict=True):
                    if p.grad is not None:
                        buf[off : off + p.numel()].copy_(p.grad.reshape(-1))
            if comm.size == 1:
                shard = buf
            elif comm.gloo:
                dist.all_reduce(buf, group=comm.group)
                shard = buf[flat.shard_start : flat.shard_start + flat.shard_size]
                if flat.grad_buffer is None:
                    shard = shard.clone()  # let the temporary buffer go
            else:
                shard = buf.new_empty(flat.shard_size)
                reduce_scatter_single(shard, buf, group=comm.group)
            if self.average and self.dp_size > 1:
                shard.div_(self.dp_size)
            flat.master.grad = shard.to(torch.float32)
        self._reduced = True

    def local_grad_slices(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, view of its gradient in this rank's master shard)`` for every parameter
        overlapping the shard (after :meth:`reduce_gradients`); for the sharded grad norm."""
        if not self._reduced:
            raise RuntimeError("local_grad_slices() before reduce_gradients()")
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for f in self.flats:
            grad = f.master.grad
            assert grad is not None  # reduce_gradients set it
            out.extend((f.params[i], grad[a:b]) for i, a, b in f.param_ranges())
        return out

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient shards (after :meth:`reduce_gradients`), e.g. to scale them."""
        return [f.master.grad for f in self.flats if f.master.grad is not None]

    def clip_grad_norm(self, max_norm: float | None, state: ParallelState,
                       specs: dict[int, Placement] | nn.Module | None = None,
                       not_counted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
        """Reduce the gradients if not done yet, then clip the shards to the global L2 norm
        ``max_norm`` (see :func:`~nxd_finetune.parallel.clip.clip_grad_norm_zero1`); returns the norm."""
        if not self._reduced:
            self.reduce_gradients()
        return clip_grad_norm_zero1(self, max_norm, state, specs=specs, not_counted=not_counted)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's contract
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._reduced:
            self.reduce_gradients()
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in outer.items():
                if key != "params":
                    inner[key] = value
        for flat in self.flats:
            if len(flat.chunks) > 1:  # the (possibly clipped) shard gradient, seen chunk by chunk
                for chunk, grad in zip(flat.chunks, flat.master.grad.split(self.inner_chunk_numel), strict=True):
                    chunk.grad = grad
        self.inner.step()
        self._gather_params()
        for flat in self.flats:
            for chunk in flat.chunks:
                chunk.grad = None
            flat.master.grad = None
        self._reduced = False
        return loss

    @torch.no_grad()
    def _gather_params(self) -> None:
        """The updated master shards to every dp rank's model parameters (in their dtype)."""
        for flat, comm in zip(self.flats, self._comms, strict=True):
            if flat.param_buffer is not None:
                self._gather_into_buffer(flat, comm)
                continue
            local = flat.master.to(flat.dtype)
            if comm.size > 1:
                full = local.new_empty(flat.padded_numel)
                all_gather_single(full, local, group=comm.group)
            else:
                full = local
            for p, off in zip(flat.params, flat.offsets, strict=True):
                p.copy_(full[off : off + p.numel()].view_as(p))

    def _gather_into_buffer(self, flat: FlatShard, comm: _Comm) -> None:
        """Fill the other ranks' shards of the parameter buffer (this rank's is its master), then
        make parameters that were put elsewhere views into it again (the master wins)."""
        buf = flat.param_buffer
        assert buf is not None
        if comm.gloo:
            for r in range(comm.size):
                src = r if comm.group is None else dist.get_global_rank(comm.group, r)  # None: the world
                dist.broadcast(buf[r * flat.shard_size : (r + 1) * flat.shard_size], src=src, group=comm.group)
        elif comm.size > 1:
            all_gather_single(buf, flat.master.clone(), group=comm.group)
        for p, off in zip(flat.params, flat.offsets, strict=True):
            if not is_slot(p, buf, off, p):
                p.data = slot(buf, off, p)

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> StateDict:
        """This dp rank's shard: the inner optimizer's state (over the master shards), the fp32
        master shards, the outer groups' options, and the layout needed to reshard later
        (``zero1``: dp size / rank and, per flat space, group, dtype, numel, padding, this rank's
        range, parameter shapes and offsets). Tensors are references, not copies, except the
        master shards that are views into a parameter buffer: those are copied, as ``torch.save``
        would write a view's whole buffer."""
        return {
            "inner": self.inner.state_dict(),
            "master": [f.master if f.param_buffer is None else f.master.clone() for f in self.flats],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "zero1": {"dp_size": self.dp_size, "dp_rank": self.dp_rank, "flats": [f.layout() for f in self.flats],
                      "inner_chunks": [len(f.chunks) for f in self.flats]},
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore a :meth:`state_dict` written by the same dp rank of the same layout.

        Restores the master shards and the inner states, not the model parameters (they come
        from the model checkpoint and equal the master cast to their dtype; where the master is a
        view into the parameter buffer, this rank's shard of the parameters is the restored master).
        Local: no collective.
        Raises NxdError (one line, with the numbers) when dp size, rank or layout differ:
        resharding to another dp size is not implemented yet.
        """
        saved = state_dict["zero1"]
        if (saved["dp_size"], saved["dp_rank"]) != (self.dp_size, self.dp_rank):
            raise NxdError(
                f"ZeRO-1 state of dp rank {saved['dp_rank']}/{saved['dp_size']} cannot be loaded on dp rank "
                f"{self.dp_rank}/{self.dp_size} (resharding is not implemented yet)"
            )
        mine = [f.layout() for f in self.flats]
        if saved["flats"] != mine:
            raise NxdError(
                f"ZeRO-1 state does not match the optimizer's parameters: saved "
                f"{[(f['group'], f['dtype'], f['numel']) for f in saved['flats']]}, "
                f"expected {[(f['group'], f['dtype'], f['numel']) for f in mine]} (group, dtype, numel)"
            )
        chunks = [len(f.chunks) for f in self.flats]
        saved_chunks = saved.get("inner_chunks", [1] * len(chunks))  # states saved before chunking: one each
        if saved_chunks != chunks:
            raise NxdError(
                f"ZeRO-1 state has its shards in {saved_chunks} optimizer chunks, this optimizer in "
                f"{chunks} (inner_chunk_numel={self.inner_chunk_numel}): use the same inner_chunk_numel, or the "
                "checkpoint manager's per-parameter format"
            )
        for flat, master in zip(self.flats, state_dict["master"], strict=True):
            flat.master.copy_(master)
        self.inner.load_state_dict(state_dict["inner"])
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update(saved_group)

    # ------------------------------------------------------------------ per-parameter state (resharding)

    @torch.no_grad()
    def export_param_states(self) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Per-parameter optimizer state with the dp sharding undone: ``(parameter, {key: tensor})``
        for every trainable parameter, in flat-space order.

        Per-element states of the wrapped optimizer (tensors of the master shard's length, e.g.
        Adam's ``exp_avg`` / ``exp_avg_sq``) come back shaped like the parameter (its local TP
        shard), in float32; scalar states (Adam's 0-dim ``step``) are shared by every parameter of
        a flat space; ``master`` is the fp32 master weight. Before the first step the wrapped
        optimizer has no state and only ``master`` is returned. Collective over ``dp_group`` (one
        all-gather per state tensor per flat space; every dp rank gets the full result); tensors
        are new, not views of the live state. Loadable into a plain optimizer of the same class or
        a :class:`Zero1Optimizer` of any dp size with :meth:`import_param_states`.
        """
        out: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        for flat, comm in zip(self.flats, self._comms, strict=True):
            state = shard_state(self.inner, flat)
            full: dict[str, torch.Tensor] = {"master": self._gather_flat(comm, flat, flat.master)}
            shared: dict[str, Any] = {}
            for key in sorted(state):
                value = state[key]
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == flat.shard_size:
                    full[key] = self._gather_flat(comm, flat, value)
                else:
                    shared[key] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
            for p, off in zip(flat.params, flat.offsets, strict=True):
                states = {k: v[off : off + p.numel()].view(p.shape).clone() for k, v in full.items()}
                states.update({k: v.clone() for k, v in shared.items()})
                out.append((p, states))
        return out

    @staticmethod
    def _gather_flat(comm: _Comm, flat: FlatShard, shard: torch.Tensor) -> torch.Tensor:
        """The whole padded flat space of ``shard`` (this rank's part), all-gathered over its group."""
        shard = shard.detach().to(torch.float32).contiguous()
        if comm.size == 1:
            return shard.clone()
        full = shard.new_empty(flat.padded_numel)
        all_gather_single(full, shard, group=comm.group)
        return full

    @torch.no_grad()
    def import_param_states(self, get_states) -> None:
        """Rebuild this rank's master shards and wrapped-optimizer state from per-parameter states.

        ``get_states(param)`` returns the parameter's state as :meth:`export_param_states` gives
        it (per-element tensors shaped like ``param``, 0-dim scalars, optional ``master``), or
        None / ``{}`` when there is none (a checkpoint taken before the first step). It is called
        only for parameters overlapping this rank's shard. Without ``master`` the master is taken
        from the parameter's current value, so load the parameters first (where the master is a
        view into the parameter buffer, a given ``master`` also becomes this rank's part of the
        parameters). Scalar states of a flat
        space come from its first overlapping parameter. Local: no collective. Raises NxdError
        when a state's shape does not match its parameter, or parameters of one flat space
        disagree on which states they have.
        """
        for flat in self.flats:
            copy_params_to_master(flat)
            elementwise: dict[str, torch.Tensor] = {}
            scalars: dict[str, torch.Tensor] = {}
            keys: set[str] | None = None
            for i, a, b in flat.param_ranges():
                p = flat.params[i]
                states = {k: v for k, v in (get_states(p) or {}).items()}
                if "master" in states:
                    check_state_shape("master", states["master"], p)
                    off = flat.offsets[i] - flat.shard_start
                    flat.master[a:b].copy_(states.pop("master").reshape(-1)[a - off : b - off])
                if keys is None:
                    keys = set(states)
                elif keys != set(states):
                    raise NxdError(f"ZeRO-1 import: parameters of one group carry different states "
                                   f"({sorted(keys)} vs {sorted(states)})")
                off = flat.offsets[i] - flat.shard_start
                for key, value in states.items():
                    if value.dim() == 0:
                        scalars.setdefault(key, value.detach().clone())
                        continue
                    check_state_shape(key, value, p)
                    buf = elementwise.setdefault(key, torch.zeros_like(flat.master))
                    buf[a:b].copy_(value.reshape(-1)[a - off : b - off])
            set_shard_state(self.inner, flat, scalars, elementwise)

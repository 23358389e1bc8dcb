"""ZeRO-1: optimizer states and fp32 master weights sharded over the data-parallel group.

:class:`Zero1Optimizer` wraps any ``torch.optim`` optimizer class. For every (param group, dtype)
pair it lays the group's *trainable* parameters of that dtype end to end in one flat index
space of ``numel`` elements, padded to ``padded_numel`` (a multiple of dp); dp rank ``r`` owns
the contiguous shard ``[r * S, (r + 1) * S)`` with ``S = padded_numel / dp``, and keeps an fp32
master copy of it. The wrapped optimizer runs over the master shards only, one inner param group
per outer group, so per-group options (weight decay on / off, lr) are preserved.

``step()``:

1. ``reduce_gradients()``: flatten the ``.grad`` s into a buffer in ``reduce_dtype`` (fp32 by
   default, so bf16 gradients are summed in fp32) and reduce-scatter it (SUM; see
   :mod:`.data_parallel` for why the sum is right) into the master shard's ``.grad``;
2. (optional) clip: :func:`nxd_finetune.parallel.clip.clip_grad_norm_zero1` on the shards;
3. the wrapped optimizer's step on the fp32 master shard;
4. all-gather the updated shards, cast to each parameter's dtype, into the model parameters.

Memory per rank, for ``N`` trainable elements: optimizer states ``k * 4N / dp`` bytes (Adam:
k = 2) plus the fp32 master ``4N / dp`` (the model parameters stay replicated); during a step a
transient flat buffer of ``N`` elements in ``reduce_dtype`` and one of ``N`` in the parameter
dtype. Without ZeRO-1 the states take ``k * 4N`` (and a master copy, if any, ``4N``) on every rank.

Works with LoRA (frozen parameters are skipped) and with tensor parallelism: parameters are then
this rank's local shards and ``dp_group`` is this TP rank's data-parallel group
(``ParallelState.dp_group``). A trainable parameter whose ``.grad`` is None counts as a zero
gradient (unlike plain torch optimizers, which skip it): the inner step still applies
momentum and weight decay to it.

Build the optimizer after the model weights are loaded (the master copies are taken at
construction), or call :meth:`Zero1Optimizer.refresh_master` afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from nxd_finetune.errors import NxdError
from nxd_finetune.parallel import mappings as M

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclasses.dataclass
class _FlatShard:
    """One (param group, dtype) flat index space and this rank's shard of it."""

    group_index: int
    dtype: torch.dtype
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    padded_numel: int
    shard_start: int
    shard_size: int
    master: torch.Tensor  # fp32 [shard_size]

    def param_ranges(self) -> list[tuple[int, int, int]]:
        """``(param index, start, end)`` for the parameters overlapping this rank's shard, with
        ``[start, end)`` in shard coordinates."""
        lo, hi = self.shard_start, self.shard_start + self.shard_size
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets, strict=True)):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                out.append((i, a - lo, b - lo))
        return out

    def layout(self) -> dict[str, Any]:
        return {
            "group": self.group_index,
            "dtype": str(self.dtype).removeprefix("torch."),
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "shard_start": self.shard_start,
            "shard_size": self.shard_size,
            "param_shapes": [list(p.shape) for p in self.params],
            "param_offsets": list(self.offsets),
        }


class Zero1Optimizer(torch.optim.Optimizer):
    """``optimizer_class`` with states and fp32 master weights sharded over ``dp_group``.

    ``params``: parameters or param-group dicts, as for any optimizer (frozen ones are ignored).
    ``defaults``: the wrapped optimizer's options (``lr``, ``betas``, ``weight_decay``, ...).
    ``average``: divide the reduced gradients by dp (default: sum, see :mod:`.data_parallel`).
    ``reduce_dtype``: dtype of the gradient reduce-scatter (None: the parameter dtype).

    ``param_groups`` are the model parameters' groups (LR schedulers edit them; their options are
    copied to the inner optimizer before each step). Construction is local (no collective);
    ``step`` is collective over ``dp_group``. Raises NxdError when nothing is trainable.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer],
        dp_group,
        *,
        average: bool = False,
        reduce_dtype: torch.dtype | None = torch.float32,
        **defaults: Any,
    ) -> None:
        super().__init__(params, defaults)
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = M.group_size(dp_group), M.group_rank(dp_group)
        self.average, self.reduce_dtype = average, reduce_dtype
        self.flats: list[_FlatShard] = []
        inner_groups = []
        for gi, group in enumerate(self.param_groups):
            masters = []
            for dtype in dict.fromkeys(p.dtype for p in group["params"] if p.requires_grad):
                flat = self._make_flat(gi, dtype, [p for p in group["params"] if p.requires_grad and p.dtype == dtype])
                self.flats.append(flat)
                masters.append(flat.master)
            inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        if not self.flats:
            raise NxdError("Zero1Optimizer: no trainable parameters (all have requires_grad=False)")
        self.inner = optimizer_class(inner_groups, **defaults)
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for key, value in inner.items():
                if key != "params":
                    outer.setdefault(key, value)  # show the inner defaults (lr, betas...) to schedulers
        self._reduced = False

    def _make_flat(self, group_index: int, dtype: torch.dtype, params: list[torch.Tensor]) -> _FlatShard:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        shard = -(-total // self.dp_size)
        device = params[0].device
        flat = _FlatShard(group_index, dtype, params, offsets, total, shard * self.dp_size,
                          self.dp_rank * shard, shard, torch.zeros(shard, dtype=torch.float32, device=device))
        self._copy_params_to_master(flat)
        return flat

    @torch.no_grad()
    def _copy_params_to_master(self, flat: _FlatShard) -> None:
        for i, a, b in flat.param_ranges():
            off = flat.offsets[i] - flat.shard_start
            flat.master[a:b].copy_(flat.params[i].detach().reshape(-1)[a - off : b - off])

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Re-take the master shards from the model parameters (after loading weights into a model
        whose optimizer already exists). Local: no collective."""
        for flat in self.flats:
            self._copy_params_to_master(flat)

    @property
    def shard_numel(self) -> int:
        """Elements of master weights this rank holds (the padded ``N / dp``)."""
        return sum(f.shard_size for f in self.flats)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter (SUM, or mean with ``average``) the parameters' gradients into the fp32
        master shards' ``.grad``. Collective over ``dp_group``; ``step`` calls it when it has not
        been called since the last step (call it yourself to clip in between)."""
        for flat in self.flats:
            dtype = self.reduce_dtype or flat.dtype
            buf = torch.zeros(flat.padded_numel, dtype=dtype, device=flat.master.device)
            for p, off in zip(flat.params, flat.offsets, strict=True):
                if p.grad is not None:
                    buf[off : off + p.numel()].copy_(p.grad.reshape(-1))
            if self.dp_size > 1:
                shard = buf.new_empty(flat.shard_size)
                _reduce_scatter_single(shard, buf, group=self.dp_group)
            else:
                shard = buf
            if self.average and self.dp_size > 1:
                shard.div_(self.dp_size)
            flat.master.grad = shard.to(torch.float32)
        self._reduced = True

    def local_grad_slices(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, view of its gradient in this rank's master shard)`` for every parameter
        overlapping the shard (after :meth:`reduce_gradients`); for the sharded grad norm."""
        if not self._reduced:
            raise RuntimeError("local_grad_slices() before reduce_gradients()")
        return [(f.params[i], f.master.grad[a:b]) for f in self.flats for i, a, b in f.param_ranges()]

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient shards (after :meth:`reduce_gradients`), e.g. to scale them."""
        return [f.master.grad for f in self.flats if f.master.grad is not None]

    def clip_grad_norm(self, max_norm: float | None, state, specs: Any = None,
                       not_counted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
        """Reduce the gradients if not done yet, then clip the shards to the global L2 norm
        ``max_norm`` (see :func:`~nxd_finetune.parallel.clip.clip_grad_norm_zero1`); returns the norm."""
        from nxd_finetune.parallel.clip import clip_grad_norm_zero1

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
        self.inner.step()
        self._gather_params()
        for flat in self.flats:
            flat.master.grad = None
        self._reduced = False
        return loss

    @torch.no_grad()
    def _gather_params(self) -> None:
        """All-gather the updated master shards into the model parameters (in their dtype)."""
        for flat in self.flats:
            local = flat.master.to(flat.dtype)
            if self.dp_size > 1:
                full = local.new_empty(flat.padded_numel)
                _all_gather_single(full, local, group=self.dp_group)
            else:
                full = local
            for p, off in zip(flat.params, flat.offsets, strict=True):
                p.copy_(full[off : off + p.numel()].view_as(p))

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This dp rank's shard: the inner optimizer's state (over the master shards), the fp32
        master shards, the outer groups' options, and the layout needed to reshard later
        (``zero1``: dp size / rank and, per flat space, group, dtype, numel, padding, this rank's
        range, parameter shapes and offsets). Tensors are references, not copies."""
        return {
            "inner": self.inner.state_dict(),
            "master": [f.master for f in self.flats],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "zero1": {"dp_size": self.dp_size, "dp_rank": self.dp_rank, "flats": [f.layout() for f in self.flats]},
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` written by the same dp rank of the same layout.

        Restores the master shards and the inner states, not the model parameters (they come
        from the model checkpoint and equal the master cast to their dtype). Local: no collective.
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
        for flat in self.flats:
            state = self.inner.state.get(flat.master, {})
            full: dict[str, torch.Tensor] = {"master": self._gather_flat(flat, flat.master)}
            shared: dict[str, Any] = {}
            for key in sorted(state):
                value = state[key]
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == flat.shard_size:
                    full[key] = self._gather_flat(flat, value)
                else:
                    shared[key] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
            for p, off in zip(flat.params, flat.offsets, strict=True):
                states = {k: v[off : off + p.numel()].view(p.shape).clone() for k, v in full.items()}
                states.update({k: v.clone() for k, v in shared.items()})
                out.append((p, states))
        return out

    def _gather_flat(self, flat: _FlatShard, shard: torch.Tensor) -> torch.Tensor:
        """The whole padded flat space of ``shard`` (this rank's part), all-gathered over dp."""
        shard = shard.detach().to(torch.float32).contiguous()
        if self.dp_size == 1:
            return shard.clone()
        full = shard.new_empty(flat.padded_numel)
        _all_gather_single(full, shard, group=self.dp_group)
        return full

    @torch.no_grad()
    def import_param_states(self, get_states) -> None:
        """Rebuild this rank's master shards and wrapped-optimizer state from per-parameter states.

        ``get_states(param)`` returns the parameter's state as :meth:`export_param_states` gives
        it (per-element tensors shaped like ``param``, 0-dim scalars, optional ``master``), or
        None / ``{}`` when there is none (a checkpoint taken before the first step). It is called
        only for parameters overlapping this rank's shard. Without ``master`` the master is taken
        from the parameter's current value, so load the parameters first. Scalar states of a flat
        space come from its first overlapping parameter. Local: no collective. Raises NxdError
        when a state's shape does not match its parameter, or parameters of one flat space
        disagree on which states they have.
        """
        for flat in self.flats:
            self._copy_params_to_master(flat)
            elementwise: dict[str, torch.Tensor] = {}
            scalars: dict[str, torch.Tensor] = {}
            keys: set[str] | None = None
            for i, a, b in flat.param_ranges():
                p = flat.params[i]
                states = {k: v for k, v in (get_states(p) or {}).items()}
                if "master" in states:
                    self._check_state_shape("master", states["master"], p)
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
                    self._check_state_shape(key, value, p)
                    buf = elementwise.setdefault(key, torch.zeros_like(flat.master))
                    buf[a:b].copy_(value.reshape(-1)[a - off : b - off])
            self.inner.state.pop(flat.master, None)
            if elementwise or scalars:
                self.inner.state[flat.master] = {**scalars, **elementwise}

    @staticmethod
    def _check_state_shape(key: str, value: torch.Tensor, param: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(param.shape):
            raise NxdError(f"ZeRO-1 import: state {key!r} of shape {tuple(value.shape)} does not match "
                           f"its parameter of shape {tuple(param.shape)}")

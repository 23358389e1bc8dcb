"""The flat index spaces of ZeRO-1 (:mod:`.zero1`): one per (param group, dtype), its parameters
end to end, padded to a multiple of dp, with this rank's contiguous shard and fp32 master; the
parameter and gradient buffers whose views the parameters and their ``.grad`` become; the
wrapped optimizer's state of a shard, joined over its chunks or handed back to them."""

from __future__ import annotations

import dataclasses
from typing import TypedDict

import torch
import torch.distributed as dist
from torch.optim.optimizer import StateDict

from nxd_finetune.errors import NxdError

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# devices whose parameters and gradients keep the copying path (XLA's lazy tensors); on every other
# device they become views into flat buffers
SEPARATE_TENSOR_DEVICES = ("xla",)


def slot(buf: torch.Tensor, offset: int, p: torch.Tensor) -> torch.Tensor:
    """The view of ``buf`` that holds ``p`` (at ``offset``, shaped like ``p``)."""
    return buf[offset : offset + p.numel()].view_as(p)


def is_slot(t: torch.Tensor | None, buf: torch.Tensor, offset: int, p: torch.Tensor) -> bool:
    """Whether ``t`` is (still) the view :func:`slot` gives, not a tensor put in its place."""
    return (t is not None and t.dtype == buf.dtype and t.device == buf.device and t.shape == p.shape
            and t.is_contiguous() and t.data_ptr() == buf.data_ptr() + offset * buf.element_size())


class FlatLayout(TypedDict):
    """One flat space as a ZeRO-1 state dict records it (to check or reshard on load)."""

    group: int
    dtype: str
    numel: int
    padded_numel: int
    shard_start: int
    shard_size: int
    param_shapes: list[list[int]]
    param_offsets: list[int]


@dataclasses.dataclass
class FlatShard:
    """One (param group, dtype) flat index space and this rank's shard of it."""

    group_index: int
    dtype: torch.dtype
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    padded_numel: int
    shard_start: int
    shard_size: int
    master: torch.Tensor  # fp32 [shard_size]; a view into param_buffer when there is one
    param_buffer: torch.Tensor | None = None  # fp32 [padded_numel]: the parameters are views into it
    grad_buffer: torch.Tensor | None = None  # reduce dtype [padded_numel]: the .grad are views into it
    chunks: list[torch.Tensor] = dataclasses.field(default_factory=list)  # the wrapped optimizer's params

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

    def layout(self) -> FlatLayout:
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


def make_flat(group_index: int, dtype: torch.dtype, params: list[torch.Tensor], dp_size: int, dp_rank: int,
              reduce_dtype: torch.dtype | None, inner_chunk_numel: int) -> FlatShard:
    """The flat space of ``params`` (one group, one dtype) and this dp rank's shard of it: buffers
    on eager devices (see :mod:`.zero1`), the master taken from the parameters, ``.grad`` made views
    into the gradient buffer, the master split into chunks of at most ``inner_chunk_numel``."""
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    shard = -(-total // dp_size)
    padded, start = shard * dp_size, dp_rank * shard
    device = params[0].device
    buffers = device.type not in SEPARATE_TENSOR_DEVICES
    param_buffer = grad_buffer = None
    if buffers and dtype == torch.float32:
        param_buffer = torch.zeros(padded, dtype=dtype, device=device)
        master = param_buffer[start : start + shard]
    else:
        master = torch.zeros(shard, dtype=torch.float32, device=device)
    if buffers and (reduce_dtype or dtype) == dtype:
        grad_buffer = torch.zeros(padded, dtype=dtype, device=device)
    chunks = [master] if shard <= inner_chunk_numel else list(master.split(inner_chunk_numel))
    flat = FlatShard(group_index, dtype, params, offsets, total, padded, start, shard, master,
                     param_buffer, grad_buffer, chunks)
    copy_params_to_master(flat)
    if grad_buffer is not None:
        for p, off in zip(params, offsets, strict=True):
            view = slot(grad_buffer, off, p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
    return flat


@torch.no_grad()
def copy_params_to_master(flat: FlatShard) -> None:
    """Master shard := the parameters' values. With a parameter buffer: parameters that are no
    longer views into it are copied in and made views again."""
    if flat.param_buffer is not None:
        for p, off in zip(flat.params, flat.offsets, strict=True):
            if not is_slot(p, flat.param_buffer, off, p):
                view = slot(flat.param_buffer, off, p)
                view.copy_(p.detach())
                p.data = view
        return
    for i, a, b in flat.param_ranges():
        off = flat.offsets[i] - flat.shard_start
        flat.master[a:b].copy_(flat.params[i].detach().reshape(-1)[a - off : b - off])


def shard_state(inner: torch.optim.Optimizer, flat: FlatShard) -> StateDict:
    """The wrapped optimizer's state of ``flat``'s master shard: per-element states of its
    chunks joined (a new tensor when there are several), scalar states of the first chunk."""
    states = [inner.state.get(c, {}) for c in flat.chunks]
    if len(states) == 1 or not states[0]:
        return states[0]
    return {key: torch.cat([st[key] for st in states])
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == flat.chunks[0].numel() else value
            for key, value in states[0].items()}


def set_shard_state(inner: torch.optim.Optimizer, flat: FlatShard, scalars: dict[str, torch.Tensor],
                    elementwise: dict[str, torch.Tensor]) -> None:
    """Give each chunk of ``flat``'s master shard its part of ``elementwise`` (views of the
    shard-long tensors) and its own copy of ``scalars`` (Adam counts ``step`` per chunk)."""
    start = 0
    for chunk in flat.chunks:
        inner.state.pop(chunk, None)
        if elementwise or scalars:
            inner.state[chunk] = {**{k: v.clone() for k, v in scalars.items()},
                                  **{k: v[start : start + chunk.numel()] for k, v in elementwise.items()}}
        start += chunk.numel()


def check_state_shape(key: str, value: torch.Tensor, param: torch.Tensor) -> None:
    """NxdError when a state imported for ``param`` is not shaped like it."""
    if tuple(value.shape) != tuple(param.shape):
        raise NxdError(f"ZeRO-1 import: state {key!r} of shape {tuple(value.shape)} does not match "
                       f"its parameter of shape {tuple(param.shape)}")

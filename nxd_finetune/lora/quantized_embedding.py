"""The input embedding and the output layer in 4 bits (``model.quantization.embeddings``), for a
model whose vocabulary is a large part of its base (Llama-3.2-1B: a tied 128k x 2048 embedding,
0.49 GiB of its 2.30 GiB in bf16).

The weight is bitsandbytes' own ``Params4bit`` (the packing, block scales and double quantization
of the linears, :func:`~nxd_finetune.lora.quantized.quantize_module`); nothing quantizes or
dequantizes by itself here: a lookup hands the looked-up rows' packed bytes and block scales to
``bitsandbytes.functional.dequantize_4bit``, as bitsandbytes' ``Embedding4bit`` does (which has no
double quantization: here the block scales are dequantized first, as ``dequantize_4bit`` does for a
whole tensor). The output layer (``lm_head``; the same parameter when the embeddings are tied)
multiplies by its weight a chunk of vocabulary rows at a time, each chunk dequantized to the
compute dtype (``Linear4bit``'s casts) and dropped before the next, forward and backward, so no
full-precision copy of the head ever exists (``bitsandbytes.matmul_4bit`` dequantizes the whole
weight per call). Under tensor parallel each rank quantizes its vocabulary shard.

Row ``r`` of a ``[rows, cols]`` weight is bytes ``[r cols/2, (r+1) cols/2)`` and blocks
``[r cols/b, (r+1) cols/b)`` of the packed tensor when ``cols`` divides by the block size ``b``,
which :func:`embedding_gap` checks (one line otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.lora.quantized import DTYPES, QuantSpec, params4bit, require_bitsandbytes
from nxd_finetune.parallel.layers import ColumnParallelLinear, VocabParallelEmbedding

CHUNK_BYTES = 32 * 2**20
"""The most one dequantized chunk of the output layer's rows holds (in the compute dtype)."""
EMBEDDING_NAMES = ("embed_tokens", "lm_head")
"""What ``embeddings: true`` quantizes; LoRA on them (or training them) is refused with it."""


def embedding_gap(hidden_size: int, spec: QuantSpec) -> str | None:
    """Why ``spec`` cannot quantize a ``hidden_size``-wide embedding (one line), or None."""
    if not spec.embeddings:
        return None
    if not spec.four_bit:
        return "model.quantization.embeddings needs a 4-bit method (nf4 or fp4), not int8"
    if hidden_size % spec.block_size:
        return (f"model.quantization.embeddings: the hidden size {hidden_size} does not divide by block_size "
                f"{spec.block_size} (an embedding row must be whole blocks); use a block_size that divides it")
    return None


def quantized_by_rows(weight: torch.Tensor, spec: QuantSpec) -> nn.Parameter:
    """bitsandbytes' ``Params4bit`` of the embedding ``weight`` (``[V, H]``, ``H`` whole blocks) where
    it is, quantized a chunk of rows at a time (:func:`~nxd_finetune.lora.quantized.params4bit`)."""
    return params4bit(weight, spec, weight.device)


def _absmax(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 block scales of a 4-bit weight (double quantization's dequantized first, as
    ``dequantize_4bit`` does)."""
    state = weight.quant_state  # type: ignore[attr-defined]
    if not state.nested:
        return cast(torch.Tensor, state.absmax)
    functional = require_bitsandbytes().functional
    return cast(torch.Tensor, functional.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()


def dequantized_rows(weight: torch.Tensor, rows: torch.Tensor | slice, dtype: torch.dtype,
                     absmax: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows`` (an index tensor, any shape, or a slice) of a 4-bit ``[V, H]`` weight,
    dequantized by bitsandbytes to ``dtype``: ``[*rows.shape, H]`` (``[len, H]`` for a slice).
    ``absmax``: :func:`_absmax`, when the caller dequantizes many chunks."""
    state = weight.quant_state  # type: ignore[attr-defined]
    n_rows, cols = state.shape
    blocks = cols // state.blocksize
    scales = _absmax(weight) if absmax is None else absmax
    packed = weight.data.view(torch.uint8).view(n_rows, cols // 2)[rows]
    picked = scales.view(n_rows, blocks)[rows]
    functional = require_bitsandbytes().functional
    shape = torch.Size((*packed.shape[:-1], cols))
    rows_state = functional.QuantState(absmax=picked.reshape(-1).contiguous(), shape=shape, dtype=dtype,
                                       blocksize=state.blocksize, quant_type=state.quant_type, code=state.code)
    return cast(torch.Tensor, functional.dequantize_4bit(packed.reshape(-1, 1), rows_state))


def _chunks(weight: torch.Tensor, dtype: torch.dtype) -> list[slice]:
    n_rows, cols = weight.quant_state.shape  # type: ignore[attr-defined]
    per = max(1, CHUNK_BYTES // (cols * torch.finfo(dtype).bits // 8))
    return [slice(s, min(s + per, n_rows)) for s in range(0, n_rows, per)]


class _ChunkedMatmul(torch.autograd.Function):
    """``x W^T`` with a frozen 4-bit ``W``, one dequantized chunk of rows at a time (forward and
    backward; nothing of ``W`` saved)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,  # type: ignore[override]
                weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight  # type: ignore[attr-defined]
        absmax = _absmax(weight)
        out: torch.Tensor | None = None
        for s in _chunks(weight, x.dtype):  # each chunk's output written in place (not all kept, then joined)
            part = F.linear(x, dequantized_rows(weight, s, x.dtype, absmax))  # autocast's dtype
            if out is None:
                out = part.new_empty(*part.shape[:-1], weight.quant_state.shape[0])  # type: ignore[attr-defined]
            out[..., s] = part
        assert out is not None
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        weight: torch.Tensor = ctx.weight  # type: ignore[attr-defined]
        absmax = _absmax(weight)
        grad_x = None
        for s in _chunks(weight, grad.dtype):
            part = grad[..., s] @ dequantized_rows(weight, s, grad.dtype, absmax)
            grad_x = part if grad_x is None else grad_x.add_(part)
        assert grad_x is not None
        return grad_x, None


class _QuantizedRows(nn.Module):
    quant_spec: QuantSpec
    weight_dtype: torch.dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of ``ids`` (any shape) in the weight's original dtype."""
        return dequantized_rows(self.get_parameter("weight"), ids, self.weight_dtype)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` in the compute dtype (``Linear4bit``'s casts), returned in ``x``'s dtype."""
        compute = DTYPES[self.quant_spec.compute_dtype]
        out = _ChunkedMatmul.apply(x.to(compute), self.get_parameter("weight"))
        return cast(torch.Tensor, out).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, quantization={self.quant_spec.method}"


class QuantizedEmbedding(_QuantizedRows, nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)


class QuantizedVocabParallelEmbedding(_QuantizedRows, VocabParallelEmbedding):
    def lookup(self, local: torch.Tensor) -> torch.Tensor:
        return self.rows(local)


class QuantizedHead(_QuantizedRows, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class QuantizedColumnParallelHead(_QuantizedRows, ColumnParallelLinear):
    def local_output(self, x_in: torch.Tensor) -> torch.Tensor:
        out = self.head(x_in)
        return out if self.bias is None else out + self.bias.to(out.dtype)


_QUANTIZED: dict[type[nn.Module], type[_QuantizedRows]] = {
    nn.Embedding: QuantizedEmbedding,
    VocabParallelEmbedding: QuantizedVocabParallelEmbedding,
    nn.Linear: QuantizedHead,
    ColumnParallelLinear: QuantizedColumnParallelHead,
}


def quantize_embeddings(model: nn.Module, spec: QuantSpec, device: torch.device) -> list[str]:
    """With ``spec.embeddings``: ``model``'s input embedding and output layer (:data:`EMBEDDING_NAMES`,
    any that this model or pipeline stage holds, not quantized yet) in 4 bits on ``device``, a tied
    pair sharing one quantized weight; returns their names. NxdError (one line) where
    :func:`embedding_gap` says it cannot, or one is trained (LoRA, ``modules_to_save``)."""
    if not spec.embeddings:
        return []
    require_bitsandbytes()
    done: dict[int, nn.Parameter] = {}
    return [name for name, module in model.named_modules()
            if name.split(".")[-1] in EMBEDDING_NAMES and _quantize_one(name, module, spec, device, done)]


def quantize_embeddings_on_load(model: nn.Module, spec: QuantSpec, device: torch.device
                                ) -> Callable[[nn.Module, str], None]:
    """For a model on the meta device: the ``tensor_loaded`` hook that quantizes its input embedding
    and output layer (with ``spec.embeddings``) as soon as the weight is read, so the weight in the
    file's dtype is freed before the decoder layers are read rather than held to the end of the
    load; a tied head shares it after the load (:func:`quantize_embeddings` then swaps its class)."""
    names = {id(m): n for n, m in model.named_modules() if n.split(".")[-1] in EMBEDDING_NAMES}
    done: dict[int, nn.Parameter] = {}

    def loaded(module: nn.Module, attr: str) -> None:
        name = names.get(id(module))
        if spec.embeddings and attr == "weight" and name is not None:
            _quantize_one(name, module, spec, device, done)

    return loaded


def _quantize_one(name: str, module: nn.Module, spec: QuantSpec, device: torch.device,
                  done: dict[int, nn.Parameter]) -> bool:
    """``module`` (``name``) with its weight in 4 bits, ``done`` (the quantized weights by the ids of
    their sources and their own) sharing a tied weight; False where it already was."""
    if isinstance(module, _QuantizedRows):
        done[id(module.weight)] = module.get_parameter("weight")
        return False
    weight = getattr(module, "weight", None)
    if type(module) not in _QUANTIZED or not isinstance(weight, torch.Tensor) or weight.requires_grad:
        raise NxdError(f"model.quantization.embeddings quantizes {name}, which is trained or adapted here "
                       f"({type(module).__name__}); leave it out of lora.target_modules / modules_to_save, "
                       "or set embeddings false")
    quantized = done.get(id(weight))
    if quantized is None:  # not the tied weight quantized already
        gap = embedding_gap(weight.shape[-1], spec)
        if gap:
            raise NxdError(gap)
        if weight.device.type == "meta":
            raise NxdError(f"cannot quantize {name}: its weight is not loaded (on the meta device)")
        quantized = quantized_by_rows(weight.detach().to(device), spec)
        done[id(weight)] = quantized
    module.__class__ = _QUANTIZED[type(module)]
    assert isinstance(module, _QuantizedRows)
    module.weight = quantized
    module.quant_spec, module.weight_dtype = spec, quantized.quant_state.dtype  # type: ignore[attr-defined]
    done[id(quantized)] = quantized
    return True

"""RMSNorm as HF's Llama-family decoders compute it (fp32 statistics, cast back), with a
16-bit autograd function that keeps less for backward."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as HF's LlamaRMSNorm. ``unit_offset`` (Gemma): the
    weight is applied as ``1 + weight`` (initialised to zeros), in fp32 before the cast back, as
    HF's GemmaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (h * (1.0 + self.weight.float())).type_as(x)
        # 16-bit: keeps less for backward; fp32 with a frozen weight (LoRA): keeps the same (input,
        # rsqrt), and its backward makes six [N, H] tensors instead of autograd's eight (no pow backward)
        if (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
                and (x.dtype != torch.float32 or not self.weight.requires_grad)):
            return _RMSNormFn.apply(x, self.weight, self.variance_epsilon)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


class AutogradCtx(Protocol):
    """The ``ctx`` torch hands an autograd Function's forward and backward, as ours use it."""

    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


class _RMSNormFn(torch.autograd.Function):
    """:class:`RMSNorm` of a 16-bit input, the same forward, keeping the input (16-bit) and the
    fp32 ``rsqrt`` per row for backward instead of the fp32 copy of the input that the autograd
    ops keep: 2 bytes per element less, twice per layer. Also an fp32 input's with a frozen weight:
    the same tensors kept, fewer passes in backward."""

    @staticmethod
    def forward(ctx: AutogradCtx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.to(torch.float32)
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (h * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx: AutogradCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.to(torch.float32) * rstd
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (grad * normed.to(x.dtype)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        d_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(torch.float32)
            d_x = (rstd * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        return d_x, d_weight, None


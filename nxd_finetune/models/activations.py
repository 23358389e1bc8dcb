"""The gated activations of the decoder's MLPs and experts: SwiGLU with a lean backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nxd_finetune.models.norms import AutogradCtx


class _SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` that keeps only ``gate`` and ``up`` for backward and recomputes
    ``silu(gate)`` there: one ``[N, intermediate]`` tensor less per layer held between forward and
    backward than the two autograd ops would keep (the MLP holds most of a layer's activations)."""

    @staticmethod
    def forward(ctx: AutogradCtx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: AutogradCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        d_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; through :class:`_SwiGLU` when autograd records it."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return F.silu(gate) * up

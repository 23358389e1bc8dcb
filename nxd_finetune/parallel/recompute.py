"""Activation checkpointing: a module's forward that keeps only its inputs and runs again in backward.

:func:`checkpointed` runs the forward without recording the autograd graph
(``torch.utils.checkpoint``, reentrant). The non-reentrant variant records a node for every op,
and those small objects, allocated while the layer's activations are being freed, land in the freed
heap space and keep glibc from reusing it: on a Llama-3.2-1B shape at 2,048 tokens with every layer
checkpointed that left about 60 MB of unusable heap per layer (the bench's row peaked at 4.80 GiB;
4.20 GiB this way, ``bench/README.md``).

The reentrant form cannot serve ``torch.autograd.grad``, which the pipeline schedule uses once per
new micro-batch shape to infer the gradients' shapes; inside :func:`recording_graph` the forward
records the graph (non-reentrant) instead. Both give the same numbers.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
from torch import nn

P = ParamSpec("P")
R = TypeVar("R")
_RECORD = contextvars.ContextVar("nxd_finetune_record_graph", default=False)


@contextlib.contextmanager
def recording_graph() -> Iterator[None]:
    """Checkpointed modules record the autograd graph in their forward within this block, so
    ``torch.autograd.grad`` works through them."""
    token = _RECORD.set(True)
    try:
        yield
    finally:
        _RECORD.reset(token)


def checkpointed(module: nn.Module, forward: Callable[P, R]) -> Callable[P, R]:
    """``forward`` (of ``module``) recomputed in backward.

    Keyword tensors become positional inputs of the checkpoint, so they get gradients. When no
    input requires a gradient but ``module`` has trainable parameters (LoRA in the first decoder
    layer, after a frozen embedding), an empty leaf that does is passed along, so the recomputation
    runs and the parameters get theirs. Without grad mode, or with nothing trainable in or before
    the module, it is the plain forward.
    """

    plain: Callable[..., R] = forward  # called below with the checkpoint's positional inputs

    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if _RECORD.get():
            keywords: dict[str, Any] = kwargs  # forward's, passed through checkpoint's own keywords
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **keywords)
        names = list(kwargs)
        inputs = [*args, *kwargs.values()]
        if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            if not any(p.requires_grad for p in module.parameters()):
                return forward(*args, **kwargs)
            inputs.append(torch.empty(0, requires_grad=True))

        n = len(args)  # not ``args``: the graph keeps this function after backward, and so would it

        def call(*values: object) -> R:
            return plain(*values[:n], **dict(zip(names, values[n:], strict=False)))

        return torch.utils.checkpoint.checkpoint(call, *inputs, use_reentrant=True)

    return run

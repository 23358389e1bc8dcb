"""FlexAttention for packed rows on CUDA: one fused kernel per layer over the whole batch, with the
samples of a packed row as a block-sparse document mask, instead of SDPA over a dense ``[T, T]``
boolean mask (which computes every cross-sample block and, with GQA, copies K/V per query head).

torch's ``flex_attention`` takes the mask as a :class:`BlockMask` (built once per batch and window
by :func:`flex_block_mask`, shared by the layers), and the layer's variants as arguments: the
softmax scale (``query_pre_attn_scalar``), a ``score_mod`` for attention logit soft-capping (Gemma
2), GQA inside the kernel (``enable_gqa``). Under tensor parallel each rank holds a share of the
heads and the mask (the same for every head) applies to whichever heads it holds.

On CUDA the call is ``torch.compile(flex_attention)`` (compiled once per process, lazily): torch
generates the fused Triton kernel and its backward from the mask and score functions. On CPU torch
(2.13) runs flex attention unfused and forward only (its own words: "FlexAttention does not support
backward on CPU"): there it serves forward passes and parity checks, and CPU training keeps the
per-sample runs of :mod:`nxd_finetune.models.attention`, which are faster there anyway."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from nxd_finetune.errors import NxdError

ATTENTIONS = ("auto", "sdpa", "flex")
"""``model.attention``: ``auto`` (flex on CUDA where a batch needs more than plain causal attention:
packed rows, a sliding window shorter than the row, soft-capped scores; SDPA otherwise and on every
other device), ``sdpa`` (SDPA everywhere: per-sample runs on CPU, a boolean mask elsewhere), or
``flex`` (flex attention for every batch; trains on CUDA only)."""

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def uses_flex(attention: str, device: torch.device, segment_ids: torch.Tensor | None, seq_len: int,
              sliding_window: int | None, softcap: float | None) -> bool:
    """Whether a layer with this window (and the model's ``softcap``) runs flex attention on this batch,
    under the ``attention`` choice (:data:`ATTENTIONS`)."""
    if attention == "flex":
        return True
    if attention == "sdpa" or device.type != "cuda":
        return False
    windowed = sliding_window is not None and sliding_window < seq_len
    return segment_ids is not None or windowed or softcap is not None


def flex_block_mask(segment_ids: torch.Tensor | None, seq_len: int, sliding_window: int | None,
                    device: torch.device) -> BlockMask:
    """The :class:`BlockMask` of :func:`nxd_finetune.models.attention.attention_mask`'s rule: a token
    attends to itself and earlier tokens of its segment (``segment_ids [B, T]``; None: of the row),
    and with a sliding window to the last ``sliding_window`` of those. Blocks of 128 x 128 tokens
    that lie across two samples are skipped by the kernel, not computed and masked."""
    window = sliding_window if sliding_window is not None and sliding_window < seq_len else None
    ids = None if segment_ids is None else segment_ids.to(device)
    mask_mod = _mask_mod(ids, window)
    batch = None if ids is None else ids.shape[0]
    return create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=device)


def _mask_mod(ids: torch.Tensor | None, window: int | None) -> MaskMod:
    """``mask_mod(b, h, q, kv) -> bool``: causal, within ``window`` (None: any distance), within a
    segment of ``ids`` (None: the whole row)."""

    def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return q >= kv

    inner: MaskMod = causal
    if window is not None:
        width = window

        def windowed(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            return (q >= kv) & (q - kv < width)

        inner = windowed
    if ids is None:
        return inner
    doc = ids

    def document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return inner(b, h, q, kv) & (doc[b, q] == doc[b, kv])

    return document


@functools.cache
def _softcap_mod(cap: float) -> ScoreMod:
    """``score_mod``: ``cap * tanh(score / cap)`` on the scaled scores, before the mask (Gemma 2); one
    function per cap, so the compiled kernel is reused by every layer."""

    def softcap(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                kv: torch.Tensor) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return softcap


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """``torch.compile(flex_attention)``, made on the first CUDA call (torch compiles the kernel for
    each new shape, mask function and score function on their first use)."""
    return torch.compile(flex_attention)


def flex_attention_tokens_first(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
                                scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Flex attention of tokens-first ``[B, T, heads, D]`` q/k/v (kv heads may be fewer) -> like q.
    ``scale``: the softmax scale (None: ``1/sqrt(D)``); ``softcap``: Gemma 2's logit cap or None.
    Raises NxdError for a backward on CPU, which torch's flex attention does not have."""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and grad:
        raise NxdError("model.attention=flex cannot train on CPU: torch's FlexAttention has no CPU backward; "
                       "use model.attention=auto (or sdpa) there")
    qt, kt, vt = (x.transpose(1, 2) if grad else x.detach().transpose(1, 2) for x in (q, k, v))
    score_mod = None if softcap is None else _softcap_mod(softcap)
    gqa = k.shape[2] != q.shape[2]
    if q.device.type == "cuda":
        out = _compiled_flex()(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    else:  # unfused, forward only; torch's advice to compile it is for accelerators
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(qt, kt, vt, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2)

"""What pipeline stages are given and send: micro-batches padded to one shape (:func:`pad_to`) and,
with the router auxiliary loss (``output_router_logits``), the router sums beside the hidden states.

transformers' load-balancing loss is a function of sums over every MoE layer's tokens
(:func:`nxd_finetune.models.moe.router_sums`: per-expert assignment counts ``T``, router probability
sums ``P`` with their gradient, token count ``N``), and sums over disjoint sets of layers add up.
So each stage's output travels as ``(hidden, sums)``: the first stage starts from zeros, every
stage adds the sums of its own layers (:class:`RouterSumStage`, recorded inside
:func:`~nxd_finetune.parallel.recompute.recording_graph` so recomputed layers carry the graph), and
the last stage's loss adds ``coef x balance_from_sums(total) x units / n_targets``
(:func:`aux_term`), as :meth:`nxd_finetune.sft.engine.Engine._loss_with_aux` does at pp 1. The
gradient of ``P`` flows back to each stage with the hidden states'.

Which tokens count (:func:`router_masks`): those one process counts. Packed rows' real segments
(``segment_ids > 0``); unpacked rows and preference pairs every token up to the micro-batch's
longest row (its own right padding included, as at pp 1), never the padding to ``max_seq_len`` or
to one shape that only the pipeline adds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from nxd_finetune.loss import IGNORE_INDEX
from nxd_finetune.models.config import DecoderConfig
from nxd_finetune.models.moe import balance_from_sums, record_router_logits, router_sums
from nxd_finetune.parallel.recompute import recording_graph

MASK = "router_mask"  # the step keyword every stage gets: [B, T] bool, the tokens the sums count


def pad_to(batch: dict[str, torch.Tensor], rows: int, cols: int) -> dict[str, torch.Tensor]:
    """Pad a micro-batch to ``[rows, cols]`` with tokens that carry no loss and see nothing else:
    label -100, position 0, segment -1 (attends only to earlier padding)."""
    fill = {"labels": IGNORE_INDEX, "segment_ids": -1}
    out = {}
    for key, t in batch.items():
        if t.dim() == 1:  # a per-row field the objective reads (preference: ref_logps): 0 on padding rows
            padded = t.new_zeros((rows,))
            padded[: t.shape[0]] = t
        else:
            padded = t.new_full((rows, cols), fill.get(key, 0))
            padded[: t.shape[0], : t.shape[1]] = t
        out[key] = padded
    return out


@dataclasses.dataclass(frozen=True)
class RouterAux:
    """The load-balancing loss settings of a mixture-of-experts model trained with it."""

    num_experts: int
    top_k: int
    coef: float

    @classmethod
    def of(cls, module: nn.Module) -> RouterAux | None:
        """``module``'s (a stage of a decoder) settings; None unless its config has experts and
        ``output_router_logits``."""
        config = getattr(module, "config", None)
        if not isinstance(config, DecoderConfig) or not config.num_experts or not config.output_router_logits:
            return None
        return cls(config.num_experts, config.num_experts_per_tok, config.router_aux_loss_coef)

    def zeros(self, device: torch.device) -> torch.Tensor:
        """The first stage's running sums ``[2E + 1]`` (a leaf that takes a gradient in grad mode, so
        the sums a stage sends always carry one, whatever of it is trainable)."""
        return torch.zeros(2 * self.num_experts + 1, device=device, requires_grad=torch.is_grad_enabled())


class RouterSumStage(nn.Module):
    """A pipeline stage (``stage``: :func:`~nxd_finetune.parallel.pipeline.build_stage_module`'s)
    that passes the router sums on: ``forward(x, sums=None, position_ids, segment_ids,
    router_mask)`` -> ``(stage output, sums + this stage's layers' router sums over router_mask)``.
    Without ``router_mask`` (eval) the sums pass through unchanged (zeros on the first stage)."""

    def __init__(self, stage: nn.Module, aux: RouterAux) -> None:
        super().__init__()
        self.stage, self.aux = stage, aux

    def forward(self, x: torch.Tensor, sums: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None,
                router_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if sums is None:
            sums = self.aux.zeros(x.device)
        if router_mask is None:
            return self.stage(x, position_ids, segment_ids), sums
        # checkpointed layers record their graph (non-reentrant recompute): the logits carry it
        with record_router_logits(self.stage) as logits, recording_graph():
            out = self.stage(x, position_ids, segment_ids)
        mine = router_sums([logits[i] for i in sorted(logits)], self.aux.num_experts, self.aux.top_k, router_mask)
        return out, sums + mine


def router_masks(micro_batches: Sequence[Mapping[str, torch.Tensor]], rows: int, cols: int) -> torch.Tensor:
    """The tokens each micro-batch's router sums count, padded to ``[rows, cols]`` each (the
    pipeline's padding counts no token) and concatenated: ``segment_ids > 0`` where the rows are
    packed; unpacked rows and preference pairs every token up to the micro-batch's longest row,
    which is the shape one process gives it (under pp the loader pads them to ``max_seq_len``; an
    unpacked row's padding positions restart at 0, :func:`nxd_finetune.data.packing.collate`; a
    pair's sequences end with their last completion label, :func:`nxd_finetune.data.pairs.collate_pairs`)."""
    out = []
    for mb in micro_batches:
        ids = mb["input_ids"]
        if "segment_ids" in mb:
            real = mb["segment_ids"] > 0
        elif "position_ids" in mb:
            restart = mb["position_ids"][:, 1:] == 0  # the first padding column of each row
            length = torch.where(restart.any(dim=1), restart.int().argmax(dim=1) + 1, ids.shape[1])
            real = (torch.arange(ids.shape[1], device=ids.device) < length.max()).expand(ids.shape)
        elif "labels" in mb:  # preference pairs: every sequence ends with a completion token (pair_tokens)
            positions = torch.arange(1, ids.shape[1] + 1, device=ids.device)
            width = max(int(torch.where(mb["labels"] != IGNORE_INDEX, positions, 0).max()), 1)
            real = (torch.arange(ids.shape[1], device=ids.device) < width).expand(ids.shape)
        else:
            real = torch.ones_like(ids, dtype=torch.bool)
        padded = torch.zeros((rows, cols), dtype=torch.bool, device=ids.device)
        padded[: ids.shape[0], : ids.shape[1]] = real
        out.append(padded)
    return torch.cat(out)


def aux_term(aux: RouterAux, sums: torch.Tensor, units: torch.Tensor,
             n_targets: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's ``coef x aux x units / n_targets`` (added to its loss) from the total router
    ``sums`` of every stage, and its detached ``aux x units / n_targets`` (the logged share)."""
    value = balance_from_sums(sums, aux.num_experts)
    share = value * units.to(value.dtype) / n_targets
    return aux.coef * share, share.detach()

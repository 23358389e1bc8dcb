"""The one loss module: ignore index, label shift, token-sum cross entropy and eval statistics.

Every loss in the project is computed here, for every layout: the trainer's micro-batch loss
(:func:`ce_sum` at target positions, or :func:`chunked_ce_sum`, which never holds the logits of
more than a chunk of positions), the pipeline's last-stage scores (:func:`hidden_scores`), eval
statistics (:func:`eval_stats`) and the reference :func:`causal_lm_loss` the tests compare with.
An objective (:mod:`nxd_finetune.objective`) reads a micro-batch's output through :class:`Scores`
(:class:`LogitScores`, :class:`ChunkedScores`), which call these functions.

Labels are HF-style: aligned with ``input_ids``, ``-100`` (:data:`IGNORE_INDEX`) where no loss is
taken; position ``t`` predicts ``labels[t + 1]`` (:func:`shift_labels`).

Tensor parallel: with ``tp_group`` (more than one rank) the logits are this rank's vocabulary shard
``[*, V/tp]`` (a column-parallel ``lm_head`` without ``gather_output``) and the cross entropy is
the vocab-parallel one (:func:`vocab_parallel_cross_entropy`, Megatron's): no rank ever holds the
full-vocabulary logits. ``tp_group=None`` or a group of one: plain ``F.cross_entropy``.

This module sits below ``parallel/`` and ``sft/``: it imports only torch (its few collectives are
written here).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

IGNORE_INDEX = -100

Group = dist.ProcessGroup | None


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@torch.no_grad()
def _all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    out = x.detach().contiguous().clone()
    dist.all_reduce(out, op=op, group=group)
    return out


# ---------------------------------------------------------------------- labels


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets for each position: ``labels[:, 1:]`` with -100 appended, shape ``[B, T]``."""
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    return torch.cat([labels[:, 1:], pad], dim=1)


def target_index(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into the ``B*T`` positions that predict a target, and those targets (``[N]``
    each), padded to a multiple of :data:`TARGET_ROWS_MULTIPLE` with ignored targets. In SFT most
    positions are prompt or padding: computing logits only at these positions (the model's
    ``logits_index``) skips most of the vocabulary projection and its fp32 softmax."""
    return _bucketed_index(shift_labels(labels).reshape(-1))


TARGET_ROWS_MULTIPLE = 64
"""Target rows are padded up to a multiple of this (with ignored targets, no loss): the output
layer's matmuls then see a few shapes instead of one per micro-batch. Every new shape makes oneDNN
build and cache new matmul primitives on CPU, and with a new count per micro-batch that cache grew
a 1B LoRA run by ~35 MB per micro-batch (``bench/README.md``)."""


def _bucketed_index(flat_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the non-ignored ``flat_targets`` and those targets, padded to a multiple of
    :data:`TARGET_ROWS_MULTIPLE` rows (at most every position) with position 0 and ignored targets."""
    index = (flat_targets != IGNORE_INDEX).nonzero().squeeze(1)
    n = index.numel()
    padded = min(flat_targets.numel(), -(-n // TARGET_ROWS_MULTIPLE) * TARGET_ROWS_MULTIPLE)
    targets = flat_targets.index_select(0, index)
    if padded > n:
        index = torch.cat([index, index.new_zeros(padded - n)])
        targets = torch.cat([targets, targets.new_full((padded - n,), IGNORE_INDEX)])
    return index, targets


# ---------------------------------------------------------------------- cross entropy


class _CrossEntropyCtx(Protocol):
    """The ``ctx`` of :class:`_VocabParallelCrossEntropy`: torch's autograd context with the two
    fields its forward leaves for backward."""

    saved_tensors: tuple[torch.Tensor, ...]
    logits_dtype: torch.dtype
    used: bool

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy over vocab-sharded logits (Megatron's ``_VocabParallelCrossEntropy``)."""

    @staticmethod
    def forward(ctx: _CrossEntropyCtx, logits: torch.Tensor, targets: torch.Tensor, group: Group,
                ignore_index: int) -> torch.Tensor:
        tp = _size(group)
        rank = dist.get_rank(group) if tp > 1 else 0
        vocab_local = logits.shape[-1]
        start = rank * vocab_local
        x = logits.float()
        # stable log-sum-exp over the full vocabulary: global max, then global sum of exp
        row_max = x.max(dim=-1).values
        if tp > 1:
            row_max = _all_reduce(row_max, group, dist.ReduceOp.MAX)
        x = x - row_max.unsqueeze(-1)
        ignored = targets == ignore_index
        outside = (targets < start) | (targets >= start + vocab_local) | ignored
        local_t = (targets - start).masked_fill(outside, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        if tp > 1:  # one collective for both sums
            both = _all_reduce(torch.stack([target_logit, sum_exp]), group)
            target_logit, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside, ignored)
        ctx.logits_dtype = logits.dtype
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx: _CrossEntropyCtx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.used:  # the saved softmax is turned into the gradient in place (saves a copy)
            raise RuntimeError("vocab_parallel_cross_entropy supports one backward per forward")
        ctx.used = True
        softmax, local_t, outside, ignored = ctx.saved_tensors
        grad = softmax
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, group: Group,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross entropy from this rank's vocab shard of the logits.

    ``logits_shard``: ``[*, V/tp]``, rank ``r`` holding vocab entries ``[r*V/tp, (r+1)*V/tp)``.
    ``targets``: ``[*]`` long, the same on every TP rank. Returns float32 losses ``[*]`` equal to
    ``F.cross_entropy(full_logits, targets, reduction="none", ignore_index=ignore_index)`` on
    every TP rank (0 where ignored); the backward yields the matching logit-shard gradient.
    Computed in float32 with a global max shift (two all-reduces: max, then one stacked sum).
    """
    if targets.shape != logits_shard.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits {tuple(logits_shard.shape)}")
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, group, ignore_index)


def token_nll(logits: torch.Tensor, targets: torch.Tensor, tp_group: Group = None) -> torch.Tensor:
    """Per-target cross entropy ``[*]`` (fp32; 0 where ``targets`` is -100): the negative log-prob
    of each target. ``logits``: ``[*, V]``, or ``[*, V/tp]`` with a ``tp_group`` of more than one
    rank (vocab-parallel: no rank holds the full-vocabulary logits)."""
    if _size(tp_group) > 1:
        return vocab_parallel_cross_entropy(logits, targets, tp_group)
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat if flat.dtype == torch.float64 else flat.float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)


def ce_sum(logits: torch.Tensor, targets: torch.Tensor, tp_group: Group = None) -> torch.Tensor:
    """Cross entropy summed over ``targets != -100`` (fp32 scalar; fp64 for fp64 logits). ``logits``: ``[*, V]``, or
    ``[*, V/tp]`` with a ``tp_group`` of more than one rank; ``targets``: ``[*]``."""
    if _size(tp_group) > 1:
        return vocab_parallel_cross_entropy(logits, targets, tp_group).sum()
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype == torch.float64:
        return F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return cast(torch.Tensor, _CrossEntropySum.apply(flat, targets.reshape(-1)))


CE_CHUNK_BYTES = 16 * 2**20
"""The most fp32 logits one chunk of :class:`_CrossEntropySum` upcasts at a time."""


class _CrossEntropySum(torch.autograd.Function):
    """``F.cross_entropy(logits.float(), targets, reduction="sum")`` (ignore index -100), the loss
    and the logits' gradient the same bit for bit, with less memory: the fp32 copy and its
    log-softmax (forward), their backward and the cast to the logits' dtype (backward) run on a
    chunk of :data:`CE_CHUNK_BYTES` of rows at a time (they are row by row), and autograd keeps the
    logits as given instead of the fp32 log-probabilities, so no ``[N, V]`` tensor but the logits
    and their gradient exists (three fp32 ones did at once: 0.37 GiB at Llama-3's vocabulary and
    255 targets, a QLoRA step's peak). The loss sums each row's target log-probability with
    ``nll_loss`` itself (its summation order)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: torch.Tensor,  # type: ignore[override]
                targets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        kept = targets != IGNORE_INDEX
        picked = torch.empty(logits.shape[0], 1, dtype=torch.float32, device=logits.device)
        for rows in _row_chunks(logits):
            logp = torch.log_softmax(logits[rows].float(), dim=-1)
            picked[rows] = logp.gather(1, targets[rows].clamp(min=0).unsqueeze(1))
            del logp
        return F.nll_loss(picked, torch.where(kept, 0, IGNORE_INDEX), ignore_index=IGNORE_INDEX, reduction="sum")

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets = ctx.saved_tensors  # type: ignore[attr-defined]
        out = torch.empty_like(logits)
        for rows in _row_chunks(logits):
            with torch.enable_grad():
                part = logits[rows].detach().requires_grad_()
                loss = F.cross_entropy(part.float(), targets[rows], ignore_index=IGNORE_INDEX, reduction="sum")
                out[rows] = torch.autograd.grad(loss, part, grad)[0]
        return out, None


def _row_chunks(logits: torch.Tensor) -> list[slice]:
    """Slices of :data:`CE_CHUNK_BYTES` of ``logits``' rows in fp32."""
    rows = max(1, CE_CHUNK_BYTES // (4 * max(1, logits.shape[-1])))
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


@torch.no_grad()
def _argmax(logits: torch.Tensor, tp_group: Group) -> torch.Tensor:
    """Index of the largest logit over the full vocabulary (first one on ties, as ``argmax`` of the
    gathered logits): every rank's shard maximum and its index are gathered, not the logits."""
    tp = _size(tp_group)
    local = logits.argmax(-1)
    if tp == 1:
        return local
    best = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).double()
    mine = torch.stack([best, (local + dist.get_rank(tp_group) * logits.shape[-1]).double()])
    parts = [torch.empty_like(mine) for _ in range(tp)]
    dist.all_gather(parts, mine.contiguous(), group=tp_group)
    values = torch.stack([p[0] for p in parts])  # [tp, *]
    winner = values.argmax(0, keepdim=True)  # first rank holding the maximum
    return torch.stack([p[1] for p in parts]).gather(0, winner).squeeze(0).long()


@torch.no_grad()
def token_entropy(logits: torch.Tensor, tp_group: Group = None) -> torch.Tensor:
    """Entropy (nats, fp32, no autograd) of the softmax over the full vocabulary at each position
    ``[*]``: ``log Z - sum(p x)`` of the max-shifted logits ``x``; ``logits`` ``[*, V]``, or ``[*, V/tp]``
    with a ``tp_group`` (vocab-parallel: a max, then one stacked sum, over the group)."""
    x = logits.float()
    row_max = x.max(dim=-1).values
    if _size(tp_group) > 1:
        row_max = _all_reduce(row_max, tp_group, dist.ReduceOp.MAX)
    x = x - row_max.unsqueeze(-1)
    exp = x.exp()
    sums = torch.stack([exp.sum(-1), (exp * x).sum(-1)])
    if _size(tp_group) > 1:
        sums = _all_reduce(sums, tp_group)
    return sums[0].log() - sums[1] / sums[0]


@torch.no_grad()
def eval_stats(logits: torch.Tensor, targets: torch.Tensor, tp_group: Group = None) -> torch.Tensor:
    """``[loss sum, correct next-token predictions, targets]`` (fp32, ``[3]``) of one batch:
    ``logits`` ``[*, V(/tp)]`` against ``targets`` ``[*]`` (already shifted, -100 ignored). Sum these
    over batches and dp ranks, then divide."""
    mask = targets != IGNORE_INDEX
    loss = ce_sum(logits, targets, tp_group).detach().float()
    correct = ((_argmax(logits, tp_group) == targets) & mask).sum().float()
    return torch.stack([loss, correct, mask.sum().float()])


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of full-vocabulary ``logits`` ``[B, T, V]`` against ``labels`` ``[B, T]``
    shifted by one: ``mean`` over non-ignored targets, ``sum``, or ``none`` (per token ``[B, T]``, 0
    where ignored). fp32 whatever the logits dtype. The reference the tests compare layouts with."""
    targets = shift_labels(labels)
    per_token = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="none",
    ).view_as(targets)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / (targets != IGNORE_INDEX).sum().clamp(min=1)


# ---------------------------------------------------------------------- chunked (no [tokens, vocab] logits)

LOGITS_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk under "auto"


def chunk_rows(vocab_local: int, chunk_tokens: int | str | None) -> int | None:
    """Rows per chunk of :func:`chunked_ce_sum` / :func:`chunked_eval_stats`: ``chunk_tokens`` as
    given, or under ``"auto"`` as many rows as fit :data:`LOGITS_CHUNK_BYTES` of fp32 logits over
    this rank's ``vocab_local`` (at least 128); None: no chunking."""
    if chunk_tokens is None:
        return None
    if chunk_tokens == "auto":
        return max(128, LOGITS_CHUNK_BYTES // (4 * vocab_local))
    return int(chunk_tokens)


def _chunk_ce(head: Callable[[torch.Tensor], torch.Tensor], tp_group: Group,
              hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ce_sum(head(hidden), targets, tp_group)


def chunked_ce_sum(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                   rows: int, tp_group: Group = None) -> torch.Tensor:
    """:func:`ce_sum` of ``head(hidden)`` without ever holding the logits of more than ``rows``
    positions: ``hidden`` ``[N, H]`` (the final hidden states at the target positions), ``head``
    the output layer (``lm_head``: plain, LoRA-wrapped, or column-parallel giving ``[*, V/tp]``
    with ``tp_group``), ``targets`` ``[N]``. Each chunk's head + cross entropy runs under
    activation checkpointing: the forward keeps no logits, the backward recomputes one chunk's
    logits at a time. Equal to ``ce_sum(head(hidden), targets)`` up to float summation order; at
    ``N <= rows`` it is exactly that (no recomputation)."""
    if hidden.shape[0] <= rows:
        return ce_sum(head(hidden), targets, tp_group)
    return torch.stack(_by_chunks(functools.partial(_chunk_ce, head, tp_group), hidden, targets, rows)).sum()


def _by_chunks(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], hidden: torch.Tensor,
               targets: torch.Tensor, rows: int) -> list[torch.Tensor]:
    """``fn(hidden_chunk, targets_chunk)`` over chunks of ``rows`` positions, each under activation
    checkpointing when gradients are on (the forward keeps no chunk's logits)."""
    parts = []
    for start in range(0, hidden.shape[0], rows):
        h, t = hidden[start:start + rows], targets[start:start + rows]
        if torch.is_grad_enabled():
            parts.append(torch.utils.checkpoint.checkpoint(fn, h, t, use_reentrant=False))
        else:
            parts.append(fn(h, t))
    return parts


def chunked_token_nll(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                      rows: int, tp_group: Group = None) -> torch.Tensor:
    """:func:`token_nll` of ``head(hidden)`` ``[N]``, ``rows`` positions at a time under activation
    checkpointing, as :func:`chunked_ce_sum` (never more than a chunk's logits held)."""
    if hidden.shape[0] <= rows:
        return token_nll(head(hidden), targets, tp_group)
    return torch.cat(_by_chunks(functools.partial(_chunk_nll, head, tp_group), hidden, targets, rows))


def _chunk_nll(head: Callable[[torch.Tensor], torch.Tensor], tp_group: Group,
               hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return token_nll(head(hidden), targets, tp_group)


@torch.no_grad()
def chunked_eval_stats(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                       rows: int, tp_group: Group = None) -> torch.Tensor:
    """:func:`eval_stats` of ``head(hidden)`` computed ``rows`` positions at a time."""
    stats = torch.zeros(3, dtype=torch.float32, device=hidden.device)
    for start in range(0, max(hidden.shape[0], 1), rows):
        stats += eval_stats(head(hidden[start:start + rows]), targets[start:start + rows], tp_group)
    return stats


def _target_rows(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``hidden`` ``[B, T, H]`` at the positions of shifted ``targets`` ``[B, T]`` that are
    not ignored (``[N, H]``), those targets (``[N]``), padded like :func:`target_index`, and the
    flat position of each in the ``[B, T]`` micro-batch (``[N]``)."""
    index, kept = _bucketed_index(targets.reshape(-1))
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, index), kept, index


def _positions_of(targets: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The flat ``[B, T]`` position of every target: ``index`` as given (targets gathered at target
    positions), or every position of ``[B, T]`` targets."""
    if index is not None:
        return index
    if targets.dim() != 2:
        raise ValueError(f"targets {tuple(targets.shape)} without their positions: per-sequence scores need them")
    return torch.arange(targets.numel(), device=targets.device)


# ---------------------------------------------------------------------- scores (what an objective reads)


class Scores(Protocol):
    """How an objective reads one micro-batch's model output: the cross entropy of its target
    tokens, summed, or per target with its position in the micro-batch (:meth:`token_nll`, what
    per-sequence log-probs sum), or its eval statistics, computed the way the layout needs
    (vocab-parallel, chunked) without the objective seeing logits. See :mod:`nxd_finetune.objective`."""

    def ce_sum(self) -> torch.Tensor: ...

    def token_nll(self, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(nll [N], position [N])``: each target's negative log-prob (fp32, 0 for ignored
        targets) and its flat position ``row * T + t`` in the micro-batch's ``[B, T]`` labels (the
        position that predicts it; ignored padding targets may sit anywhere).
        ``-zeros(B).index_add(0, position // T, nll)`` gives the rows' summed log-probs.
        ``temperature``: of the logits divided by it (GRPO scores its samples as they were drawn)."""
        ...

    def token_entropy(self, temperature: float = 1.0) -> torch.Tensor:
        """``[N]``: the entropy of the predicted distribution (of the logits over ``temperature``)
        at each target's position, in :meth:`token_nll`'s order (a metric: no autograd)."""
        ...

    def eval_stats(self) -> torch.Tensor: ...


@dataclasses.dataclass
class LogitScores:
    """Scores from logits ``[*, V(/tp)]`` and their targets ``[*]`` (shifted, -100 ignored).
    ``index``: the flat ``[B, T]`` position of each target when they were gathered at target
    positions (``[N]``, :func:`target_index`); None for ``[B, T]`` targets (every position)."""

    logits: torch.Tensor
    targets: torch.Tensor
    tp_group: Group = None
    index: torch.Tensor | None = None

    def ce_sum(self) -> torch.Tensor:
        return ce_sum(self.logits, self.targets, self.tp_group)

    def token_nll(self, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits if temperature == 1.0 else self.logits / temperature
        nll = token_nll(logits, self.targets, self.tp_group).reshape(-1)
        return nll, _positions_of(self.targets, self.index)

    def token_entropy(self, temperature: float = 1.0) -> torch.Tensor:
        logits = self.logits.detach().reshape(-1, self.logits.shape[-1])
        rows = chunk_rows(logits.shape[-1], "auto") or logits.shape[0]  # a few fp32 copies of a chunk at a time
        return torch.cat([token_entropy(logits[i:i + rows] / temperature, self.tp_group)
                          for i in range(0, logits.shape[0], rows)] or [logits.new_zeros(0, dtype=torch.float32)])

    def eval_stats(self) -> torch.Tensor:
        return eval_stats(self.logits, self.targets, self.tp_group)


@dataclasses.dataclass
class ChunkedScores:
    """Scores from the final hidden states at the target positions ``[N, H]``, the output layer
    and the targets ``[N]``: the head runs ``rows`` positions at a time (:func:`chunked_ce_sum`).
    ``index``: the flat ``[B, T]`` position of each target (``[N]``; needed by :meth:`token_nll`)."""

    hidden: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]
    targets: torch.Tensor
    rows: int
    tp_group: Group = None
    index: torch.Tensor | None = None
    # (temperature, logits) of the last one-chunk token_nll under autograd, for token_entropy
    _logits: tuple[float, torch.Tensor] | None = dataclasses.field(default=None, init=False, repr=False)

    def ce_sum(self) -> torch.Tensor:
        return chunked_ce_sum(self.hidden, self.head, self.targets, self.rows, self.tp_group)

    def token_nll(self, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """With one chunk under autograd (a loss's pass) the logits are kept, detached, until
        :meth:`token_entropy` takes them: the output layer runs once for both."""
        head = self.head if temperature == 1.0 else lambda h: self.head(h) / temperature
        if self.hidden.shape[0] <= self.rows and torch.is_grad_enabled():
            logits = head(self.hidden)
            self._logits = (temperature, logits.detach())
            nll = token_nll(logits, self.targets, self.tp_group)
        else:
            nll = chunked_token_nll(self.hidden, head, self.targets, self.rows, self.tp_group)
        return nll, _positions_of(self.targets, self.index)

    @torch.no_grad()
    def token_entropy(self, temperature: float = 1.0) -> torch.Tensor:
        kept, self._logits = self._logits, None
        if kept is not None and kept[0] == temperature:
            return token_entropy(kept[1], self.tp_group)
        parts = [token_entropy(self.head(self.hidden[start:start + self.rows]) / temperature, self.tp_group)
                 for start in range(0, self.hidden.shape[0], self.rows)]
        return torch.cat(parts) if parts else self.hidden.new_zeros(0, dtype=torch.float32)

    def eval_stats(self) -> torch.Tensor:
        return chunked_eval_stats(self.hidden, self.head, self.targets, self.rows, self.tp_group)


def hidden_scores(hidden: torch.Tensor, labels: torch.Tensor, *, head: Callable[[torch.Tensor], torch.Tensor],
                  rows: int, tp_group: Group = None) -> ChunkedScores:
    """:class:`ChunkedScores` of a pipeline's last stage: its final hidden states ``[B, T, H]`` and
    the micro-batch's ``labels`` ``[B, T]`` (shifted here)."""
    h, targets, index = _target_rows(hidden, shift_labels(labels))
    return ChunkedScores(h, head, targets, rows, tp_group, index)

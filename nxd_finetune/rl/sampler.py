"""Sampling completions with the training model itself, on its KV cache
(:mod:`nxd_finetune.models.decode`).

:func:`sample` takes token ids of prompts, repeats each ``num_generations`` times (consecutive rows,
as TRL's ``RepeatSampler`` orders a group), left-pads them and decodes up to
``max_completion_length`` tokens per row. Each step's logits pass through transformers' warpers in
transformers' order -- temperature, top-k, top-p (:func:`warp`) -- and one token per row is drawn
with ``torch.multinomial`` from the caller's :class:`torch.Generator`: one seed, one set of
completions, and the generator's state (``get_state`` / ``set_state``) saved with a checkpoint
resumes the same draws (one generator per row: each row's noise from its own, the draw
``multinomial`` makes, for all rows in one division and argmax). A prompt several rows share (a
GRPO group) is prefilled once, its cache copied to the group. ``temperature == 0`` is greedy
decoding. A row stops at the first of its stop ids (``serve.generate.stop_token_ids``); the result
is laid out as TRL's: prompts left-padded, completions right-padded, the mask covering each
completion up to and including its stop token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from nxd_finetune.errors import NxdError
from nxd_finetune.models.decode import KVCache, decode, new_cache
from nxd_finetune.models.llama import DecoderForCausalLM
from nxd_finetune.parallel.mappings import all_gather


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """TRL's names: ``temperature`` (0: greedy), ``top_p`` (1: off), ``top_k`` (0 or None: off)."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    def __post_init__(self) -> None:
        if self.max_completion_length < 1:
            raise NxdError(f"max_completion_length must be at least 1, got {self.max_completion_length}")
        if self.temperature < 0:
            raise NxdError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise NxdError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise NxdError(f"top_k must be >= 0, got {self.top_k}")


@dataclasses.dataclass(frozen=True)
class Completions:
    """Sampled rows (``N`` = prompts x ``num_generations``, a prompt's group consecutive):
    ``prompt_ids`` / ``prompt_mask`` ``[N, P]`` left-padded; ``completion_ids`` / ``completion_mask``
    ``[N, C]`` right-padded, the mask 1 up to and including the stop token; ``truncated [N]``: no
    stop token within ``max_completion_length``."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor

    def completions(self) -> list[list[int]]:
        """Each row's completion tokens (its stop token included)."""
        return [row[mask.bool()].tolist() for row, mask in zip(self.completion_ids, self.completion_mask, strict=True)]


def warp(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """``logits [N, V]`` after transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
    ``TopPLogitsWarper`` (in that order; removed tokens at ``-inf``, at least one kept)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits
    if settings.temperature != 1.0:
        scores = TemperatureLogitsWarper(settings.temperature)(None, scores)  # type: ignore[arg-type]
    if settings.top_k:
        scores = TopKLogitsWarper(settings.top_k)(None, scores)  # type: ignore[arg-type]
    if settings.top_p < 1.0:
        scores = TopPLogitsWarper(settings.top_p)(None, scores)  # type: ignore[arg-type]
    return scores


Generators = torch.Generator | Sequence[torch.Generator]
"""One generator for the batch, or one per row (each row's draws then depend on its own seed only,
not on the rows beside it: the same completions however the rows are split over ranks)."""


def next_tokens(logits: torch.Tensor, settings: SamplingSettings, generator: Generators) -> torch.Tensor:
    """One token per row of ``logits [N, V]``: the argmax when greedy, else a draw from the warped
    distribution with ``generator`` (or each row's own)."""
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    probs = warp(logits.float(), settings).softmax(dim=-1)
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    if len(generator) != probs.shape[0]:
        raise NxdError(f"{len(generator)} generators for {probs.shape[0]} rows")
    # torch.multinomial's one-sample draw, argmax(p / q) with q ~ Exp(1) drawn by the generator,
    # for every row at once: each row's noise from its own generator (the same draw as
    # multinomial(p[None], 1, generator=g)), one division and argmax over the batch
    noise = torch.empty_like(probs)
    for row, g in zip(noise, generator, strict=True):
        row.exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, P]`` ids and mask of ``prompts``, padded on the left to the longest."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise NxdError("every prompt must hold at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids, mask


@torch.no_grad()
def sample(model: DecoderForCausalLM, prompts: Sequence[Sequence[int]], settings: SamplingSettings,
           stop_ids: Sequence[int], pad_id: int, generator: Generators,
           num_generations: int = 1, vocab_group: dist.ProcessGroup | None = None) -> Completions:
    """Completions of ``prompts`` (token ids), ``num_generations`` per prompt (see the module
    docstring). The model runs in eval mode (no dropout) and is put back in its mode after.
    ``generator`` (one, or one per row after the repeat) lives on the model's device.
    ``vocab_group``: the tensor-parallel group the model's output layer shards the vocabulary over
    (its ranks gather the logits and, with the same generator states, draw the same tokens)."""
    if num_generations < 1:
        raise NxdError(f"num_generations must be at least 1, got {num_generations}")
    rows = [p for p in prompts for _ in range(num_generations)]
    prompt_ids, prompt_mask = left_pad(rows, pad_id)
    limit = settings.max_completion_length
    _check_rope(model, prompt_ids.shape[1] + limit)
    device = next(model.parameters()).device
    ids, mask = prompt_ids.to(device), prompt_mask.to(device)
    n = ids.shape[0]
    cache = new_cache(n, ids.shape[1] + limit, device)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    out = torch.full((n, limit), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    lengths = torch.full((n,), limit, dtype=torch.long, device=device)
    training = model.training
    model.eval()
    try:
        logits = _whole(_prefill(model, rows, ids, mask, cache), vocab_group)
        for step in range(limit):
            token = next_tokens(logits, settings, generator)
            token = torch.where(done, torch.full_like(token, pad_id), token)
            out[:, step] = token
            stopped = ~done & torch.isin(token, stops)
            lengths = torch.where(stopped, torch.full_like(lengths, step + 1), lengths)
            done = done | stopped
            if bool(done.all()) or step == limit - 1:
                break
            logits = _whole(decode(model, token[:, None], ~done[:, None], cache)[:, -1], vocab_group)
    finally:
        model.train(training)
    completion_mask = (torch.arange(limit, device=device)[None] < lengths[:, None]).long()
    return Completions(prompt_ids, prompt_mask, out.cpu(), completion_mask.cpu(), (~done).cpu())


def _prefill(model: DecoderForCausalLM, rows: Sequence[Sequence[int]], ids: torch.Tensor, mask: torch.Tensor,
             cache: KVCache) -> torch.Tensor:
    """The last position's logits ``[N, V]`` of the left-padded prompts ``ids``, their keys and
    values into ``cache``: each distinct prompt decoded once (a GRPO group's rows share theirs),
    its cache rows and logits copied to the rows that repeat it."""
    slot: dict[tuple[int, ...], int] = {}  # a distinct prompt -> its row in the distinct batch
    owner = [slot.setdefault(tuple(row), len(slot)) for row in rows]
    if len(slot) == len(rows):
        return decode(model, ids, mask, cache)[:, -1]
    picks = torch.tensor([owner.index(k) for k in range(len(slot))], device=ids.device)
    distinct = new_cache(len(slot), cache.capacity, ids.device)
    logits = decode(model, ids[picks], mask[picks], distinct)[:, -1]
    expand = torch.tensor(owner, device=ids.device)
    cache.fill_from(distinct, expand)
    return logits[expand]


def _whole(logits: torch.Tensor, vocab_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The logits over the whole vocabulary (gathered over ``vocab_group``; None: not sharded)."""
    return logits if vocab_group is None else all_gather(logits, -1, vocab_group)


def _check_rope(model: DecoderForCausalLM, total: int) -> None:
    """longrope switches its factors when a sequence passes ``original_max_position_embeddings``,
    which cached keys cannot follow: refused where prompt + completion could pass it."""
    after = model.model.rope.long_after
    if after is not None and total > after:
        raise NxdError(f"sampling with a KV cache past original_max_position_embeddings ({after}) of a longrope "
                       f"model is not supported (prompt + max_completion_length = {total})")

"""Rows that share their first tokens (a GRPO group: ``num_generations`` completions of one
prompt), run with each distinct prompt once.

:func:`shared_prefix_hidden` gives what ``DecoderModel(ids, keep_index=index)`` gives for rows laid
out as ``prompt + completion`` (right-padded, positions from 0), but runs each distinct prompt
through the layers once and every row's completion on a KV cache holding its prompt's keys and
values (:mod:`nxd_finetune.models.decode`): the prompt positions' projections, attention and MLP
are computed once per prompt instead of once per row. Under autograd the gradients of the rows
that share a prompt add up in its positions (the cache rows are an ``index_select`` of the
prompt's). The numbers equal the full forward's within float rounding.

:func:`can_share_prefix` says when it applies: the whole model (not a pipeline stage), no layer
recomputed in backward (activation checkpointing patches the layers' ``forward``, which the cache
path does not call) or compiled, no active dropout (a shared prompt would draw one mask for its
rows), and positions a longrope model's cache can follow.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from nxd_finetune.models.decode import decode_hidden, new_cache
from nxd_finetune.models.llama import DecoderForCausalLM, DecoderLayer

CAPACITY_MULTIPLE = 64
"""The KV caches' slots are rounded up to a multiple of this: the caches of every micro-batch then
come in a few sizes, and the allocator reuses the blocks one step freed in the next."""


def can_share_prefix(model: nn.Module, width: int) -> bool:
    """Whether :func:`shared_prefix_hidden` may run ``model`` on rows of ``width`` tokens (module
    docstring)."""
    if not isinstance(model, DecoderForCausalLM) or model.lm_head is None or model.return_hidden:
        return False
    inner = model.model
    if inner.embed_tokens is None or inner.norm is None:
        return False
    after = inner.rope.long_after
    if after is not None and width > after:
        return False
    for module in inner.layers.values():
        layer = cast(DecoderLayer, module)
        if layer.compiled is not None or "forward" in vars(layer):
            return False
    return not (model.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()))


def shared_prefix_hidden(model: DecoderForCausalLM, ids: torch.Tensor, prompt_lengths: torch.Tensor,
                         lengths: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The final (normed) hidden states ``[N, H]`` at the flat ``[B, T]`` positions ``index`` of
    rows ``ids [B, T]``, each its first ``prompt_lengths[r]`` tokens (the prompt) then its
    completion, ``lengths[r]`` real tokens in all (padding after); rows with equal prompts share
    their prompt's computation (module docstring). Positions past a row's ``lengths`` hold no
    meaningful state (as no real token attends to them in the full forward either)."""
    b, t = ids.shape
    device = ids.device
    plen, total = prompt_lengths.tolist(), lengths.tolist()
    host = ids.tolist()
    slot: dict[tuple[int, ...], int] = {}
    owner = [slot.setdefault(tuple(host[r][:plen[r]]), len(slot)) for r in range(b)]
    prompts = list(slot)
    p, c = max(len(x) for x in prompts), max(1, *(n - k for n, k in zip(total, plen, strict=True)))
    capacity = -(-(p + c) // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
    pids = torch.zeros(len(prompts), p, dtype=torch.long)
    pvalid = torch.zeros(len(prompts), p, dtype=torch.bool)
    for i, prompt in enumerate(prompts):
        pids[i, p - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        pvalid[i, p - len(prompt):] = True
    distinct = new_cache(len(prompts), capacity, device)
    head = decode_hidden(model, pids.to(device), pvalid.to(device), distinct)
    owners = torch.tensor(owner, dtype=torch.long)
    cache = new_cache(b, capacity, device)
    cache.fill_from(distinct, owners.to(device))
    starts = torch.tensor(plen, dtype=torch.long)[:, None]
    cols = starts + torch.arange(c)[None]  # row r's completion slots: its positions plen[r] ..
    tail_ids = ids.gather(1, cols.clamp(max=t - 1).to(device))
    tail_valid = cols < lengths.cpu()[:, None]
    tail = decode_hidden(model, tail_ids, tail_valid.to(device), cache)
    # each [B, T] position's row in cat(head [D * P], tail [B * C])
    j = torch.arange(t)[None]
    in_prompt = j < starts
    from_head = owners[:, None] * p + (p - starts) + j
    # (a position past its row's completion, padding, reads the row's last slot: no target is there)
    from_tail = len(prompts) * p + torch.arange(b)[:, None] * c + (j - starts).clamp(max=c - 1)
    where = torch.where(in_prompt, from_head, from_tail).reshape(-1).to(device)
    states = torch.cat([head.reshape(-1, head.shape[-1]), tail.reshape(-1, tail.shape[-1])])
    return states.index_select(0, where.index_select(0, index))

"""The mixture-of-experts block of Qwen3-MoE and Mixtral, with transformers 5's names and layout,
and transformers' router auxiliary (load-balancing) loss.

``mlp.gate`` (:class:`TopKRouter`, ``weight [E, H]``; not an ``nn.Linear``, as transformers', so
``all-linear`` LoRA leaves it alone) picks ``num_experts_per_tok`` experts per token from the
softmax of its logits (renormalised over the top k with ``norm_topk_prob``); ``mlp.experts``
(:class:`Experts`: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, as ``F.linear`` weights)
runs each token through its experts' SwiGLU and sums the outputs by those weights. The experts run
as two grouped GEMMs over the tokens sorted by expert (``torch._grouped_mm``, which torch 2.13 has
on CPU too, forward and backward); :meth:`Experts.loop` is transformers' per-expert loop, the
reference the tests compare it with. Dropless: every token reaches its k experts.

LoRA on the experts (PEFT's ``target_parameters``, :mod:`nxd_finetune.lora.experts`) reaches
them as per-expert low-rank factors (:data:`LowRank`): each expert's projection adds
``scaling * (x A_e^T) B_e^T``, run as two more grouped GEMMs over the same token groups (rank-wide,
so no ``[E, out, in]`` delta is formed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.models.activations import swiglu
from nxd_finetune.models.config import DecoderConfig

KERNELS = ("grouped", "loop")
# One fused expert tensor's LoRA: (A ``[E, r, in]``, B ``[E, out, r]``, scaling), keyed by the
# parameter's name (``gate_up_proj`` / ``down_proj``) in the mapping the experts take.
LowRank = tuple[torch.Tensor, torch.Tensor, float]
# The experts' computation on rows grouped by held expert: (rows, rows per held expert) -> outputs.
GroupFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Exchange(Protocol):
    """Expert parallel's dispatch and combine (:mod:`nxd_finetune.parallel.experts`): the rows of
    the (token, expert) pairs sorted by expert and the pair counts per expert ``[E]`` in; the rows
    sent to the ranks holding their experts, ``run`` on them there, the outputs back in the input's
    order out."""

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, run: GroupFn) -> torch.Tensor: ...


def _grouped_proj(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, lora: LowRank | None) -> torch.Tensor:
    """``x`` (rows grouped by expert) through each group's expert ``weight [E, out, in]``, plus the
    group's LoRA ``scaling * (x A_e^T) B_e^T`` in the factors' dtype (scaling on the r-wide part),
    added in place into the base product (its backward does not keep it: one ``[N, out]`` tensor and
    pass less per projection, the same numbers)."""
    y = torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    if lora is None:
        return y
    a, b, scaling = lora
    low = torch._grouped_mm(x.to(a.dtype), a.transpose(1, 2), offs=offsets) * scaling
    return y.add_(torch._grouped_mm(low, b.transpose(1, 2), offs=offsets).to(y.dtype))


def _expert_proj(x: torch.Tensor, weight: torch.Tensor, expert: int, lora: LowRank | None) -> torch.Tensor:
    """:func:`_grouped_proj` for one expert's rows (the loop's)."""
    y = F.linear(x, weight[expert])
    if lora is None:
        return y
    a, b, scaling = lora
    return y + F.linear(F.linear(x.to(a.dtype), a[expert]) * scaling, b[expert]).to(y.dtype)


class TopKRouter(nn.Module):
    """``x [N, H]`` -> (router logits ``[N, E]``, top-k weights ``[N, k]``, expert ids ``[N, k]``):
    transformers' ``Qwen3MoeTopKRouter`` / ``MixtralTopKRouter``. The softmax is in fp32; the
    weights are cast back to the logits' dtype unless ``router_fp32_weights`` (Mixtral)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.fp32_weights = config.router_fp32_weights
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top if self.fp32_weights else top.to(logits.dtype), index


class Experts(nn.Module):
    """The experts' SwiGLU weights, fused as transformers 5 holds them: ``gate_up_proj [E, 2I, H]``
    (each expert's gate rows, then its up rows) and ``down_proj [E, H, I]``. ``kernel``: ``grouped``
    (default) or ``loop`` (the reference).

    Under expert parallel (:func:`nxd_finetune.parallel.experts.apply_expert_parallel`) the module
    holds the experts ``held`` only (its tensors ``[len(held), ...]``; ``num_experts`` stays the
    model's) and ``exchange`` sends each (token, expert) pair's row to the rank holding the expert
    (the grouped kernel: the loop is the one-process reference)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        e, h = config.num_experts, config.hidden_size
        i = config.moe_intermediate_size or config.intermediate_size
        self.num_experts = e
        self.held = range(e)
        self.exchange: Exchange | None = None
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.kernel = "grouped"

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                lora: Mapping[str, LowRank] | None = None) -> torch.Tensor:
        """``x [N, H]``, ``index`` / ``weights [N, k]`` -> ``[N, H]``: the sum over each token's k
        experts of its weight times the expert's output. ``lora``: low-rank deltas by parameter
        name (``gate_up_proj`` / ``down_proj``), what LoRA wrappers around this module pass."""
        lora = lora or {}
        if self.kernel == "loop" and self.exchange is None:
            return self.loop(x, index, weights, lora)
        return self.grouped(x, index, weights, lora)

    def grouped(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                lora: Mapping[str, LowRank] | None = None) -> torch.Tensor:
        """The N*k (token, expert) pairs sorted by expert (stable: tokens keep their order), each
        expert's contiguous run through ``torch._grouped_mm`` (offsets: the runs' ends), weighted
        and added back to the tokens in expert order, as the loop does."""
        k = index.shape[1]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)
        lora = lora or {}

        def run(rows: torch.Tensor, held_counts: torch.Tensor) -> torch.Tensor:
            return self.run_groups(rows, held_counts, lora)

        rows = x[token]
        y = run(rows, counts) if self.exchange is None else self.exchange(rows, counts, run)
        y = y * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))

    def run_groups(self, rows: torch.Tensor, counts: torch.Tensor,
                   lora: Mapping[str, LowRank] | None = None) -> torch.Tensor:
        """``rows`` grouped by held expert (``counts``: rows per held expert) through their
        experts' SwiGLU: two grouped GEMMs (and LoRA's). No rows (no pair routed to this rank's
        experts): one zero row runs instead, so the tensors still get their (zero) gradients."""
        lora = lora or {}
        empty = rows.shape[0] == 0
        if empty:
            rows = rows.new_zeros(1, rows.shape[1])
            counts = counts.clone()
            counts[-1] = 1
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = _grouped_proj(rows, self.gate_up_proj, offsets, lora.get("gate_up_proj"))
        gate, up = gate_up.chunk(2, dim=-1)
        y = _grouped_proj(swiglu(gate, up), self.down_proj, offsets, lora.get("down_proj"))
        return y[:0] if empty else y

    def loop(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
             lora: Mapping[str, LowRank] | None = None) -> torch.Tensor:
        """transformers' reference: one expert at a time over the tokens routed to it."""
        lora = lora or {}
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            token, slot = torch.where(index == expert)
            if token.numel() == 0:
                continue
            gate, up = _expert_proj(x[token], self.gate_up_proj, expert, lora.get("gate_up_proj")).chunk(2, dim=-1)
            y = _expert_proj(swiglu(gate, up), self.down_proj, expert, lora.get("down_proj"))
            y = y * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out


class SparseMoeBlock(nn.Module):
    """A layer's mixture-of-experts MLP (HF's ``mlp``): ``gate`` (:class:`TopKRouter`) and
    ``experts`` (:class:`Experts`). ``x [..., H]`` -> ``[..., H]``, every token on its own (packed
    rows route as separate ones). While :func:`record_router_logits` is open, each forward stores
    its router logits there under the layer's index (a recomputed forward overwrites its own)."""

    def __init__(self, config: DecoderConfig, index: int) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.index = index
        self.jitter_noise = config.router_jitter_noise
        self.recorder: dict[int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.training and self.jitter_noise > 0:  # Mixtral's router_jitter_noise (its block's input)
            flat = flat * torch.empty_like(flat).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        logits, weights, index = self.gate(flat)
        if self.recorder is not None:
            self.recorder[self.index] = logits
        return self.experts(flat, index, weights).reshape(x.shape)


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's mixture-of-experts blocks, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def set_expert_kernel(model: nn.Module, kernel: str) -> None:
    """Every experts module's kernel: ``grouped`` or ``loop`` (:data:`KERNELS`); NxdError for another."""
    if kernel not in KERNELS:
        raise NxdError(f"expert kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    for block in moe_blocks(model):
        experts_of(block).kernel = kernel


def experts_of(block: SparseMoeBlock) -> Experts:
    """The block's :class:`Experts`, inside any LoRA wrappers around it."""
    return next(m for m in block.experts.modules() if isinstance(m, Experts))


@contextlib.contextmanager
def record_router_logits(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Inside the block, the model's forward passes store each MoE layer's router logits
    (``[tokens, E]``, the tokens of every row of the batch) in the yielded dict, keyed by layer
    index; :func:`load_balancing_loss` turns them into transformers' auxiliary loss."""
    logits: dict[int, torch.Tensor] = {}
    blocks = moe_blocks(model)
    for block in blocks:
        block.recorder = logits
    try:
        yield logits
    finally:
        for block in blocks:
            block.recorder = None


def router_sums(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """The sums :func:`load_balancing_loss` is made of, over the given layers' tokens, as one fp32
    tensor ``[2E + 1]``: the top-k assignment counts ``T_e`` (no gradient), the router probability
    sums ``P_e`` (with it) and the token count ``N`` (tokens x layers; ``mask`` as there). Sums of
    disjoint sets of layers add up to the sums of their union (a pipeline's stages); no layers:
    zeros."""
    device = router_logits[0].device if router_logits else None
    flat_mask = None if mask is None else mask.reshape(-1).to(device, torch.float32)
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_sum = torch.zeros_like(tokens)
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for layer in router_logits:
        probs = torch.softmax(layer, dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        weight = (torch.ones_like(chosen, dtype=torch.float32) if flat_mask is None
                  else flat_mask.repeat_interleave(top_k))
        tokens = tokens + torch.zeros_like(tokens).scatter_add_(0, chosen, weight)
        row_weight = torch.ones(probs.shape[0], device=tokens.device) if flat_mask is None else flat_mask
        probs_sum = probs_sum + (probs.float() * row_weight.unsqueeze(-1)).sum(dim=0)
        total = total + row_weight.sum()
    return torch.cat([tokens, probs_sum, total])


def balance_from_sums(sums: torch.Tensor, num_experts: int) -> torch.Tensor:
    """transformers' load-balancing loss ``E * sum_e (T_e / N) * (P_e / N)`` from
    :func:`router_sums`' ``[T, P, N]`` (every layer's)."""
    tokens, probs_sum, total = sums[:num_experts], sums[num_experts:2 * num_experts], sums[2 * num_experts]
    return torch.sum((tokens / total) * (probs_sum / total)) * num_experts


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer's eqs. 4-6 summed over the
    layers' tokens): ``num_experts * sum_e f_e * P_e``, ``f_e`` the share of top-k assignments and
    ``P_e`` the mean router probability of expert ``e``, over every layer's tokens; ``mask``
    (``[B, T]``, 1 for real tokens, as the attention mask transformers takes) leaves padding out.
    Every layer's logits must cover the same tokens (a forward with ``logits_index`` routes only the
    kept positions in its last layer: NxdError)."""
    if not router_logits:
        raise NxdError("no router logits recorded: the model has no mixture-of-experts layer")
    rows = {t.shape[0] for t in router_logits}
    if len(rows) != 1:
        raise NxdError(f"router logits cover different token counts per layer ({sorted(rows)}): run the forward "
                       "without logits_index")
    return balance_from_sums(router_sums(router_logits, num_experts, top_k, mask), num_experts)


def router_aux_loss(model: nn.Module, logits: dict[int, torch.Tensor],
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """The auxiliary loss transformers reports (``aux_loss``, ``output_router_logits``) for the
    router ``logits`` :func:`record_router_logits` recorded from ``model``'s forward (without the
    ``router_aux_loss_coef`` factor, as transformers' ``aux_loss``)."""
    config = getattr(model, "config", None)
    if not isinstance(config, DecoderConfig) or not config.num_experts:
        raise NxdError("router_aux_loss needs a mixture-of-experts DecoderForCausalLM")
    return load_balancing_loss([logits[i] for i in sorted(logits)], config.num_experts,
                               config.num_experts_per_tok, mask)

"""NxD's mixture-of-experts layers (``neuronx_distributed/modules/moe/``) -> transformers' fused experts.

NxD Training's HF Mixtral (``models/hf_models/modeling_mixtral.py``) makes each decoder layer's
``mlp`` an NxD ``MoE(router=RouterTopK, expert_mlps=ExpertMLPs(glu_mlp=True))``; its parameters:

- ``mlp.router.linear_router.weight`` ``[E, H]``: a plain ``nn.Linear(H, E)`` (``routing.py``),
  the same on every tensor- and expert-parallel rank; transformers' ``mlp.gate.weight``;
- ``mlp.expert_mlps.mlp_op.gate_up_proj.weight`` ``[E/ep, H, 2I/tp]``: an
  ``ExpertFusedColumnParallelLinear`` (``moe_parallel_layers.py``: weight ``(local experts,
  input_size, output_size_per_partition)``, split on dim 2) made with ``stride=2``
  (``experts.py``), so rank ``t`` holds ``cat(gate_t^T, up_t^T)`` on dim 2: its ``I/tp`` gate
  columns, then its up columns (``_activation`` chunks the output in two);
- ``mlp.expert_mlps.mlp_op.down_proj.weight`` ``[E/ep, I/tp, H]``: an
  ``ExpertFusedRowParallelLinear`` (weight ``(local experts, input_size_per_partition,
  output_size)``, split on dim 1).

The expert weights are input-major (``x @ W``), transformers' are ``F.linear`` weights:
``gate_up_proj [E, 2I, H]`` (each expert's gate rows, then its up rows) and ``down_proj
[E, H, I]``, so each is transposed back. Expert-parallel rank ``e`` of ``ep`` holds experts
``e*E/ep .. (e+1)*E/ep - 1`` (``checkpoint_converter.py``: ``narrow(0, E/ep * ep_rank, E/ep)``)
and writes ``model/dp_rank_00_ep_rank_EE_tp_rank_TT_pp_rank_PP.pt`` (``trainer/checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nxd_finetune.errors import ModelLoadError

Tensors = dict[str, torch.Tensor]

ROUTER = ".mlp.router.linear_router.weight"
GATE_UP = ".mlp.expert_mlps.mlp_op.gate_up_proj.weight"
DOWN = ".mlp.expert_mlps.mlp_op.down_proj.weight"
_HF = {ROUTER: ".mlp.gate.weight", GATE_UP: ".mlp.experts.gate_up_proj", DOWN: ".mlp.experts.down_proj"}
_EXPERT = ".expert_mlps."  # what NxD's converter and loader take for an expert-parallel tensor


def moe_name(name: str) -> str | None:
    """The HF name of NxD's MoE tensor ``name`` (router, fused experts), or None for any other."""
    for suffix, hf in _HF.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + hf
    return None


def is_router(name: str) -> bool:
    return name.endswith(ROUTER)


def unite_experts(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """One expert tensor's tensor-parallel shards (every expert, ``[E, ...]``) -> transformers' tensor."""
    if any(t.dim() != 3 for t in shards):
        raise ModelLoadError(f"{name}: NxD's expert weights are 3-d [experts, in, out]; found "
                             f"{tuple(shards[0].shape)}")
    if name.endswith(DOWN):
        return torch.cat(list(shards), dim=1).transpose(1, 2).contiguous()
    if any(t.shape[2] % 2 for t in shards):
        raise ModelLoadError(f"{name}: {shards[0].shape[2]} columns per rank do not split into gate and up halves")
    gate = torch.cat([t.chunk(2, dim=2)[0] for t in shards], dim=2)
    up = torch.cat([t.chunk(2, dim=2)[1] for t in shards], dim=2)
    return torch.cat([gate, up], dim=2).transpose(1, 2).contiguous()


def unite_ep(parts: Sequence[Tensors], where: str) -> Tensors:
    """One (tp, pp) rank's files of every expert-parallel rank -> one state dict holding every
    expert: the expert tensors concatenated on dim 0 in ep order; every other tensor is data
    parallel over the ep ranks, taken from ep rank 0 (a later rank's file holds the same tensor,
    or, as NxD's converter writes it, none)."""
    out = dict(parts[0])
    for e, part in enumerate(parts[1:], 1):
        experts = {k for k in parts[0] if _EXPERT in k}
        if {k for k in part if _EXPERT in k} != experts:
            diff = sorted({k for k in part if _EXPERT in k} ^ experts)[0]
            raise ModelLoadError(f"{where}: ep ranks 0 and {e} hold different expert tensors (e.g. {diff})")
        for k, t in part.items():
            if _EXPERT in k:
                continue
            if k not in out:
                raise ModelLoadError(f"{where}: ep rank {e} holds {k}, which ep rank 0 does not")
            if not torch.equal(out[k], t):
                raise ModelLoadError(f"{where}: {k} differs between ep ranks 0 and {e}; NxD replicates it over them "
                                     "(shard files from different checkpoints?)")
    for k in out:
        if _EXPERT in k:
            out[k] = torch.cat([p[k] for p in parts])
    return out

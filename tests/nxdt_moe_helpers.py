"""NxD Training's HF Mixtral checkpoints written from transformers' tensors, as NxD lays them out
(the oracle side of tests/test_nxdt_moe.py; independent of nxd_finetune/nxdt/experts.py).

NxDT's ``modeling_mixtral.py`` makes each layer's ``mlp`` an NxD ``MoE``: ``router.linear_router``
(``nn.Linear(H, E)``) and ``expert_mlps.mlp_op.gate_up_proj`` / ``down_proj``
(``ExpertFusedColumnParallelLinear`` with ``stride=2`` / ``ExpertFusedRowParallelLinear``). The full
expert tensors are NxD's own test helper's (``test/integration/modules/moe/utils.py:
fuse_experts_weights``: per expert ``cat(gate, up, dim=0).transpose(0, 1)`` and ``down.transpose(0,
1)``, stacked), split over tp as ``_initialize_affine_weight`` does (``parallel_layers/layers.py``:
``torch.split`` in ``per_partition / stride`` pieces, rank ``r`` takes ``pieces[r::tp]``) and over ep
as ``checkpoint_converter.py``'s ``convert_full_state_to_tp`` (``narrow(0, E/ep * ep_rank, E/ep)``).
The rest of the model is NxD's HF Llama layout (``tests/nxdt_helpers.py``).
"""

from __future__ import annotations

import torch
from nxdt_helpers import partitions, shard_model

Tensors = dict[str, torch.Tensor]


def _experts_full(hf: Tensors, pre: str, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NxD's full ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` from transformers' tensors,
    expert by expert as ``fuse_experts_weights`` builds them from per-expert linear weights."""
    gate_up, down = hf[f"{pre}.experts.gate_up_proj"], hf[f"{pre}.experts.down_proj"]
    inter = down.shape[2]
    fused, downs = [], []
    for e in range(experts):
        gate_w, up_w = gate_up[e, :inter], gate_up[e, inter:]  # the experts' w1 / w3 [I, H]
        fused.append(torch.cat((gate_w, up_w), dim=0).transpose(0, 1).contiguous())
        downs.append(down[e].transpose(0, 1).contiguous())  # w2 [H, I] -> [I, H]
    return torch.stack(fused), torch.stack(downs)


def _split(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int) -> torch.Tensor:
    """``_initialize_affine_weight``'s split of ``full`` on ``dim`` with ``stride``."""
    per_stride = full.shape[dim] // tp // stride
    pieces = torch.split(full, per_stride, dim=dim)
    return torch.cat(pieces[rank::tp], dim=dim)


def shard_moe(hf: Tensors, cfg: dict, ep: int, tp: int, pp: int, *, m: int = 1, hw: str = "trn1",
              experts_only: bool = False) -> dict[tuple[int, ...], Tensors]:
    """Every rank's state dict of NxDT's HF Mixtral: by (ep, tp, pp) where ``ep`` > 1 (files named
    with ``ep_rank``, as ``save_checkpoint`` names them when ``expert_model_parallel_size`` > 1),
    else by (tp, pp). An ep rank > 0 holds every tensor (the trainer saves each rank's whole state
    dict) or, ``experts_only``, its experts alone (NxD's converter: "Non-expert parameters only in
    EP rank 0")."""
    experts, layers = cfg["num_local_experts"], cfg["num_hidden_layers"]
    dense = {k: v for k, v in hf.items() if ".mlp." not in k}
    base = shard_model(dense, cfg, tp, pp, m=m, hw=hw)
    stage_of = partitions(pp, layers)
    full = {i: _experts_full(hf, f"model.layers.{i}.mlp", experts) for i in range(layers)}
    local = experts // ep
    out: dict[tuple[int, ...], Tensors] = {}
    for e in range(ep):
        for (t, p), part in base.items():
            state = {} if e and experts_only else dict(part)
            for i in (i for i in range(layers) if stage_of[i] == p):
                pre = f"model.layers.{i}.mlp"
                if not (e and experts_only):
                    state[f"{pre}.router.linear_router.weight"] = hf[f"{pre}.gate.weight"].clone()
                gate_up, down = (x.narrow(0, local * e, local) for x in full[i])
                state[f"{pre}.expert_mlps.mlp_op.gate_up_proj.weight"] = _split(gate_up, 2, tp, t, 2).clone()
                state[f"{pre}.expert_mlps.mlp_op.down_proj.weight"] = _split(down, 1, tp, t, 1).clone()
            out[(e, t, p) if ep > 1 else (t, p)] = state
    return out

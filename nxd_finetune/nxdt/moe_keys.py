"""NxDT's mixture-of-experts keys (``model.moe.*``, ``distributed_strategy.expert_model_parallel_size``)
and what becomes of each in a recipe.

NxDT's HF Mixtral (``lightning_modules/model/hf_models/mixtral_model.py``) reads ``model.moe``'s
``num_experts``, ``frequency``, ``dropout``, ``capacity_factor``, ``top_k``,
``output_router_logits``, ``router_aux_loss_coef`` and ``normalize_top_k_affinities`` over the HF
``config.json``; its layers route with ``RouterTopK`` whatever ``routing_algorithm`` says, and
``dropless`` is read by no code (``capacity_factor`` decides: null, <= 0 or >= experts / top_k is
full capacity, ``expert_mlps_v2.py``). nxd-finetune takes the architecture and the router loss from
``config.json`` and routes dropless, so a value that agrees is *mapped* and one that does not is
*not carried over*, with what to change.
"""

from __future__ import annotations

from typing import Any

from nxd_finetune.nxdt.walk import KeyWalk

_EP = "distributed_strategy.expert_model_parallel_size"
_SP = "distributed_strategy.sequence_parallel"
_P = "model.moe."


def translate_moe(walk: KeyWalk, hf: dict[str, Any], source: str) -> None:
    """``model.moe.*`` and the expert-parallel size against the HF config ``hf`` (file ``source``)."""
    experts_key = "num_local_experts" if "num_local_experts" in hf else "num_experts"
    experts = hf.get(experts_key)
    ep = walk.integer(_EP, 1)
    if not isinstance(experts, int) or experts < 1:
        kind = f"{source} defines a dense model (model_type {hf.get('model_type')!r})"
        if ep > 1:
            walk.drop(_EP, f"{kind}: it has no experts to split")
        else:
            walk.keep(_EP, "1: no expert parallel")
        walk.drop(_P[:-1], f"{kind}; NxDT's MoE settings apply to its Mixtral")
        return
    walk.put("parallel.ep", ep, _EP)
    if walk.recipe.get("parallel", {}).get("sequence_parallel"):  # mapped by _distributed, before the model was read
        walk.recipe["parallel"]["sequence_parallel"] = False
        walk.mapped[:] = [(k, to) for k, to in walk.mapped if k != _SP]
        walk.dropped.append((_SP, "a mixture-of-experts model's router and experts run on whole rows in nxd-finetune "
                                  "(no sequence parallel); parallel.sequence_parallel=false"))
    top_k = hf.get("num_experts_per_tok")
    _compare(walk, "num_experts", experts, experts_key, source, "the architecture is the HF checkpoint's")
    _compare(walk, "top_k", top_k, "num_experts_per_tok", source, "the architecture is the HF checkpoint's")
    _compare(walk, "dropout", float(hf.get("attention_dropout") or 0.0), "attention_dropout", source,
             "NxDT applies it as the attention dropout; nxd-finetune takes it from the HF config")
    for key, default in (("router_aux_loss_coef", 0.001), ("output_router_logits", False)):
        _compare(walk, key, hf.get(key, default), key, source,
                 f"nxd-finetune reads it from {source}: set it there to train the router auxiliary loss as NxDT did")
    norm = hf.get("norm_topk_prob", hf.get("model_type") == "mixtral")  # transformers' Mixtral always renormalises
    _compare(walk, "normalize_top_k_affinities", norm, "norm_topk_prob", source,
             "the top-k weights are renormalised as the model family does (transformers' Mixtral always)")
    if walk.integer(_P + "frequency", 1) == 1:
        walk.keep(_P + "frequency", "1: every layer is a mixture-of-experts layer, as in transformers' model")
    else:
        walk.drop(_P + "frequency", "NxDT puts dense MLP layers between its MoE layers; the HF model has an MoE "
                                    "block in every layer")
    cf = walk.get(_P + "capacity_factor")
    if cf is None or walk.number(_P + "capacity_factor") <= 0 or (
            isinstance(top_k, int) and top_k > 0 and walk.number(_P + "capacity_factor") >= experts / top_k):
        walk.keep(_P + "capacity_factor", "full capacity (dropless): every token reaches its top-k experts, as in "
                                          "nxd-finetune")
    else:
        walk.drop(_P + "capacity_factor", f"NxDT drops the tokens beyond an expert's capacity ({cf} x tokens x top_k "
                                          "/ experts); nxd-finetune is dropless, as transformers: every token reaches "
                                          "its top-k experts")
    walk.keep(_P + "dropless", "not read by NxDT's HF Mixtral (capacity_factor decides); nxd-finetune is dropless")
    walk.keep(_P + "routing_algorithm", "NxDT's HF Mixtral routes top-k (RouterTopK), as nxd-finetune")
    for key in ("sinkhorn_iterations", "sinkhorn_tol"):
        walk.keep(_P + key, "Sinkhorn routing is not used by NxDT's HF Mixtral (top-k), nor by nxd-finetune")


def _compare(walk: KeyWalk, key: str, theirs: object, hf_key: str, source: str, why: str) -> None:
    """``model.moe.<key>`` against the HF config's ``hf_key``: equal, mapped; different, not carried over."""
    full = _P + key
    if not walk.has(full):
        return
    ours = walk.flag(full) if isinstance(theirs, bool) else walk.number(full)
    if isinstance(theirs, bool | int | float) and ours == theirs:
        walk.keep(full, f"matches {source}'s {hf_key}")
    else:
        walk.drop(full, f"NxDT sets {hf_key}={walk.get(full)} over {source}'s {theirs}; {why}")

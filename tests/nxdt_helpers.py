"""Writing checkpoints in NxD's sharded layout from full HF tensors, as NxD does (the oracle side
of tests/test_nxdt_import.py; independent of the importer in nxd_finetune/nxdt/).

Follows ``neuronx_distributed/scripts/checkpoint_converter.py`` (``convert_full_state_to_tp``:
names, shard dims, the query-head shuffle under kv replication for ``hw_backend`` trn1 / trn2,
``gate_up_proj`` as ``cat(gate_r, up_r)``, ``coalesce_qkv``, ``convert_partial_state_to_fused_qkv``),
``pipeline/partition.py`` (``create_partitions``: even split, remainder to the later stages) and
``trainer/checkpoint.py`` (``<tag>/model/dp_rank_00_tp_rank_YY_pp_rank_ZZ.pt``, the ``checkpoint``
and ``done`` markers; ``save_xser``: TensorReference objects + ``<file>.tensors/tensor_N.pt``).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

Tensors = dict[str, torch.Tensor]


def read_hf(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the HF checkpoint at ``out`` (its safetensors files)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def partitions(pp: int, layers: int) -> list[int]:
    """The pipeline stage of each layer (``create_partitions`` + ``stage_to_pipeline_parallel_rank``)."""
    per = [layers // pp] * pp
    for i in range(-(layers % pp), 0):
        per[i] += 1
    return [stage for stage, n in enumerate(per) for _ in range(n)]


def shuffle_q(full: torch.Tensor, q: int, kv: int, m: int, tp: int, rank: int, hw: str, hd: int) -> torch.Tensor:
    """Rank ``rank``'s query rows (or, transposed, o_proj columns), the converter's code path."""
    weights = full.reshape(q, hd, -1)
    x = weights.shape[-1]
    if hw == "trn2":
        return weights.reshape(q, hd, x)[rank * (q // tp):(rank + 1) * (q // tp)].reshape(-1, x)
    per = q // (kv * m)
    weights = weights.reshape(-1, per, hd, x)
    if tp < kv:  # kv heads spread over ranks without replication: a plain split
        return weights.reshape(q, hd, x)[rank * (q // tp):(rank + 1) * (q // tp)].reshape(-1, x)
    idx = torch.arange(0, kv) * tp // kv
    splits = [weights[idx + i] for i in range(tp // kv)]
    return torch.cat(splits, dim=0)[rank].reshape(-1, x)


def replicate_kv(full: torch.Tensor, m: int, tp: int, rank: int, hw: str, hd: int) -> torch.Tensor:
    """``_initialize_affine_weight``'s kv replication (repeat on trn1, repeat_interleave on trn2)
    then the rank's slice on dim 0."""
    heads = full.reshape(-1, hd, full.shape[-1])
    rep = heads.repeat_interleave(m, dim=0) if hw == "trn2" else heads.repeat(m, 1, 1)
    rep = rep.reshape(-1, full.shape[-1])
    size = rep.shape[0] // tp
    return rep[rank * size:(rank + 1) * size]


def shard_model(hf: Tensors, cfg: dict, tp: int, pp: int, *, m: int = 1, hw: str = "trn1", qkv: str = "gqa",
                lora: Tensors | None = None) -> dict[tuple[int, int], Tensors]:
    """Every (tp_rank, pp_rank)'s state dict. ``qkv``: ``gqa`` (qkv_linear, weight_q/k/v), ``gqa_fused``
    (qkv_linear + fuse_qkv, weight_qkv), ``mha_fused`` (fuse_qkv without qkv_linear: qkv_proj.weight)."""
    q, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    stage_of = partitions(pp, cfg["num_hidden_layers"])
    out: dict[tuple[int, int], Tensors] = {}
    for t in range(tp):
        for p in range(pp):
            part: Tensors = {}
            for name, w in hf.items():
                if "embed_tokens" in name and p != 0:
                    continue
                if ("lm_head" in name or name == "model.norm.weight") and p != pp - 1:
                    continue
                if ".layers." in name and stage_of[int(name.split(".")[2])] != p:
                    continue
                part.update(_shard_one(name, w, hf, q, kv, hd, m, tp, t, hw, qkv))
            if qkv == "gqa_fused":
                for k in [k for k in part if k.endswith("qkv_proj.weight_q")]:
                    pre = k[: -len("weight_q")]
                    fused = [part.pop(pre + x) for x in ("weight_q", "weight_k", "weight_v")]
                    part[pre + "weight_qkv"] = torch.cat(fused)
            out[(t, p)] = {k: v.clone() for k, v in part.items()}
    return out


def _shard_one(name: str, w: torch.Tensor, hf: Tensors, q: int, kv: int, hd: int, m: int, tp: int, t: int, hw: str,
               qkv: str) -> Tensors:
    def split(dim: int) -> torch.Tensor:
        return w.chunk(tp, dim)[t]

    attn = name.rsplit(".", 2)[0]  # model.layers.N.self_attn
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        if qkv == "mha_fused":
            if not name.endswith("q_proj.weight"):
                return {}
            parts = [hf[f"{attn}.{x}_proj.weight"].chunk(tp)[t] for x in "qkv"]
            return {f"{attn}.qkv_proj.weight": torch.cat(parts)}
        which = name.rsplit(".", 2)[1][0]
        if which == "q":
            return {f"{attn}.qkv_proj.weight_q": shuffle_q(w, q, kv, m, tp, t, hw, hd)}
        return {f"{attn}.qkv_proj.weight_{which}": replicate_kv(w, m, tp, t, hw, hd)}
    if name.endswith("o_proj.weight"):
        if qkv == "mha_fused":
            return {name: split(1)}
        return {name: shuffle_q(w.t(), q, kv, m, tp, t, hw, hd).t()}
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        if name.endswith("up_proj.weight"):
            return {}
        mlp = name.rsplit(".", 2)[0]
        gate, up = hf[f"{mlp}.gate_proj.weight"].chunk(tp)[t], hf[f"{mlp}.up_proj.weight"].chunk(tp)[t]
        return {f"{mlp}.gate_up_proj.weight": torch.cat([gate, up])}
    if name.endswith("down_proj.weight"):
        return {name: split(1)}
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return {name: split(0)}
    return {name: w}


def shard_lora(peft: Tensors, cfg: dict, tp: int, pp: int, *, m: int = 1, hw: str = "trn1",
               merged: bool = False) -> dict[tuple[int, int], Tensors]:
    """NxD LoRA state dicts from a PEFT adapter whose q/k/v share one A and gate/up one A (NxD's
    fused layers have one A): ``qkv_proj.lora_A`` replicated, ``lora_B.weight_q/k/v`` laid out as
    the layer; ``gate_up_proj.lora_B`` as ``cat(B_gate_r, B_up_r)``; row layers' A split on dim 1
    (o_proj's columns in the query order), B replicated. ``merged``: ``merge_sharded_lora`` (every
    rank holds the gathered tensors, GQA B as ``chunk(gathered, m)[0]``)."""
    q, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    stage_of = partitions(pp, cfg["num_hidden_layers"])
    mods = sorted({k[len("base_model.model."):].rsplit(".lora_", 1)[0] for k in peft})
    out: dict[tuple[int, int], Tensors] = {}
    for t in range(tp):
        for p in range(pp):
            part: Tensors = {}
            for mod in mods:
                if stage_of[int(mod.split(".")[2])] != p:
                    continue
                a, b = peft[f"base_model.model.{mod}.lora_A.weight"], peft[f"base_model.model.{mod}.lora_B.weight"]
                parent, kind = mod.rsplit(".", 1)
                if kind in ("q_proj", "k_proj", "v_proj"):
                    part[f"{parent}.qkv_proj.lora_A.weight"] = a
                    x = kind[0]
                    if merged:
                        rows = [shuffle_q(b, q, kv, m, tp, r, hw, hd) if x == "q" else replicate_kv(b, m, tp, r, hw, hd)
                                for r in range(tp)]
                        part[f"{parent}.qkv_proj.lora_B.weight_{x}"] = torch.cat(rows).chunk(m)[0]
                    else:
                        part[f"{parent}.qkv_proj.lora_B.weight_{x}"] = (
                            shuffle_q(b, q, kv, m, tp, t, hw, hd) if x == "q" else replicate_kv(b, m, tp, t, hw, hd))
                elif kind in ("gate_proj", "up_proj"):
                    part[f"{parent}.gate_up_proj.lora_A.weight"] = a
                    if kind == "gate_proj":
                        up = peft[f"base_model.model.{parent}.up_proj.lora_B.weight"]
                        ranks = [torch.cat([b.chunk(tp)[r], up.chunk(tp)[r]]) for r in range(tp)]
                        part[f"{parent}.gate_up_proj.lora_B.weight"] = torch.cat(ranks) if merged else ranks[t]
                elif kind in ("o_proj", "down_proj"):
                    cols = [shuffle_q(a.t(), q, kv, m, tp, r, hw, hd).t() if kind == "o_proj" else a.chunk(tp, 1)[r]
                            for r in range(tp)]
                    part[f"{mod}.lora_A.weight"] = torch.cat(cols, 1) if merged else cols[t]
                    part[f"{mod}.lora_B.weight"] = b
            out[(t, p)] = {k: v.clone() for k, v in part.items()}
    return out


def write_checkpoint(root: Path, tag: str, shards: dict[tuple[int, ...], Tensors], *, extra: dict | None = None,
                     xser: bool = False, done: bool = True) -> Path:
    """``root/tag`` as ``nxd.save_checkpoint`` leaves it (model files, optimizer stand-ins, markers).
    ``shards`` by (tp, pp), or by (ep, tp, pp) under expert parallel: ``dp_rank_00_ep_rank_XX_...``
    names, and with ``save_xser`` an ep rank > 0 writes its experts' tensor files only
    (``_xser_save_data``: ``is_expert_parallel or emp_rank == 0``)."""
    d = root / tag
    (d / "model").mkdir(parents=True)
    (d / "optim").mkdir()
    (d / "checkpoint").write_text("1")
    for rank, state in shards.items():
        e, t, p = rank if len(rank) == 3 else (None, *rank)
        ep_part = "" if e is None else f"_ep_rank_{e:02d}"
        name = d / "model" / f"dp_rank_00{ep_part}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt"
        obj: dict = {**state, **(extra or {})}
        if xser:
            _xser_save(obj, name, lambda k, e=e: not e or ".expert_mlps." in k)
        else:
            torch.save(obj, name)
        torch.save({"state": {}, "param_groups": []}, d / "optim" / name.name)
    torch.save({"last_epoch": 3}, d / "scheduler.pt")
    if done:
        (d / "done").write_text("1")
    return d


def _xser_save(obj: dict, path: Path, written: Callable[[str], bool] = lambda k: True) -> None:
    """``torch_xla.utils.serialization.save``: each tensor to ``<path>.tensors/tensor_<i>.pt``, the
    state dict with ``TensorReference(i)`` in its place (the class under torch_xla's name);
    ``written(key)`` false: the reference only, its file left to another rank."""
    mod = types.ModuleType("torch_xla.utils.serialization")

    class TensorReference:
        def __init__(self, tid: int) -> None:
            self.tid = tid

    TensorReference.__module__ = mod.__name__
    TensorReference.__qualname__ = "TensorReference"
    mod.TensorReference = TensorReference  # type: ignore[attr-defined]
    folder = path.with_name(path.name + ".tensors")
    folder.mkdir()
    refs: dict = {}
    for i, (k, v) in enumerate(obj.items()):
        if isinstance(v, torch.Tensor):
            if written(k):
                torch.save(v, folder / f"tensor_{i}.pt")
            refs[k] = TensorReference(i)
        else:
            refs[k] = v
    saved = {n: sys.modules.get(n) for n in ("torch_xla", "torch_xla.utils", mod.__name__)}
    sys.modules.update({"torch_xla": types.ModuleType("torch_xla"), "torch_xla.utils": types.ModuleType("x"),
                        mod.__name__: mod})
    try:
        torch.save(refs, path)
    finally:
        for n, old in saved.items():
            if old is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old

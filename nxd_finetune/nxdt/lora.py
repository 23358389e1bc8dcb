"""NxD LoRA adapter checkpoint -> PEFT adapter (``neuronx_distributed/modules/lora/``).

NxD's ``LoraModel.state_dict()`` is what ``nxd.save_checkpoint`` writes into every rank's model
file: ``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (``lora_B.weight_q/_k/_v`` or
``weight_qkv`` on a GQA ``qkv_proj``), a ``lora_config`` dict (``save_lora_config_adapter``), and,
with ``save_lora_base``, the base model under ``<module>.base_layer.<param>`` names. Shards follow
the base layer (``tp_layer.py``): on a column-parallel base, A is replicated and B split on dim 0
(``gate_up_proj``'s B as ``cat(B_gate_r, B_up_r)``, a GQA B as the layer's q/k/v with its kv
replication); on a row-parallel base (``o_proj``, ``down_proj``), A is split on dim 1 and B
replicated. With ``merge_sharded_lora`` every rank holds the gathered tensors instead.

PEFT has no fused modules: ``qkv_proj``'s one A becomes the A of ``q_proj``, ``k_proj`` and
``v_proj`` (the same tensor thrice: ``x A^T`` is shared, so every ``B_i A`` is unchanged), its B
is split into theirs; ``gate_up_proj`` likewise. Scaling (``lora_alpha / r``, or rsLoRA's) is
PEFT's, so ``lora_alpha`` carries over as it is and ``r`` is the rank of the tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from nxd_finetune.errors import AdapterError, ModelLoadError
from nxd_finetune.lora import LoraConfig
from nxd_finetune.models import DecoderConfig
from nxd_finetune.nxdt.keys import FUSED_TARGETS
from nxd_finetune.nxdt.layout import (
    KvLayout,
    Tensors,
    query_order,
    split_fused_qkv,
    unite_gqa,
    unshuffle_columns,
)

if TYPE_CHECKING:
    from nxd_finetune.nxdt.checkpoint import SavedLoraConfig

_LORA = re.compile(r"^(.*)\.(lora_A|lora_B)\.weight(?:_(q|k|v|qkv))?$")
_ROW = ("o_proj", "down_proj")


def split_base(tensors: Tensors) -> tuple[Tensors, Tensors]:
    """(base tensors under their model names, LoRA tensors) of one rank's file."""
    base: Tensors = {}
    lora: Tensors = {}
    for k, t in tensors.items():
        if _LORA.match(k):
            lora[k] = t
        else:
            base[k.replace(".base_layer.", ".")] = t
    return base, lora


def lora_config_from(saved: SavedLoraConfig | None, tensors: Tensors) -> LoraConfig:
    """PEFT settings from the ``lora_config`` NxD saved (lora_alpha, dropout, bias, rsLoRA, init;
    NxD's default alpha 8 without one) and the rank the tensors have: a saved ``r`` / ``lora_rank``
    that differs describes another adapter (PEFT could not load the tensors under it), and the
    layers' scaling is ``lora_alpha`` over their own rank. AdapterError where the layers' ranks differ."""
    saved = saved or {}
    modules_to_save = saved.get("modules_to_save") or []
    if modules_to_save:
        raise AdapterError(f"the NxD adapter trains whole modules too (modules_to_save={modules_to_save}); "
                           "only LoRA layers are imported")
    ranks = {k.removeprefix("base_model.model.").rsplit(".lora_A", 1)[0]: t.shape[0]
             for k, t in tensors.items() if k.endswith("lora_A.weight")}
    low, high = min(ranks.items(), key=lambda x: x[1]), max(ranks.items(), key=lambda x: x[1])
    if low[1] != high[1]:
        raise AdapterError(f"the NxD adapter's LoRA layers have different ranks ({low[0]}: {low[1]}, {high[0]}: "
                           f"{high[1]}); only adapters of one rank are imported")
    rank = low[1]
    try:
        return LoraConfig(r=int(rank),
                          lora_alpha=float(saved.get("lora_alpha", 8)),
                          lora_dropout=float(saved.get("lora_dropout", 0.0)), bias=str(saved.get("bias", "none")),
                          use_rslora=bool(saved.get("use_rslora", False)),
                          init_lora_weights=str(saved.get("init_lora_weights", "default")).lower(),
                          target_modules=["q_proj"])
    except (TypeError, ValueError) as e:
        raise AdapterError(f"the NxD adapter's lora_config is malformed: {e}") from None


def _merged(parts: Sequence[torch.Tensor], full: int, dim: int) -> bool:
    """Whether the ranks hold the gathered tensor (``merge_sharded_lora``) rather than shards."""
    return len(parts) > 1 and parts[0].shape[dim] == full


def _ranks(parts: Sequence[torch.Tensor], full: int, dim: int, where: str) -> list[torch.Tensor]:
    """Per-rank shards along ``dim`` whether the file holds shards or the gathered tensor."""
    if _merged(parts, full, dim):
        return list(parts[0].chunk(len(parts), dim))
    if sum(t.shape[dim] for t in parts) != full:
        raise ModelLoadError(f"{where}: {len(parts)} shards of {parts[0].shape[dim]} along dim {dim} do not make "
                             f"the layer's {full}")
    return list(parts)


def _replicated(parts: Sequence[torch.Tensor], where: str) -> torch.Tensor:
    if any(not torch.equal(parts[0], t) for t in parts[1:]):
        raise ModelLoadError(f"{where} differs between tensor-parallel ranks; NxD replicates it")
    return parts[0]


def _sizes(config: DecoderConfig) -> dict[str, tuple[int, int]]:
    hd = int(config.head_dim or config.hidden_size // config.num_attention_heads)
    q, kv = config.num_attention_heads * hd, int(config.num_key_value_heads or 0) * hd
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i), "qkv_proj": (q + 2 * kv, h), "gate_up_proj": (2 * i, h),
            "lm_head": (config.vocab_size, h)}


def _gqa_b(b: dict[str, list[torch.Tensor]], config: DecoderConfig, want: KvLayout,
           where: str) -> tuple[Tensors, torch.Tensor]:
    q_rows = _sizes(config)["q_proj"][0]
    if "qkv" in b:
        parts = b["qkv"]
        if len(parts) > 1 and all(torch.equal(parts[0], t) for t in parts[1:]):
            parts = [parts[0]]  # merge_sharded_lora: every rank holds the gathered tensor
        b = dict(zip("qkv", split_fused_qkv(parts, q_rows), strict=True))
    elif len(b["q"]) > 1 and all(torch.equal(b[x][0], t) for x in "qk" for t in b[x][1:]):
        b = {x: [b[x][0]] for x in "qkv"}
    if len(b["q"]) == 1 and b["q"][0].shape[0] != q_rows:
        raise AdapterError(f"{where}: a merged (merge_sharded_lora) GQA adapter holds {b['q'][0].shape[0]} of "
                           f"{q_rows} query rows (NxD keeps one of kv_replicator chunks); save it with "
                           "merge_sharded_lora: false")
    return unite_gqa(b["q"], b["k"], b["v"], config, want, where)


def unite_adapter(shards: dict[tuple[int, int], Tensors], config: DecoderConfig, want: KvLayout = "auto",
                  o_order: Callable[[], torch.Tensor | None] = lambda: None) -> tuple[Tensors, list[str]]:
    """Every rank's LoRA tensors -> (PEFT file keys -> tensors, the HF module names wrapped).
    ``o_order()``: the query order of ``o_proj``'s input (None: HF's order) where no ``qkv_proj``
    adapter of the same layer shows it; it raises where that order cannot be known."""
    tp = 1 + max(t for t, _ in shards)
    pp = 1 + max(p for _, p in shards)
    sizes = _sizes(config)
    hd = int(config.head_dim or config.hidden_size // config.num_attention_heads)
    out: Tensors = {}
    for p in range(pp):
        modules: dict[str, dict[str, list[torch.Tensor]]] = {}
        for t in range(tp):
            for k, tensor in shards[(t, p)].items():
                m = _LORA.match(k)
                if m is None:
                    continue
                key = m.group(2) + (("_" + m.group(3)) if m.group(3) else "")
                modules.setdefault(m.group(1), {}).setdefault(key, []).append(tensor)
        orders: dict[str, torch.Tensor] = {}
        for prefix in sorted(modules, key=lambda x: not x.endswith("qkv_proj")):  # qkv first: o_proj's order
            parts = modules[prefix]
            kind = prefix.rsplit(".", 1)[-1]
            if ".expert_mlps." in prefix:
                raise AdapterError(f"{prefix}: LoRA on NxD's fused expert layers is not imported (NxD's LoRA wraps "
                                   "them as 2-d linear layers; PEFT's LoRA on experts is a different layout)")
            if kind not in sizes:
                raise AdapterError(f"{prefix}: LoRA on {kind!r} is not a layer nxd-finetune's models have")
            if len(parts.get("lora_A", [])) != tp:
                raise ModelLoadError(f"{prefix}: lora_A is missing on some tensor-parallel ranks")
            out_f, in_f = sizes[kind]
            where = f"pp stage {p}: {prefix}"
            if kind in _ROW:
                a = torch.cat(_ranks(parts["lora_A"], in_f, 1, where + ".lora_A"), dim=1)
                parent_name = prefix.rsplit(".", 1)[0]
                order = (orders[parent_name] if parent_name in orders else o_order()) if kind == "o_proj" else None
                if order is not None:
                    a = unshuffle_columns(a, order, hd)
                found = {kind: (a, _replicated(parts["lora_B"], where + ".lora_B"))}
            else:
                a = _replicated(parts["lora_A"], where + ".lora_A")
                if kind == "qkv_proj" and "lora_B" not in parts:
                    b = {x: parts[f"lora_B_{x}"] for x in ("q", "k", "v", "qkv") if f"lora_B_{x}" in parts}
                    bs, order = _gqa_b(b, config, want, where + ".lora_B")
                    orders[prefix.rsplit(".", 1)[0]] = order
                    found = {proj: (a, t) for proj, t in bs.items()}
                else:
                    b_parts = _ranks(parts["lora_B"], out_f, 0, where + ".lora_B")
                    names = FUSED_TARGETS.get(kind, (kind,))
                    found = {name: (a, torch.cat([t.chunk(len(names))[i] for t in b_parts]))
                             for i, name in enumerate(names)}
            parent = prefix.rsplit(".", 1)[0]
            for name, (a_t, b_t) in found.items():
                module = f"{parent}.{name}"
                out[f"base_model.model.{module}.lora_A.weight"] = a_t.clone()
                out[f"base_model.model.{module}.lora_B.weight"] = b_t
    targets = sorted({k[len("base_model.model."):].rsplit(".lora_", 1)[0] for k in out})
    if not targets:
        raise AdapterError("the NxD checkpoint holds no LoRA tensors (lora_A / lora_B)")
    return out, targets


def o_proj_order(config: DecoderConfig, tp: int, m: int | None, want: KvLayout) -> Callable[[], torch.Tensor | None]:
    """``o_order`` for :func:`unite_adapter` where no ``qkv_proj`` adapter shows the layout: the
    query order of a GQA layer with kv_replicator ``m`` (default ``tp / num_key_value_heads``, the
    value NxDT's configs use) and the replication ``want``; with ``auto`` and ``m > 1`` it cannot
    be known (Trn1 and Trn2 differ) and raises AdapterError."""
    kv = int(config.num_key_value_heads or config.num_attention_heads)
    mult = m or max(1, tp // kv)

    def order() -> torch.Tensor | None:
        if mult <= 1 or want == "blocked":
            return None
        if want == "auto":
            raise AdapterError(f"o_proj's LoRA A follows NxD's query-head order, which depends on how the {mult}x "
                               "KV replication was laid out (Trn1 or Trn2); no qkv_proj adapter shows it: pass "
                               "--kv-layout interleaved (Trn1) or blocked (Trn2)")
        return query_order(config.num_attention_heads, kv, mult, want)

    return order

"""NxD's sharded parameters -> HF's full tensors, as NxD's ``checkpoint_converter.py`` lays them out.

Names: NxD's HF Llama keeps HF's names except the fused layers. Per tensor-parallel rank ``r`` of
``tp``:

- ``self_attn.qkv_proj.weight_q`` / ``weight_k`` / ``weight_v`` (``GQAQKVColumnParallelLinear``,
  ``qkv_linear: true``), or one ``weight_qkv`` = ``cat(q_r, k_r, v_r)`` (``fuse_qkv: true``);
- ``self_attn.qkv_proj.weight`` (MHA, ``fuse_qkv`` without ``qkv_linear``) = ``cat(q_r, k_r, v_r)``;
- ``mlp.gate_up_proj.weight`` = ``cat(gate_r, up_r)``;
- column-parallel (``q/k/v_proj``, ``embed_tokens``, ``lm_head``) split on dim 0, row-parallel
  (``o_proj``, ``down_proj``) on dim 1, everything else (norms) replicated on every rank.

KV replication (``kv_replicator`` = ``kv_size_multiplier`` = m): the K/V heads are repeated to
``kv * m`` *slots* before the split over tp, ``repeat`` on Trn1 (``K0..K{kv-1}, K0..``: interleaved)
and ``repeat_interleave`` on Trn2 (``K0,K0,..,K1,..``: blocked) (``modules/qkv_linear.py``). Slot
``j`` stands for KV head ``h`` and copy ``c`` (interleaved: ``h = j % kv, c = j // kv``; blocked:
``h = j // m, c = j % m``) and is given ``q / (kv*m)`` consecutive query heads of ``h``'s group,
``h*g + c*q/(kv*m) + i`` (g = q/kv). The converter's query-head shuffle is this order; ``o_proj``'s
input columns follow the query heads. Pipeline stages hold disjoint names (layers keep their global
index), so stages are united by name. A mixture-of-experts layer's router and fused experts are
:mod:`nxd_finetune.nxdt.experts`'.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

import torch

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.models import DecoderConfig, build_model
from nxd_finetune.nxdt.experts import is_router, moe_name, unite_experts

KvLayout = Literal["auto", "interleaved", "blocked"]
Tensors = dict[str, torch.Tensor]

_GQA = re.compile(r"^(.*)\.qkv_proj\.weight_(q|k|v|qkv)$")
_ROW = ("o_proj.weight", "down_proj.weight")
_COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
           "embed_tokens.weight", "lm_head.weight")
_SKIP = ("rotary_emb.inv_freq",)


def kv_slots(config: DecoderConfig, kv_rows: int, head_dim: int, where: str) -> tuple[int, int]:
    """(slots, m): the replicated KV head count and the multiplier, from the rows of K over all ranks."""
    kv = int(config.num_key_value_heads or config.num_attention_heads)
    slots, rem = divmod(kv_rows, head_dim)
    if rem or slots % kv:
        raise ModelLoadError(f"{where}: {kv_rows} rows of K over all ranks are not a multiple of "
                             f"num_key_value_heads*head_dim={kv}*{head_dim}")
    return slots, slots // kv


def detect_layout(k_all: torch.Tensor, v_all: torch.Tensor, kv: int, m: int, head_dim: int, want: KvLayout,
                  where: str) -> Literal["interleaved", "blocked"]:
    """Which replication the K/V copies follow (every copy of a head is the same, bit for bit,
    since NxD sums their gradients over the kv group). ``want`` decides when both fit (m = 1, or
    heads that are equal); ``auto`` then takes interleaved only where the query order agrees."""
    if m == 1:
        return "interleaved"  # one copy: both layouts are the identity
    fits = []
    for layout in ("interleaved", "blocked"):
        src = [j % kv if layout == "interleaved" else (j // m) * m for j in range(kv * m)]
        ok = all(torch.equal(t.view(kv * m, head_dim, -1)[j], t.view(kv * m, head_dim, -1)[s])
                 for t in (k_all, v_all) for j, s in enumerate(src))
        if ok:
            fits.append(layout)
    if want != "auto":
        if want not in fits:
            raise ModelLoadError(f"{where}: the K/V copies do not follow the {want} replication")
        return want
    if not fits:
        raise ModelLoadError(f"{where}: the {m} copies of each K/V head differ; not an NxD kv-replicated layer")
    if len(fits) == 2:
        raise ModelLoadError(f"{where}: the K/V heads are equal, so the replication (Trn1 interleaved or Trn2 "
                             "blocked) cannot be read from the weights; pass --kv-layout interleaved|blocked")
    return fits[0]  # type: ignore[return-value]


def query_order(q_heads: int, kv: int, m: int, layout: str) -> torch.Tensor:
    """HF query-head index of each query head in NxD's rank-concatenated order."""
    g, per_slot = q_heads // kv, q_heads // (kv * m)
    order = []
    for j in range(kv * m):
        h, c = (j % kv, j // kv) if layout == "interleaved" else (j // m, j % m)
        order += [h * g + c * per_slot + i for i in range(per_slot)]
    return torch.tensor(order)


def unshuffle_rows(t: torch.Tensor, order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows grouped by query head (``[q*hd, X]``) put back in HF's head order."""
    heads = t.reshape(len(order), head_dim, -1)
    out = torch.empty_like(heads)
    out[order] = heads
    return out.reshape(t.shape)


def unshuffle_columns(t: torch.Tensor, order: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``o_proj``'s columns (``[H, q*hd]``) put back in HF's head order."""
    heads = t.reshape(t.shape[0], len(order), head_dim)
    out = torch.empty_like(heads)
    out[:, order] = heads
    return out.reshape(t.shape)


def split_fused_qkv(parts: Sequence[torch.Tensor], q_rows: int) -> tuple[list[torch.Tensor], ...]:
    """Per-rank ``weight_qkv`` (``cat(q_r, k_r, v_r)``) -> per-rank (q, k, v); ``q_rows``: all ranks'."""
    qs, ks, vs = [], [], []
    q_local = q_rows // len(parts)
    for t in parts:
        kv_local, rem = divmod(t.shape[0] - q_local, 2)
        if rem or kv_local <= 0:
            raise ModelLoadError(f"a fused qkv shard of {t.shape[0]} rows does not hold {q_local} query rows + 2 "
                                 "equal K/V parts")
        q, k, v = torch.split(t, [q_local, kv_local, kv_local])
        qs.append(q)
        ks.append(k)
        vs.append(v)
    return qs, ks, vs


def unite_gqa(q_parts: Sequence[torch.Tensor], k_parts: Sequence[torch.Tensor], v_parts: Sequence[torch.Tensor],
              config: DecoderConfig, want: KvLayout, where: str) -> tuple[Tensors, torch.Tensor]:
    """One GQA qkv layer's per-rank q/k/v (rows of heads) -> HF's q/k/v and the query order
    (for ``o_proj``, or a LoRA B of this layer)."""
    hd = int(config.head_dim or config.hidden_size // config.num_attention_heads)
    kv, q_heads = int(config.num_key_value_heads or config.num_attention_heads), config.num_attention_heads
    k_all, v_all, q_all = torch.cat(list(k_parts)), torch.cat(list(v_parts)), torch.cat(list(q_parts))
    if q_all.shape[0] != q_heads * hd:
        raise ModelLoadError(f"{where}: {q_all.shape[0]} query rows over all ranks, the config has "
                             f"num_attention_heads*head_dim={q_heads}*{hd}")
    _, m = kv_slots(config, k_all.shape[0], hd, where)
    layout = detect_layout(k_all, v_all, kv, m, hd, want, where)
    order = query_order(q_heads, kv, m, layout)
    pick = torch.arange(kv) if layout == "interleaved" else torch.arange(kv) * m  # the first copy of each head

    def first_copies(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(kv * m, hd, -1)[pick].reshape(kv * hd, -1).clone()

    return {"q_proj": unshuffle_rows(q_all, order, hd), "k_proj": first_copies(k_all),
            "v_proj": first_copies(v_all)}, order


def _equal_replicas(name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    if any(not torch.equal(parts[0], t) for t in parts[1:]):
        raise ModelLoadError(f"{name} differs between tensor-parallel ranks; NxD replicates it on every rank")
    return parts[0]


def unite_stage(parts: Sequence[Tensors], config: DecoderConfig, want: KvLayout, where: str) -> Tensors:
    """One pipeline stage's tp shards -> its tensors under HF names."""
    names = list(parts[0])
    for r, p in enumerate(parts[1:], 1):
        if set(p) != set(names):
            diff = sorted(set(p) ^ set(names))[0]
            raise ModelLoadError(f"{where}: tp ranks 0 and {r} hold different tensors (e.g. {diff})")
    out: Tensors = {}
    gqa: dict[str, dict[str, list[torch.Tensor]]] = {}
    hd = int(config.head_dim or config.hidden_size // config.num_attention_heads)
    for name in names:
        shards = [p[name] for p in parts]
        m = _GQA.match(name)
        if name.endswith(_SKIP):
            continue
        if m:
            gqa.setdefault(m.group(1), {})[m.group(2)] = shards
        elif (hf := moe_name(name)) is not None:  # before _ROW: the experts' down_proj.weight ends alike
            out[hf] = _equal_replicas(name, shards) if is_router(name) else unite_experts(name, shards)
        elif name.endswith("self_attn.qkv_proj.weight"):  # MHA: cat(q_r, k_r, v_r) on every rank
            prefix = name[: -len("qkv_proj.weight")]
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{prefix}{proj}.weight"] = torch.cat([t.chunk(3)[i] for t in shards])
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name[: -len("gate_up_proj.weight")]
            out[prefix + "gate_proj.weight"] = torch.cat([t.chunk(2)[0] for t in shards])
            out[prefix + "up_proj.weight"] = torch.cat([t.chunk(2)[1] for t in shards])
        elif name.endswith(_COLUMN):
            out[name] = torch.cat(shards)
        elif name.endswith(_ROW):
            out[name] = torch.cat(shards, dim=1)
        else:
            out[name] = _equal_replicas(name, shards)
    for prefix, qkv in gqa.items():
        if "qkv" in qkv:
            q_rows = config.num_attention_heads * hd
            qkv["q"], qkv["k"], qkv["v"] = split_fused_qkv(qkv.pop("qkv"), q_rows)
        if set(qkv) != {"q", "k", "v"}:
            raise ModelLoadError(f"{prefix}.qkv_proj has {sorted(qkv)} but needs weight_q, weight_k and weight_v")
        full, order = unite_gqa(qkv["q"], qkv["k"], qkv["v"], config, want, f"{where}: {prefix}")
        for proj, t in full.items():
            out[f"{prefix}.{proj}.weight"] = t
        o_name = f"{prefix}.o_proj.weight"
        if o_name in out:
            out[o_name] = unshuffle_columns(out[o_name], order, hd)
    return out


def unite_model(shards: dict[tuple[int, int], Tensors], config: DecoderConfig, want: KvLayout = "auto") -> Tensors:
    """Every (tp, pp) rank's NxD tensors -> the HF checkpoint's tensors, checked against the
    model the config defines (names and shapes). Raises ModelLoadError."""
    tp = 1 + max(t for t, _ in shards)
    pp = 1 + max(p for _, p in shards)
    embed = next((t for k, t in shards[(0, 0)].items() if k.endswith("embed_tokens.weight")), None)
    if embed is not None and embed.shape[0] * tp != config.vocab_size:
        raise ModelLoadError(f"embed_tokens is split in {config.vocab_size / embed.shape[0]:g} parts but {tp} "
                             "tensor-parallel rank file(s) are there: shard files are missing or from another model")
    out: Tensors = {}
    for p in range(pp):
        stage = unite_stage([shards[(t, p)] for t in range(tp)], config, want, f"pp stage {p}")
        clash = sorted(set(stage) & set(out))
        if clash:
            raise ModelLoadError(f"{clash[0]} is held by more than one pipeline stage")
        out.update(stage)
    check_names(out, config)
    return out


def check_names(tensors: Tensors, config: DecoderConfig) -> None:
    """The tensors are exactly the model's (lm_head optional when tied), each of its shape."""
    expected = {k: tuple(v.shape) for k, v in build_model(config, "meta").state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = f"misses {missing[0]}" if missing else f"has {extra[0]}, which the model has not"
        raise ModelLoadError(f"the NxD checkpoint does not fit the model config: it {what} "
                             f"({len(missing)} missing, {len(extra)} unexpected)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelLoadError(f"{name}: united to {tuple(tensors[name].shape)}, the model config needs {shape}")

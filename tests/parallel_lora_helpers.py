"""The tensor-parallel LoRA harness of ``test_parallel_lora`` (and ``test_dora``): a PEFT adapter
for a tiny ``transformers`` model, and the worker that builds the sharded model the way training does
and compares it with the unsharded model holding the same adapter (see ``test_parallel_lora``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import peft
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

from nxd_finetune.lora import (
    ColumnParallelLoraLinear,
    LoraConfig,
    RowParallelLoraLinear,
    adapter_state_dict,
    base_param_name,
    gather_adapter_state_dict,
    inject_lora,
    load_adapter,
    lora_modules,
    read_adapter,
    save_adapter,
    trainable_parameters,
)
from nxd_finetune.lora.dora import ColumnParallelDoraLinear, RowParallelDoraLinear
from nxd_finetune.loss import vocab_parallel_cross_entropy
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, materialize
from nxd_finetune.parallel import (
    Layout,
    ParallelState,
    allreduce_replicated_grads,
    apply_tp_plan,
    gather_full,
    iter_placements,
    make_slice_reader,
    tp_plan_for,
)
from nxd_finetune.parallel.mappings import all_gather

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
LABELS = torch.where(torch.arange(8) < 3, -100, IDS)
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def hf_load(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def peft_adapter(base: Path, out: Path, **kw) -> torch.Tensor:
    """Write a PEFT adapter (all-linear, every trainable tensor random) for ``base``; its logits."""
    pm = peft.get_peft_model(
        hf_load(base), peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=16, target_modules="all-linear", **kw)
    ).eval()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        logits = pm(IDS).logits
    pm.save_pretrained(out)
    return logits


# ----------------------------------------------------------------------------- worker


def _ref_model(base: str, cfg: LoraConfig, adapter: str) -> nn.Module:
    ref = load_pretrained(base)
    inject_lora(ref, cfg)
    load_adapter(ref, adapter, inject=False)
    return ref


def _tp_model(base: str, cfg: LoraConfig, adapter: str, state: ParallelState, sp: bool) -> nn.Module:
    config = DecoderConfig.from_hf(base)
    model = apply_tp_plan(build_model(config), tp_plan_for(config), state, sequence_parallel=sp)
    inject_lora(model, cfg)
    materialize(model, base, reader=make_slice_reader(model), name_map=base_param_name)
    load_adapter(model, adapter, inject=False)  # PEFT's file, this rank's slices
    return model


def _forward_backward(model: nn.Module, group, seed: int) -> torch.Tensor:
    """Full-vocab logits (gathered) after backward of the mean next-token loss."""
    torch.manual_seed(seed)  # dropout masks
    logits = model(IDS)
    n_valid = (LABELS[:, 1:] != -100).sum()
    if group is None:
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), LABELS[:, 1:].reshape(-1))
    else:
        loss = vocab_parallel_cross_entropy(logits[:, :-1], LABELS[:, 1:], group).sum() / n_valid
    loss.backward()
    return logits.detach() if group is None else all_gather(logits.detach(), -1, group)


def _grad_checks(tag, model, ref, state, differ: list[str], out: dict) -> None:
    specs = {name: spec for name, _, _, spec in iter_placements(model)}
    for name in differ:  # the local partial sums before the sync
        local_ref = specs[name].take(ref.get_parameter(name).grad)
        out[f"{tag} {name} grad before sync"] = ("differ", model.get_parameter(name).grad.clone(), local_ref)
    allreduce_replicated_grads(model, state)
    names = [n for n, _ in trainable_parameters(model)]
    assert names == [n for n, _ in trainable_parameters(ref)] and any(".lora_A." in n for n in names)
    for name, p in trainable_parameters(model):
        full = gather_full(p.grad, specs[name], state) if name in specs else p.grad
        out[f"{tag} grad {name}"] = ("close", full, ref.get_parameter(name).grad)


def _merge_checks(tag, model, ref_logits, state, out: dict) -> None:
    """Each rank merges its slice: same logits; unmerge restores the base shards."""
    weights = {n: m.base_layer.weight.detach().clone() for n, m in lora_modules(model)}
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.merge()
        merged = all_gather(model(IDS), -1, state.group("tp"))
        for _, m in lora_modules(model):
            m.unmerge()
    out[f"{tag} merged logits"] = ("close", merged, ref_logits)
    for n, m in lora_modules(model):
        out[f"{tag} unmerged {n}"] = ("close", m.base_layer.weight.detach(), weights[n])


def lora_worker(rank: int, world: int, tp: int, variants: list, save_dir: str) -> dict:
    """``variants``: (label, HF dir, PEFT adapter dir, sequence-parallel settings, dropout check)."""
    state = ParallelState(Layout.for_world(world, tp=tp))
    g, out = state.group("tp"), {}
    for label, base, adapter, sp_settings, with_dropout in variants:
        cfg = read_adapter(adapter)[0]
        ref = _ref_model(base, cfg, adapter)
        ref_logits = _forward_backward(ref, None, 0)
        for sp in sp_settings:
            tag = f"{label} tp={tp} sp={sp}"
            model = _tp_model(base, cfg, adapter, state, sp)
            layers = ({ColumnParallelDoraLinear, RowParallelDoraLinear} if cfg.use_dora
                      else {ColumnParallelLoraLinear, RowParallelLoraLinear})
            assert {type(m) for _, m in lora_modules(model)} == layers
            out[f"{tag} logits"] = ("close", _forward_backward(model, g, 0), ref_logits)
            differ = ["model.layers.0.self_attn.q_proj.lora_A.weight"]  # column A: partial over TP
            if sp:
                differ.append("model.layers.1.mlp.down_proj.lora_B.weight")  # row B: partial over sequence
            if tp > DecoderConfig.from_hf(base).num_key_value_heads:
                differ.append("model.layers.1.self_attn.k_proj.lora_B.weight")  # partial over KV replicas
            _grad_checks(tag, model, ref, state, differ, out)
            full = gather_adapter_state_dict(model, state, cfg.bias)
            expected = adapter_state_dict(ref, cfg.bias)
            assert list(full) == list(expected)
            for key, t in full.items():
                out[f"{tag} export {key}"] = ("close", t, expected[key])
            _merge_checks(tag, model, ref_logits, state, out)
            if not sp:  # the files: tp run (written by TP rank 0) and tp=1 run
                tp_dir = Path(save_dir, f"{label}-tp")
                save_adapter(model, cfg, tp_dir, base_model_name_or_path=base, state=state)
                if rank == 0:
                    save_adapter(ref, cfg, Path(save_dir, f"{label}-tp1"), base_model_name_or_path=base)
        if with_dropout:  # same RNG state -> the unsharded layer's masks, sharded inputs too
            drop = dataclasses.replace(cfg, lora_dropout=0.3)
            ref_d = _ref_model(base, drop, adapter)
            ref_d_logits = _forward_backward(ref_d, None, 7)
            out[f"{label} dropout changes logits"] = ("differ", ref_d_logits, ref_logits)
            for sp in sp_settings:
                tag = f"{label} tp={tp} sp={sp} dropout"
                model = _tp_model(base, drop, adapter, state, sp)
                out[f"{tag} logits"] = ("close", _forward_backward(model, g, 7), ref_d_logits)
                _grad_checks(tag, model, ref_d, state, [], out)
    return out


def n_checks(adapter: Path, n_differ: dict[bool, int], dropout: bool) -> int:
    """Checks per rank of one variant: per sequence-parallel setting logits, merged logits, the
    "differ" checks, a gradient and an export check per adapter tensor, an unmerge check per
    LoRA layer; with dropout one more, then logits and gradients per setting."""
    keys = list(load_file(adapter / WEIGHTS))
    n_lora = sum(k.endswith(".lora_A.weight") for k in keys)
    total = sum(2 + d + 2 * len(keys) + n_lora for d in n_differ.values())
    return total + (1 + len(n_differ) * (1 + len(keys)) if dropout else 0)

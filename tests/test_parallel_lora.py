"""LoRA on tensor-parallel bases against the unsharded LoRA model and the ``peft`` oracle (gloo, CPU).

The adapters are written by ``peft`` (all-linear, random non-zero B) for tiny ``transformers``
models. Each worker builds the sharded model the way training does (meta -> ``apply_tp_plan`` ->
``inject_lora`` -> ``materialize`` with the slice reader -> ``load_adapter`` reading slices) and
compares with the unsharded model holding the same adapter: logits, every trainable gradient
(after ``allreduce_replicated_grads``, gathered), the exported adapter, merge/unmerge. "differ"
checks show the gradients before the TP sync are wrong, so the sync is what makes them match.
The harness (fork + gloo, checks returned through files) is the one of ``test_parallel_layers``; the
worker is in ``parallel_lora_helpers``.
"""

from __future__ import annotations

import json
import types

import peft
import pytest
import torch
from gloo_world import assert_checks, run_world
from parallel_lora_helpers import CONFIG, IDS, WEIGHTS, hf_load, lora_worker, n_checks, peft_adapter
from safetensors.torch import load_file
from torch import nn

from nxd_finetune.errors import AdapterError
from nxd_finetune.lora import (
    ColumnParallelLoraLinear,
    LoraConfig,
    LoraLinear,
    RowParallelLoraLinear,
    base_param_name,
    inject_lora,
    load_adapter,
    save_adapter,
)
from nxd_finetune.models import DecoderConfig, build_model, materialize
from nxd_finetune.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    make_slice_reader,
)

pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path


# ----------------------------------------------------------------------------- tests


def test_tp2_lora_matches_unsharded_and_peft_files(make_tiny_hf, tmp_path):
    """tp=2 with and without sequence parallel, dropout, lm_head in modules_to_save; the exported
    file is the tp=1 file byte for byte and PEFT loads it."""
    _, base = make_tiny_hf("llama")
    peft_logits = peft_adapter(base, tmp_path / "peft", modules_to_save=["lm_head"])
    variants = [("llama", str(base), str(tmp_path / "peft"), (False, True), True)]
    results = run_world(lora_worker, 2, tmp_path, 2, variants, str(tmp_path / "saved"))
    assert assert_checks(results) == 2 * n_checks(tmp_path / "peft", {False: 1, True: 2}, dropout=True)
    for sp in (False, True):
        torch.testing.assert_close(results[0][f"llama tp=2 sp={sp} logits"][1], peft_logits, atol=1e-5, rtol=1e-5)

    tp2, tp1 = tmp_path / "saved" / "llama-tp", tmp_path / "saved" / "llama-tp1"
    assert sorted(p.name for p in tp2.iterdir()) == [CONFIG, WEIGHTS]
    assert (tp2 / WEIGHTS).read_bytes() == (tp1 / WEIGHTS).read_bytes()
    assert json.loads((tp2 / CONFIG).read_text()) == json.loads((tp1 / CONFIG).read_text())
    theirs = load_file(tmp_path / "peft" / WEIGHTS)
    assert {k: v.shape for k, v in load_file(tp2 / WEIGHTS).items()} == {k: v.shape for k, v in theirs.items()}
    with torch.no_grad():
        reloaded = peft.PeftModel.from_pretrained(hf_load(base), tp2).eval()(IDS).logits
    torch.testing.assert_close(reloaded, peft_logits, atol=1e-5, rtol=1e-5)


def test_tp4_kv_replicated_lora_matches_unsharded_and_peft(make_tiny_hf, tmp_path):
    """Qwen2 (q/k/v bias, 4 heads, 2 KV heads -> each KV head on 2 ranks), trained biases."""
    _, base = make_tiny_hf("qwen2")
    peft_logits = peft_adapter(base, tmp_path / "peft", bias="lora_only")
    variants = [("qwen2", str(base), str(tmp_path / "peft"), (False, True), False)]
    results = run_world(lora_worker, 4, tmp_path, 4, variants, str(tmp_path / "saved"))
    assert assert_checks(results) == 4 * n_checks(tmp_path / "peft", {False: 2, True: 3}, dropout=False)
    for sp in (False, True):
        torch.testing.assert_close(results[0][f"qwen2 tp=4 sp={sp} logits"][1], peft_logits, atol=1e-5, rtol=1e-5)
    tp4, tp1 = tmp_path / "saved" / "qwen2-tp", tmp_path / "saved" / "qwen2-tp1"
    assert (tp4 / WEIGHTS).read_bytes() == (tp1 / WEIGHTS).read_bytes()


# ----------------------------------------------------------------------------- single process


def test_sharded_layers_at_tp1_are_lora_linear_bit_for_bit():
    """Same init (same RNG draws), same dropout masks, same output and merge as LoraLinear."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 8))
    par = nn.Sequential(
        ColumnParallelLinear.from_linear(ref[0], None),
        RowParallelLinear.from_linear(ref[1], None, input_is_parallel=True),
    )
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", lora_dropout=0.3)
    for model in (ref, par):
        torch.manual_seed(1)
        inject_lora(model, cfg)
        torch.nn.init.normal_(model[0].lora_B.weight, generator=torch.Generator().manual_seed(3))
        torch.nn.init.normal_(model[1].lora_B.weight, generator=torch.Generator().manual_seed(4))
    assert [type(m) for m in par] == [ColumnParallelLoraLinear, RowParallelLoraLinear]
    assert all(type(m) is LoraLinear for m in ref)
    for (name, a), (_, b) in zip(ref.named_parameters(), par.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    x = torch.randn(3, 4, 8)
    outs = []
    for model in (ref, par):
        torch.manual_seed(5)
        outs.append(model(x))
    assert torch.equal(*outs)
    for model in (ref, par):
        model.eval()
        for layer in model:
            layer.merge()
    assert torch.equal(ref(x), par(x))
    assert par[1].lora_A.placements["weight"].full_shape == (2, 12)


def test_load_errors_name_full_shapes_and_tp_save_refusals(make_tiny_hf, tmp_path):
    _, base = make_tiny_hf("llama")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    model = build_model(DecoderConfig.from_hf(base))
    model.model.layers["0"].self_attn.q_proj = ColumnParallelLinear(64, 64, False, group=None, device="meta")
    inject_lora(model, cfg)
    materialize(model, base, reader=make_slice_reader(model), name_map=base_param_name)
    save_adapter(model, cfg, tmp_path / "a", base_model_name_or_path=None)
    bad = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])  # same scaling, other rank
    other = build_model(DecoderConfig.from_hf(base))
    inject_lora(other, bad)
    save_adapter(other, bad, tmp_path / "bad", base_model_name_or_path=None)
    with pytest.raises(AdapterError, match=r"q_proj.lora_A.weight' has shape \(2, 64\), the model expects \(4, 64\)"):
        load_adapter(model, tmp_path / "bad", inject=False)
    pp = types.SimpleNamespace(size={"pp": 2, "tp": 1, "dp": 1}.__getitem__, coord=lambda axis: 0)
    with pytest.raises(AdapterError, match="pipeline parallel: union the stages"):
        save_adapter(model, cfg, tmp_path / "pp", None, state=pp)
    assert not (tmp_path / "pp").exists()

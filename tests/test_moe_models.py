"""Mixture-of-experts models (Qwen3-MoE, Mixtral; nxd_finetune/models/moe.py) against transformers:
logits and the router auxiliary loss of the eager model loaded from the same checkpoint, packed rows,
the grouped-GEMM experts against the per-expert loop (values and gradients), the checkpoint keys
transformers writes, one-line refusals (gpt-oss, layouts other than one process), and single-process
full and LoRA fine-tuning runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from nxd_finetune.errors import AdapterError, ModelLoadError, NxdError, RecipeError
from nxd_finetune.lora import LoraConfig, inject_lora, load_adapter
from nxd_finetune.models import DecoderConfig, load_pretrained, save_pretrained
from nxd_finetune.models.moe import (
    Experts,
    SparseMoeBlock,
    load_balancing_loss,
    moe_blocks,
    record_router_logits,
    router_aux_loss,
    set_expert_kernel,
)
from nxd_finetune.preflight.model import check_weights
from nxd_finetune.recipe import check_against_model, load_recipe
from tests.moe_helpers import QUICKSTART, build_tiny_moe, moe_with_tokenizer, tiny_moe_config  # noqa: F401  (a fixture)
from tests.moe_helpers import train as _train

CASES = {
    "qwen3_moe": ("qwen3_moe", {}),  # top-2 of 6 renormalised, layer 1 dense (mlp_only_layers)
    "qwen3_moe-step": ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 2,
                                     "num_hidden_layers": 3}),  # layer 1 sparse, 0 and 2 dense; no renormalising
    "mixtral": ("mixtral", {}),
    "mixtral-top1": ("mixtral", {"num_experts_per_tok": 1}),
}


@pytest.fixture
def make_moe(tmp_path):
    def make(name: str, seed: int = 0) -> tuple[torch.nn.Module, Path]:
        family, overrides = CASES[name]
        path = tmp_path / f"hf-{name}-{seed}"
        return build_tiny_moe(tiny_moe_config(family, **overrides), path, seed), path

    return make


def _ids(b: int = 2, t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def _ours(path: Path, ids: torch.Tensor, **kw: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    model = load_pretrained(path).eval()
    with torch.no_grad(), record_router_logits(model) as logits:
        out = model(ids, **kw)
    return out, logits


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_aux_loss_equal_transformers(make_moe, name):
    hf, path = make_moe(name)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    ours = load_pretrained(path).eval()
    moe_layers = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [b.index for b in moe_blocks(ours)] == moe_layers and moe_layers
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding: left out of the auxiliary loss
    with torch.no_grad(), record_router_logits(ours) as logits:
        got = ours(ids)
        ref = hf(ids, output_router_logits=True)
        ref_masked = hf(ids, attention_mask=mask, output_router_logits=True)
    assert (got - ref.logits).abs().max() <= 1e-5
    assert sorted(logits) == moe_layers
    for i, layer in enumerate(moe_layers):
        assert torch.allclose(logits[layer], ref.router_logits[i], atol=1e-5)
    torch.testing.assert_close(router_aux_loss(ours, logits), ref.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(router_aux_loss(ours, logits, mask), ref_masked.aux_loss, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_packed_rows_equal_separate_rows(make_moe, name):
    """Three samples packed in one row: each sample's logits as alone, and the auxiliary loss of the
    packed row is transformers' over the samples as a padded batch (padding masked)."""
    hf, path = make_moe(name)
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(0, 128, (n,), generator=g) for n in (7, 12, 5)]
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    seg = torch.cat([torch.full((len(s),), i + 1) for i, s in enumerate(samples)])[None]
    packed, logits = _ours(path, ids, position_ids=pos, segment_ids=seg)
    model = load_pretrained(path).eval()
    with torch.no_grad():
        alone = torch.cat([model(s[None])[0] for s in samples])
    assert (packed[0] - alone).abs().max() <= 1e-5
    padded = torch.zeros(len(samples), 12, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, s in enumerate(samples):
        padded[i, :len(s)], mask[i, :len(s)] = s, 1
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(padded, attention_mask=mask, output_router_logits=True).aux_loss
    torch.testing.assert_close(router_aux_loss(model, logits), ref, rtol=1e-6, atol=0)


def test_aux_loss_refuses_layers_routed_over_other_tokens(make_moe):
    """With ``logits_index`` the last layer routes the kept positions only: no auxiliary loss then."""
    assert load_balancing_loss([torch.zeros(3, 6)], 6, 2).item() == pytest.approx(2.0)  # uniform: k
    _, path = make_moe("mixtral")
    _, logits = _ours(path, _ids(), logits_index=torch.tensor([3, 5, 30]))
    with pytest.raises(NxdError, match=r"^router logits cover different token counts per layer \(\[3, 48\]\): run "
                                       "the forward without logits_index$"):
        router_aux_loss(load_pretrained(path), logits)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_grouped_gemm_equals_the_loop_with_gradients(make_moe, name):
    _, path = make_moe(name)
    ids = _ids()
    grads = {}
    for kernel in ("grouped", "loop"):
        model = load_pretrained(path).train()
        set_expert_kernel(model, kernel)
        out = model(ids)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(4))).sum().backward()
        grads[kernel] = (out.detach(), {n: p.grad for n, p in model.named_parameters()})
    (out_g, grad_g), (out_l, grad_l) = grads["grouped"], grads["loop"]
    assert (out_g - out_l).abs().max() <= 1e-5
    assert any("experts" in n for n in grad_g) and grad_g.keys() == grad_l.keys()
    for n in grad_g:
        assert grad_g[n] is not None and torch.allclose(grad_g[n], grad_l[n], atol=1e-5), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_with_idle_experts_and_no_tokens(dtype):
    """An expert no token picks, and a block given no tokens at all (a last layer kept nothing)."""
    config = DecoderConfig.from_hf(tiny_moe_config("mixtral").to_dict())
    torch.manual_seed(0)
    experts = Experts(config).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    x = torch.randn(5, 64, dtype=dtype, requires_grad=True)
    index = torch.tensor([[0, 2], [2, 0], [3, 0], [0, 3], [2, 3]])  # expert 1 idle
    weights = torch.rand(5, 2)
    out = {}
    for kernel in ("grouped", "loop"):
        experts.kernel = kernel
        y = experts(x, index, weights)
        y.sum().backward()  # an expanded gradient (strides 0), which torch._grouped_mm's backward refuses
        out[kernel] = (y.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
        x.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(out["grouped"], out["loop"], strict=True):
        assert torch.allclose(a.float(), b.float(), atol=tol)
    assert out["grouped"][2][1].abs().max() == 0  # the idle expert gets no gradient
    block = SparseMoeBlock(config, 0)
    assert block(torch.zeros(0, 64)).shape == (0, 64)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_checkpoints_in_transformers_keys_and_fused_ones(make_moe, tmp_path, name):
    """What we save has the keys and tensors transformers writes (one tensor per expert; Mixtral's
    ``block_sparse_moe``), and transformers loads it with our logits; a checkpoint of fused tensors
    under the module names loads as well."""
    _, path = make_moe(name)
    ours = load_pretrained(path).eval()
    save_pretrained(ours.config, ours.state_dict().items(), tmp_path / "saved")
    saved = tmp_path / "saved" / "model.safetensors"
    with safe_open(path / "model.safetensors", "pt") as a, safe_open(saved, "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, str(fused / "model.safetensors"))
    shutil.copy(path / "config.json", fused / "config.json")
    ids = _ids()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager").eval()
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() <= 1e-5
        assert torch.equal(load_pretrained(fused).eval()(ids), ours(ids))


def test_validate_checks_each_expert_tensor(make_moe, tmp_path):
    _, path = make_moe("mixtral")
    model = load_pretrained(path)
    check_weights(model, model.config, path)
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(path / "config.json", bad / "config.json")
    tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"] = torch.zeros(64, 95)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"tensor model.layers.1.block_sparse_moe.experts.3.w2.weight has shape "
                                             r"\[64, 95\], the config implies \[64, 96\]"):
        check_weights(model, model.config, bad)
    with pytest.raises(ModelLoadError, match="differ in shape"):
        load_pretrained(bad)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lacks model.layers.1.block_sparse_moe.experts.3.w2.weight"):
        check_weights(model, model.config, bad)
    with pytest.raises(ModelLoadError, match="is missing tensor 'model.layers.1.mlp.experts.down_proj'"):
        load_pretrained(bad)


def test_gpt_oss_is_refused_in_one_line():
    with pytest.raises(ModelLoadError) as e:
        DecoderConfig.from_hf({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"})
    assert str(e.value).startswith("GptOssForCausalLM is not supported: its attention sinks")
    assert "\n" not in str(e.value)


def test_lora_targets_peft_reads_as_experts_are_refused(make_moe):
    _, path = make_moe("qwen3_moe")  # layer 1 is dense: its mlp.gate_proj is an nn.Linear
    model = load_pretrained(path)
    with pytest.raises(AdapterError, match=r"^lora target model.layers.1.mlp.gate_proj: on a mixture-of-experts model "
                                           r"PEFT reads target_modules 'gate_proj' as the experts' fused tensors"):
        inject_lora(model, LoraConfig(r=2, target_modules=["q_proj", "gate_proj"]))
    assert {n.rpartition(".")[2] for n in inject_lora(model, LoraConfig(r=2, target_modules="all-linear"))} == {
        "q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize("layout", [["parallel.nproc=2"], ["parallel.nproc=2", "parallel.tp=2"],
                                    ["parallel.nproc=2", "parallel.pp=2"], ["parallel.nproc=2", "parallel.ep=2"]])
def test_every_layout_but_sequence_parallel_takes_a_moe_model(layout):
    """tests/test_moe_expert_parallel.py trains them; ep needs experts, sequence parallel is refused."""
    recipe = load_recipe(QUICKSTART, layout)
    config = DecoderConfig.from_hf(tiny_moe_config("mixtral").to_dict())
    check_against_model(recipe, config)
    dense = DecoderConfig.from_hf(tiny_moe_config("qwen3_moe", num_experts=0).to_dict())
    if "parallel.ep=2" in layout:
        with pytest.raises(RecipeError, match=r"^parallel.ep=2 splits the experts of a mixture-of-experts model; this "
                                              r"model has none \(set parallel.ep=1\)$"):
            check_against_model(recipe, dense)
    else:
        check_against_model(recipe, dense)
    sp = load_recipe(QUICKSTART, ["parallel.nproc=2", "parallel.tp=2", "parallel.sequence_parallel=true"])
    with pytest.raises(RecipeError, match=r"^parallel.sequence_parallel on a mixture-of-experts model \(4 experts\) "
                                          r"is not supported: its router and experts run on whole rows; set it false$"):
        check_against_model(sp, config)


def test_full_fine_tune_in_one_process(moe_with_tokenizer, tmp_path):  # noqa: F811
    summary = _train(tmp_path / "full", moe_with_tokenizer, "lora=null", "training.lr=1e-2")
    assert summary["trainable_parameters"] == summary["parameters"]
    final = tmp_path / "full" / "final"
    hf = AutoModelForCausalLM.from_pretrained(final, attn_implementation="eager").eval()
    base = AutoModelForCausalLM.from_pretrained(moe_with_tokenizer, attn_implementation="eager").eval()
    experts, experts0 = hf.model.layers[0].mlp.experts, base.model.layers[0].mlp.experts
    assert not torch.equal(experts.gate_up_proj, experts0.gate_up_proj)  # trained, and saved
    assert not torch.equal(hf.model.layers[0].mlp.gate.weight, base.model.layers[0].mlp.gate.weight)
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        assert (hf(ids).logits - load_pretrained(final).eval()(ids)).abs().max() <= 1e-5


def test_lora_fine_tune_in_one_process(moe_with_tokenizer, tmp_path):  # noqa: F811
    """``all-linear`` LoRA covers the attention projections: the router and the experts are no linear
    layers, and PEFT reads a dense layer's ``gate_proj`` / ``up_proj`` / ``down_proj`` in an MoE
    model's adapter as the experts'; the adapter loads in peft with our logits."""
    summary = _train(tmp_path / "lora", moe_with_tokenizer, "training.lr=1e-2")
    final = tmp_path / "lora" / "final"
    targets = set(json.loads((final / "adapter_config.json").read_text())["target_modules"])
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert summary["trainable_parameters"] < summary["parameters"]
    ours = load_pretrained(moe_with_tokenizer).eval()
    load_adapter(ours, final)
    hf = AutoModelForCausalLM.from_pretrained(moe_with_tokenizer, attn_implementation="eager").eval()
    ids = torch.randint(0, 128, (1, 16))
    with torch.no_grad():
        ref = PeftModel.from_pretrained(hf, final).eval()(ids).logits
        assert (ours(ids) - ref).abs().max() <= 1e-5

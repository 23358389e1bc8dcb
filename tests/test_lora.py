"""LoRA against the `peft` and `transformers` oracles: adapter files both ways, merging, the save
modes, init and scaling, trainable sets, and the user errors."""

from __future__ import annotations

import json
import warnings

import peft
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from nxd_finetune.errors import AdapterError
from nxd_finetune.lora import (
    LoraConfig,
    LoraLinear,
    base_param_name,
    cast_adapter_params,
    inject_lora,
    load_adapter,
    lora_modules,
    merge_lora,
    read_adapter,
    save_adapter,
    saved_modules,
    trainable_parameters,
)
from nxd_finetune.lora.io import adapter_config_hash
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, materialize

TOL = 1e-5
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))


def hf_load(path):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def logits(model):
    with torch.no_grad():
        out = model(IDS)
    return out if isinstance(out, torch.Tensor) else out.logits


def randomize(model, seed=1):
    """Fresh values for every trainable parameter: non-zero B, new A, biases and copies (norm
    weights around 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(trainable_parameters(model)):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0))


def peft_config(**kw):
    return peft.LoraConfig(task_type="CAUSAL_LM", **kw)


def export(model, cfg, out, mode, base, tokenizer=None, dtype=torch.float32):
    """The run's exporter (nxd_finetune.export) on a one-process model."""
    from nxd_finetune.export import ExportSpec, export_model
    from nxd_finetune.parallel.parallelize import RankModel

    targets = [name for name, _ in lora_modules(model)]
    return export_model(RankModel.single(model), out, ExportSpec(mode, base, str(base), dtype, tokenizer=tokenizer),
                        config=model.config, lora=cfg, lora_targets=targets)


def our_model(path, cfg, seed=1):
    model = load_pretrained(path).eval()
    inject_lora(model, cfg)
    randomize(model, seed)
    return model


# ---------------------------------------------------------------------------- ours -> PEFT

TARGETS = {"list": ["q_proj", "v_proj", "down_proj"], "regex": r".*\.(k|o|up)_proj", "all-linear": "all-linear"}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("targets", sorted(TARGETS))
def test_our_adapter_loads_in_peft(family, targets, make_tiny_hf, tmp_path):
    _, base = make_tiny_hf(family)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[targets])
    ours = our_model(base, cfg)
    save_adapter(ours, cfg, tmp_path / "adapter", base_model_name_or_path=str(base))

    hf = hf_load(base)
    plain = logits(hf)
    with_lora = logits(peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval())
    assert (with_lora - plain).abs().max() > 1e-3  # the adapter matters
    assert (logits(ours) - with_lora).abs().max() <= TOL


@pytest.mark.parametrize(
    "kw",
    [
        dict(target_modules=["q_proj", "v_proj"]),
        dict(target_modules="all-linear", bias="lora_only", use_rslora=True, init_lora_weights="gaussian"),
        dict(target_modules=r".*mlp\.(gate|up)_proj", bias="all", modules_to_save=["lm_head"]),
    ],
    ids=["plain", "rslora-gaussian-lora_only", "regex-bias_all-modules_to_save"],
)
def test_adapter_files_match_peft(kw, make_tiny_hf, tmp_path):
    """Same keys, shapes and config values as the adapter PEFT writes for the same settings."""
    _, base = make_tiny_hf("qwen2")
    cfg = LoraConfig(r=4, lora_alpha=8, **kw)
    save_adapter(our_model(base, cfg), cfg, tmp_path / "ours", base_model_name_or_path=str(base))
    pkw = {**kw, "init_lora_weights": True if kw.get("init_lora_weights") is None else kw["init_lora_weights"]}
    peft.get_peft_model(hf_load(base), peft_config(r=4, lora_alpha=8, **pkw)).save_pretrained(tmp_path / "peft")

    ours_t = load_file(tmp_path / "ours" / "adapter_model.safetensors")
    peft_t = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert {k: tuple(v.shape) for k, v in ours_t.items()} == {k: tuple(v.shape) for k, v in peft_t.items()}
    ours_c = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    peft_c = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    for key, value in ours_c.items():
        if key in ("target_modules", "base_model_name_or_path"):
            continue
        assert peft_c[key] == value, key
    if isinstance(peft_c["target_modules"], list):  # all-linear: PEFT writes full names, we short ones
        assert {t.rpartition(".")[2] for t in peft_c["target_modules"]} == set(ours_c["target_modules"])
    else:
        assert peft_c["target_modules"] == ours_c["target_modules"]
    # PEFT reads our config without a warning (no foreign keys); the base hash is in the header
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        peft.LoraConfig.from_pretrained(tmp_path / "ours")
    assert adapter_config_hash(tmp_path / "ours") == DecoderConfig.from_hf(base).config_hash()
    assert adapter_config_hash(tmp_path / "peft") is None


# ---------------------------------------------------------------------------- PEFT -> ours

PEFT_VARIANTS = {
    "list": ("llama", {}, dict(target_modules=["q_proj", "k_proj", "gate_proj"])),
    "rslora": ("llama", {}, dict(target_modules=["v_proj", "o_proj"], use_rslora=True)),
    "bias-all": ("llama", dict(attention_bias=True), dict(target_modules=["q_proj"], bias="all")),
    "lora_only-regex": ("qwen2", {}, dict(target_modules=r".*self_attn\.(q|k)_proj", bias="lora_only")),
    "modules_to_save-tied": (
        "llama",
        dict(tie_word_embeddings=True),
        dict(target_modules="all-linear", modules_to_save=["lm_head"]),
    ),
}


def randomize_peft(model, seed=2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    assert any("lora_B" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("variant", sorted(PEFT_VARIANTS))
def test_peft_adapter_loads_into_ours(variant, make_tiny_hf, tmp_path):
    family, overrides, kw = PEFT_VARIANTS[variant]
    _, base = make_tiny_hf(family, **overrides)
    hf = hf_load(base)
    plain = logits(hf)
    pm = peft.get_peft_model(hf, peft_config(r=4, lora_alpha=16, **kw)).eval()
    randomize_peft(pm)
    expected = logits(pm)
    pm.save_pretrained(tmp_path / "adapter")
    assert (expected - plain).abs().max() > 1e-3

    ours = load_pretrained(base).eval()
    cfg = load_adapter(ours, tmp_path / "adapter")
    assert cfg.use_rslora == kw.get("use_rslora", False) and cfg.bias == kw.get("bias", "none")
    assert (logits(ours) - expected).abs().max() <= TOL


def test_load_adapter_into_already_injected_model(make_tiny_hf, tmp_path):
    _, base = make_tiny_hf("llama")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    src = our_model(base, cfg, seed=3)
    save_adapter(src, cfg, tmp_path / "a", base_model_name_or_path=None)
    dst = load_pretrained(base).eval()
    inject_lora(dst, cfg)
    assert (logits(dst) - logits(src)).abs().max() > 1e-3
    load_adapter(dst, tmp_path / "a", inject=False)
    assert (logits(dst) - logits(src)).abs().max() <= TOL
    other = load_pretrained(base)
    inject_lora(other, LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(AdapterError, match="scaling"):
        load_adapter(other, tmp_path / "a", inject=False)


# ---------------------------------------------------------------------------- save modes


def test_merged_checkpoint_equals_peft_merge_and_unload(make_tiny_hf, tmp_path):
    _, base = make_tiny_hf("qwen2")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", bias="lora_only", modules_to_save=["embed_tokens"])
    ours = our_model(base, cfg)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    export(ours, cfg, tmp_path / "merged", "merged", base)
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())  # training model untouched
    assert not any(m.merged for _, m in lora_modules(ours))

    save_adapter(ours, cfg, tmp_path / "adapter", base_model_name_or_path=str(base))
    oracle = peft.PeftModel.from_pretrained(hf_load(base), tmp_path / "adapter").merge_and_unload().eval()
    merged = hf_load(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert (logits(merged) - logits(oracle)).abs().max() <= TOL
    assert (logits(merged) - logits(ours)).abs().max() <= TOL


def test_merged_checkpoint_unties_a_changed_lm_head(make_tiny_hf, tmp_path):
    _, base = make_tiny_hf("llama", tie_word_embeddings=True)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    ours = our_model(base, cfg)
    export(ours, cfg, tmp_path / "merged", "merged", base)
    save_adapter(ours, cfg, tmp_path / "adapter", base_model_name_or_path=str(base))
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
    oracle = peft.PeftModel.from_pretrained(hf_load(base), tmp_path / "adapter").eval()
    assert (logits(hf_load(tmp_path / "merged")) - logits(oracle)).abs().max() <= TOL


def test_base_and_adapter_round_trip(make_tiny_hf, tmp_path):
    hf, base = make_tiny_hf("llama", attention_bias=True)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"], modules_to_save=["lm_head"])
    ours = our_model(base, cfg)
    expected = logits(ours)
    next(m for _, m in lora_modules(ours)).merge()  # a merged layer still saves its original base
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    out = export(ours, cfg, tmp_path / "out", "base_and_adapter", base, tokenizer=tok)
    assert (out / "base" / "tokenizer.json").is_file() and (out / "adapter" / "tokenizer_config.json").is_file()
    assert (logits(hf_load(out / "base")) - logits(hf)).abs().max() <= TOL  # the base is the original
    fresh = load_pretrained(out / "base").eval()
    load_adapter(fresh, out / "adapter")
    assert (logits(fresh) - expected).abs().max() <= TOL
    oracle = peft.PeftModel.from_pretrained(hf_load(out / "base"), out / "adapter").eval()
    assert (logits(oracle) - expected).abs().max() <= TOL
    assert (expected - logits(hf)).abs().max() > 1e-3


def test_merge_lora_unwraps(make_tiny_hf):
    _, base = make_tiny_hf("llama", tie_word_embeddings=True)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "lm_head"], modules_to_save=["norm"])
    ours = our_model(base, cfg)
    expected = logits(ours)
    merge_lora(ours)
    assert not list(lora_modules(ours)) and type(ours.lm_head) is nn.Linear
    assert set(ours.state_dict()) == set(load_pretrained(base).state_dict())
    assert ours.config.tie_word_embeddings is False
    assert not torch.equal(ours.lm_head.weight, ours.model.embed_tokens.weight)
    assert (logits(ours) - expected).abs().max() <= TOL


META_CASES = {
    "tied-lm_head-lora": ("llama", dict(tie_word_embeddings=True), dict(target_modules=["q_proj", "lm_head"])),
    "qwen2-all-linear": ("qwen2", {}, dict(target_modules="all-linear", bias="lora_only")),
    "modules_to_save": ("llama", dict(tie_word_embeddings=True),
                        dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"])),
}


@pytest.mark.parametrize("case", META_CASES.values(), ids=list(META_CASES))
def test_inject_on_meta_then_materialize(case, make_tiny_hf, tmp_path):
    """The sharded-loading order: build on meta, inject, then load the base checkpoint by name."""
    family, overrides, kw = case
    _, base = make_tiny_hf(family, **overrides)
    cfg = LoraConfig(r=4, lora_alpha=8, **kw)
    ref = our_model(base, cfg)
    save_adapter(ref, cfg, tmp_path / "a", base_model_name_or_path=None)
    model = build_model(DecoderConfig.from_hf(base))
    inject_lora(model, cfg)
    materialize(model, base, name_map=base_param_name)
    load_adapter(model, tmp_path / "a", inject=False)
    assert {n for n, _ in trainable_parameters(model)} == {n for n, _ in trainable_parameters(ref)}
    assert (logits(model.eval()) - logits(ref)).abs().max() <= TOL
    plain = load_pretrained(base)
    for name, wrapper in saved_modules(model):  # loading the trained copy left the original alone
        assert torch.equal(wrapper.original_module.weight, plain.get_submodule(name).weight)


def test_bf16_base_with_fp32_adapters(make_tiny_hf, tmp_path):
    _, base = make_tiny_hf("qwen2")
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], bias="all", modules_to_save=["lm_head"])
    model = load_pretrained(base, dtype="bf16")
    inject_lora(model, cfg)
    cast_adapter_params(model)
    dtypes = {n: p.dtype for n, p in trainable_parameters(model)}
    assert {d for n, d in dtypes.items() if n.endswith(".bias")} == {torch.bfloat16}
    assert {d for n, d in dtypes.items() if not n.endswith(".bias")} == {torch.float32}
    out = model(IDS)
    assert out.dtype == torch.bfloat16
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for _, p in trainable_parameters(model))
    export(model, cfg, tmp_path / "merged", "merged", base, dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(tmp_path / "merged" / "model.safetensors").values()} == {torch.bfloat16}


# ---------------------------------------------------------------------------- layer maths


@pytest.mark.parametrize("r", [4, 16])
@pytest.mark.parametrize("rslora", [False, True])
def test_scaling_matches_peft(r, rslora):
    toy = nn.Sequential()
    toy.add_module("proj", nn.Linear(32, 32))
    pm = peft.get_peft_model(toy, peft.LoraConfig(r=r, lora_alpha=12, target_modules=["proj"], use_rslora=rslora))
    theirs = pm.base_model.model.proj.scaling["default"]
    assert LoraConfig(r=r, lora_alpha=12, use_rslora=rslora).scaling == pytest.approx(theirs, rel=1e-12)
    assert LoraLinear(nn.Linear(32, 32), r=r, lora_alpha=12, use_rslora=rslora).scaling == pytest.approx(theirs)


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_init_statistics_match_peft(init):
    fan_in, out, r = 2048, 64, 64
    torch.manual_seed(0)
    toy = nn.Sequential()
    toy.add_module("proj", nn.Linear(fan_in, out))
    pm = peft.get_peft_model(
        toy,
        peft.LoraConfig(
            r=r, lora_alpha=8, target_modules=["proj"], init_lora_weights=True if init == "default" else init
        ),
    )
    theirs = pm.base_model.model.proj
    a_peft, b_peft = theirs.lora_A["default"].weight, theirs.lora_B["default"].weight
    torch.manual_seed(1)
    ours = LoraLinear(nn.Linear(fan_in, out), r=r, lora_alpha=8, init_lora_weights=init)
    a, b = ours.lora_A.weight, ours.lora_B.weight
    assert a.shape == a_peft.shape and b.shape == b_peft.shape
    assert not b.any() and not b_peft.any()
    assert a.std().item() == pytest.approx(a_peft.std().item(), rel=0.03)
    assert abs(a.mean().item()) < 0.05 * a.std().item()
    if init == "default":  # kaiming-uniform(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        assert a.abs().max() <= a_peft.abs().max() * 1.01 and a.abs().max() >= a_peft.abs().max() * 0.99
    else:  # PEFT's gaussian: std 1/r
        assert a.std().item() == pytest.approx(1 / r, rel=0.03)


def test_merge_unmerge_round_trip():
    torch.manual_seed(0)
    base = nn.Linear(16, 12)
    w0 = base.weight.detach().clone()
    layer = LoraLinear(base, r=4, lora_alpha=6)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 5, 16)
    by_hand = F.linear(x, w0, base.bias) + (x @ layer.lora_A.weight.T @ layer.lora_B.weight.T) * 1.5
    y = layer(x)
    assert (y - by_hand).abs().max() <= 1e-5
    layer.merge()
    assert layer.merged and (layer.weight - w0).abs().max() > 1e-3
    assert (layer(x) - by_hand).abs().max() <= 1e-5
    layer.unmerge()
    assert not layer.merged and (layer.weight - w0).abs().max() <= 1e-6
    assert (layer(x) - by_hand).abs().max() <= 1e-5


TRAINABLE_CASES = {
    "none": ("llama", {}, dict(target_modules=["q_proj", "v_proj"])),
    "all": ("qwen2", {}, dict(target_modules=["k_proj"], bias="all")),
    "lora_only": ("qwen2", {}, dict(target_modules="all-linear", bias="lora_only")),
    "modules_to_save": ("llama", {}, dict(target_modules=r".*\.0\.mlp\.down_proj", modules_to_save=["lm_head"])),
}


@pytest.mark.parametrize("case", sorted(TRAINABLE_CASES))
def test_names_and_trainable_set_match_peft(case, make_tiny_hf):
    family, overrides, kw = TRAINABLE_CASES[case]
    _, base = make_tiny_hf(family, **overrides)
    ours = load_pretrained(base)
    wrapped = inject_lora(ours, LoraConfig(r=4, lora_alpha=8, **kw))
    pm = peft.get_peft_model(hf_load(base), peft_config(r=4, lora_alpha=8, **kw))

    def norm(name):
        return name.removeprefix("base_model.model.").replace(".default", "")

    assert set(ours.state_dict()) == {norm(k) for k in pm.state_dict()}
    assert {n for n, _ in trainable_parameters(ours)} == {norm(n) for n, p in pm.named_parameters() if p.requires_grad}
    assert wrapped == [n for n, _ in lora_modules(ours)]
    assert all(
        n.endswith(("lora_A.weight", "lora_B.weight", ".bias")) or ".modules_to_save." in n
        for n, _ in trainable_parameters(ours)
    )


# ---------------------------------------------------------------------------- errors


def test_targets_matching_nothing_list_linear_names(tiny_llama_dir):
    model = load_pretrained(tiny_llama_dir)
    with pytest.raises(AdapterError) as e:
        inject_lora(model, LoraConfig(target_modules=["qkv_proj"]))
    msg = str(e.value)
    assert "qkv_proj" in msg and "\n" not in msg
    listed = msg.split("linear modules in the model: ")[1]
    assert listed == "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
    with pytest.raises(AdapterError, match="RMSNorm"):
        inject_lora(model, LoraConfig(target_modules=["input_layernorm"]))
    assert not list(lora_modules(model))


def test_adapter_that_does_not_fit_names_the_tensor(make_tiny_hf, tmp_path):
    _, big = make_tiny_hf("llama", intermediate_size=96)
    _, small = make_tiny_hf("llama", intermediate_size=80)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["up_proj"])
    save_adapter(our_model(big, cfg), cfg, tmp_path / "a", base_model_name_or_path=str(big))
    with pytest.raises(AdapterError, match=r"up_proj\.lora_B\.weight.*\(96, 4\).*\(80, 4\)"):
        load_adapter(load_pretrained(small), tmp_path / "a")


def test_adapter_with_missing_or_unexpected_tensors(tiny_llama_dir, tmp_path):
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    save_adapter(our_model(tiny_llama_dir, cfg), cfg, tmp_path / "a", base_model_name_or_path=None)
    f = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(f)
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    save_file({k: v for k, v in tensors.items() if k != key}, f)
    with pytest.raises(AdapterError, match=r"lacks tensor 'model\.layers\.1\.self_attn\.q_proj\.lora_A\.weight'"):
        load_adapter(load_pretrained(tiny_llama_dir), tmp_path / "a")
    extra = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    save_file({**tensors, extra: torch.zeros(64, 64)}, f)
    with pytest.raises(AdapterError, match="q_proj.base_layer.weight"):
        load_adapter(load_pretrained(tiny_llama_dir), tmp_path / "a")
    f.unlink()
    (tmp_path / "a" / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterError, match="pickle"):
        read_adapter(tmp_path / "a")


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(bias="some"), "unknown LoRA bias 'some'"),
        (dict(r=0), "positive integer"),
        (dict(lora_dropout=1.0), "lora_dropout"),
        (dict(target_modules="(q_proj"), "not a valid regex"),
        (dict(target_modules=[]), "empty"),
        (dict(init_lora_weights="pissa"), "init_lora_weights"),
    ],
)
def test_invalid_config(bad, match):
    with pytest.raises(AdapterError, match=match):
        LoraConfig(**bad)


def test_unsupported_peft_configs_are_refused():
    good = LoraConfig(target_modules=["q_proj"]).to_peft_dict("base")
    assert LoraConfig.from_peft_dict(json.loads(json.dumps(good))) == LoraConfig(target_modules=["q_proj"])
    assert LoraConfig.from_peft_dict({**good, "use_dora": True}).use_dora  # DoRA: tests/test_dora.py
    for bad, match in [
        ({"peft_type": "IA3"}, "LORA"),
        ({"bias": "x"}, "bias"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"init_lora_weights": "pissa"}, "pissa"),
    ]:
        with pytest.raises(AdapterError, match=match):
            LoraConfig.from_peft_dict({**good, **bad})

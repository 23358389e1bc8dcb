"""LoRA on the fused expert tensors (``lora.target_parameters``, nxd_finetune/lora/experts.py)
against peft 0.21's ``target_parameters`` on transformers' Qwen3-MoE / Mixtral: the adapter files
both ways with equal logits, one training step (gradients and the updated adapter), the merge
against ``merge_and_unload``, the router through ``modules_to_save``, the save modes of a run, and
one-line refusals; the docs' recipe excerpt."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from nxd_finetune.errors import AdapterError, RecipeError
from nxd_finetune.lora import LoraConfig, inject_lora, load_adapter, merge_lora, save_adapter
from nxd_finetune.lora.merge import merge_adapter
from nxd_finetune.models import load_pretrained
from nxd_finetune.models.moe import set_expert_kernel
from nxd_finetune.recipe import load_recipe
from tests.moe_helpers import QUICKSTART, build_tiny_moe, moe_with_tokenizer, tiny_moe_config  # noqa: F401  (a fixture)
from tests.moe_helpers import train as _train

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOL = 1e-5


@pytest.fixture(params=["qwen3_moe", "mixtral"])
def base(request, tmp_path) -> Path:
    path = tmp_path / f"hf-{request.param}"
    build_tiny_moe(tiny_moe_config(request.param), path)
    return path


def _hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def _ids(b: int = 2, t: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def _randomize(model: torch.nn.Module, seed: int = 3) -> None:
    """Every trainable tensor random (B non-zero), so the adapter changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _peft(path: Path, parameters: list[str], save: list[str] | None = None) -> torch.nn.Module:
    cfg = PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=parameters,
                         modules_to_save=save)
    model = get_peft_model(_hf(path), cfg)
    _randomize(model)
    return model


def _ours_key(peft_name: str) -> str:
    """A peft parameter name as ours: no ``base_model.model.`` prefix, no adapter name."""
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".")


@pytest.mark.parametrize("parameters", [EXPERTS, ["mlp.experts.down_proj"], ["gate_up_proj"]])
def test_peft_adapter_loads_in_ours_and_ours_in_peft(base, tmp_path, parameters):
    peft_model = _peft(base, parameters)
    peft_model.save_pretrained(tmp_path / "peft")
    ids = _ids()
    with torch.no_grad():
        ref = peft_model(ids).logits
        plain = _hf(base)(ids).logits
    assert (ref - plain).abs().max() > 1e-2  # the expert LoRA changes the logits
    ours = load_pretrained(base).eval()
    cfg = load_adapter(ours, tmp_path / "peft")
    assert sorted(cfg.target_parameters) == sorted(parameters)  # peft keeps them in a set
    for kernel in ("grouped", "loop"):
        set_expert_kernel(ours, kernel)
        with torch.no_grad():
            assert (ours(ids) - ref).abs().max() <= TOL
    save_adapter(ours, cfg, tmp_path / "ours", None)
    keys = {}
    for name in ("peft", "ours"):
        with safe_open(tmp_path / name / "adapter_model.safetensors", "pt") as f:
            keys[name] = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert keys["ours"] == keys["peft"]
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert sorted(written["target_parameters"]) == sorted(parameters)
    with torch.no_grad():
        again = PeftModel.from_pretrained(_hf(base), tmp_path / "ours").eval()(ids).logits
    assert (again - ref).abs().max() <= TOL


def test_one_training_step_equals_peft(base, tmp_path):
    """Same init (peft's adapter loaded into ours), same batch: loss, every gradient (LoRA on
    attention and on both expert tensors, the router in modules_to_save) and the SGD-updated
    adapter agree within 1e-5."""
    peft_model = _peft(base, EXPERTS, save=["gate"])
    peft_model.save_pretrained(tmp_path / "init")
    ours = load_pretrained(base)
    load_adapter(ours, tmp_path / "init")
    peft_model.train()
    ours.train()
    ids = _ids(seed=5)

    def step(model: torch.nn.Module, logits_of) -> torch.Tensor:
        logits = logits_of(model)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach()

    ref_loss = step(peft_model, lambda m: m(ids).logits)
    loss = step(ours, lambda m: m(ids))
    assert abs(loss - ref_loss) <= TOL
    ref = {_ours_key(n): p for n, p in peft_model.named_parameters() if p.requires_grad}
    got = {n: p for n, p in ours.named_parameters() if p.requires_grad}
    assert set(got) == set(ref)
    assert any(".mlp.gate.modules_to_save." in n for n in got)
    assert any(".mlp.experts.base_layer.lora_A." in n for n in got)
    for name, p in got.items():
        assert p.grad is not None and p.grad.abs().max() > 0, name
        assert (p.grad - ref[name].grad).abs().max() <= TOL, name
    for params in (list(got.values()), list(ref.values())):
        torch.optim.SGD(params, lr=0.5).step()
    for name, p in got.items():
        assert (p.detach() - ref[name].detach()).abs().max() <= TOL, name


def test_merge_equals_peft_merge_and_unload(base, tmp_path):
    peft_model = _peft(base, EXPERTS, save=["gate"])
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = _ids()
    merged_ref = peft_model.merge_and_unload().eval()
    with torch.no_grad():
        ref = merged_ref(ids).logits
    merge_adapter(tmp_path / "adapter", base, tmp_path / "merged")
    merged = _hf(tmp_path / "merged")
    want = merged_ref.state_dict()
    for name, t in merged.state_dict().items():
        assert (t - want[name]).abs().max() <= 1e-6, name
    with torch.no_grad():
        assert (merged(ids).logits - ref).abs().max() <= TOL
    ours = load_pretrained(base).eval()
    load_adapter(ours, tmp_path / "adapter")
    merge_lora(ours)  # in memory: the plain experts module back, the adapter folded in
    assert not any("lora_" in n or "base_layer" in n for n, _ in ours.named_parameters())
    with torch.no_grad():
        assert (ours(ids) - ref).abs().max() <= TOL


def test_router_frozen_unless_in_modules_to_save(base):
    ours = load_pretrained(base)
    inject_lora(ours, LoraConfig(r=2, target_modules="all-linear", target_parameters=EXPERTS))
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert not any(".mlp.gate." in n for n in trainable)
    assert not any(n.endswith(("gate_up_proj", "down_proj")) for n in trainable)  # the fused bases stay frozen
    ours = load_pretrained(base)
    inject_lora(ours, LoraConfig(r=2, target_parameters=EXPERTS, target_modules=[], modules_to_save=["gate"]))
    assert sorted({n.split(".mlp.")[1] for n, p in ours.named_parameters() if p.requires_grad}) == [
        "experts.base_layer.lora_A.weight", "experts.base_layer.lora_B.weight", "experts.lora_A.weight",
        "experts.lora_B.weight", "gate.modules_to_save.weight"]


def test_all_linear_says_what_it_covers(base):
    ours = load_pretrained(base)
    with pytest.warns(UserWarning) as record:
        inject_lora(ours, LoraConfig(r=2, target_modules="all-linear"))
    lines = [str(w.message) for w in record if "mixture-of-experts" in str(w.message)]
    assert lines == ["lora all-linear on a mixture-of-experts model covers k_proj, o_proj, q_proj, v_proj; not the "
                     "experts (name them in lora.target_parameters: mlp.experts.down_proj, "
                     "mlp.experts.gate_up_proj); the router (mlp.gate) trains only through lora.modules_to_save"]


@pytest.mark.parametrize(("cfg", "message"), [
    ({"target_parameters": ["mlp.experts.up_proj"]},
     "lora.target_parameters entry 'mlp.experts.up_proj' matches no expert tensor; expert tensors: "
     "mlp.experts.down_proj, mlp.experts.gate_up_proj"),
    ({"target_parameters": ["self_attn.q_proj.weight"]},
     "lora.target_parameters entry 'self_attn.q_proj.weight' names model.layers.0.self_attn.q_proj.weight, which "
     "is not an expert tensor; expert tensors: mlp.experts.down_proj, mlp.experts.gate_up_proj"),
])
def test_bad_target_parameters_are_one_line(base, cfg, message):
    ours = load_pretrained(base)
    with pytest.raises(AdapterError) as e:
        inject_lora(ours, LoraConfig(r=2, **cfg))
    assert str(e.value) == message


def test_target_parameters_on_a_dense_model_and_with_dropout_are_one_line(tmp_path):
    dense = tmp_path / "dense"
    build_tiny_moe(tiny_moe_config("qwen3_moe", num_experts=0), dense)
    with pytest.raises(AdapterError, match=r"^lora.target_parameters puts LoRA on the fused expert tensors of a "
                                           r"mixture-of-experts model; this model has none \(use target_modules\)$"):
        inject_lora(load_pretrained(dense), LoraConfig(target_parameters=EXPERTS))
    with pytest.raises(AdapterError, match=r"^lora_dropout must be 0 with target_parameters, got 0.1"):
        LoraConfig(target_parameters=EXPERTS, lora_dropout=0.1)
    with pytest.raises(RecipeError, match="lora.dropout must be 0 with lora.target_parameters"):
        load_recipe(QUICKSTART, ["lora.target_parameters=[mlp.experts.down_proj]", "lora.dropout=0.1"])
    recipe = load_recipe(QUICKSTART, ["lora.target_parameters=[mlp.experts.down_proj]", "lora.target_modules=[]"])
    assert LoraConfig.from_section(recipe.lora).target_parameters == ["mlp.experts.down_proj"]
    with pytest.raises(RecipeError, match="lora.target_modules is empty"):
        load_recipe(QUICKSTART, ["lora.target_modules=[]"])


@pytest.mark.parametrize("mode", ["adapter", "base_and_adapter", "merged"])
def test_run_with_expert_lora_in_each_save_mode(moe_with_tokenizer, tmp_path, mode):  # noqa: F811
    """A recipe run with ``lora.target_parameters`` and the router in ``modules_to_save``: the
    adapter loads in peft with our logits, and the merged checkpoint equals peft's merge."""
    _train(tmp_path, moe_with_tokenizer, "training.lr=1e-2", "lora.dropout=0",
           "lora.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
           "lora.modules_to_save=[gate]", f"checkpoint.save_mode={mode}")
    final = tmp_path / "final"
    adapter = final / "adapter" if mode == "base_and_adapter" else final
    ids = torch.randint(0, 128, (1, 16))
    if mode == "merged":
        merged = _hf(final)
        base = _hf(moe_with_tokenizer)
        assert not torch.equal(merged.model.layers[0].mlp.experts.down_proj, base.model.layers[0].mlp.experts.down_proj)
        assert not torch.equal(merged.model.layers[0].mlp.gate.weight, base.model.layers[0].mlp.gate.weight)
        return
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert written["target_parameters"] == EXPERTS and written["modules_to_save"] == ["gate"]
    ours = load_pretrained(moe_with_tokenizer).eval()
    load_adapter(ours, adapter)
    with torch.no_grad():
        ref = PeftModel.from_pretrained(_hf(moe_with_tokenizer), adapter).eval()(ids).logits
        assert (ours(ids) - ref).abs().max() <= TOL


def test_the_docs_lora_section_is_a_valid_recipe():
    """The ``lora`` excerpt in docs/models.md validates and reaches LoraConfig as shown."""
    text = (QUICKSTART.parents[1] / "docs" / "models.md").read_text()
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "target_parameters" in b]
    lora = yaml.safe_load(block)["lora"]
    recipe = load_recipe(QUICKSTART, [f"lora.{k}={json.dumps(v)}" for k, v in lora.items()])
    cfg = LoraConfig.from_section(recipe.lora)
    assert (cfg.target_modules, cfg.target_parameters, cfg.modules_to_save) == ("all-linear", EXPERTS, ["gate"])


def test_init_from_an_adapter_with_other_expert_tensors_is_one_line():
    from nxd_finetune.lora.init_from import check_same_lora
    from nxd_finetune.models import DecoderConfig

    config = DecoderConfig.from_hf(tiny_moe_config("mixtral").to_dict())
    ours = LoraConfig(target_parameters=EXPERTS)
    check_same_lora(ours, LoraConfig(target_parameters=list(reversed(EXPERTS))), config, "x")
    with pytest.raises(AdapterError) as e:
        check_same_lora(ours, LoraConfig(target_parameters=["down_proj"]), config, "x")
    assert str(e.value) == ("lora.init_from x: the recipe has lora.target_parameters=['mlp.experts.gate_up_proj', "
                            "'mlp.experts.down_proj'] but the adapter has ['down_proj'] (they select different "
                            "expert tensors)")

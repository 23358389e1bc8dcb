"""DoRA on a quantized base (``lora.use_dora`` with ``model.quantization``) against peft's
``use_dora=True`` on transformers' ``BitsAndBytesConfig`` model, which reads the dequantized weight
for the weight norm and the magnitude's initial value:

- logits, every gradient and two AdamW steps equal peft's (nf4, nf4 with double quantization, fp4;
  int8 is refused: peft's DoRA does not train on transformers' 8-bit model);
- a run's fresh magnitudes are ``||dequantized W||`` per row, as peft's, not the full-precision norm;
- a quantized DoRA run's adapter loads in peft on transformers' quantized model with our logits, and
  merges into the full-precision base as peft's ``merge_and_unload`` on the unquantized model;
- tp2 equals one process on the base its shards dequantize to.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
from qlora_helpers import FAST, QUICKSTART, SPECS, _adapter, _same, _worker, hf_quantized, recipe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.lora import inject_lora, load_adapter, lora_modules, read_adapter
from nxd_finetune.lora.dora import DoraLinear
from nxd_finetune.lora.merge import merge_adapter
from nxd_finetune.lora.quantized import QuantSpec, dequantized_weight, quantize_base
from nxd_finetune.models import load_pretrained
from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import load_recipe
from nxd_finetune.sft import trainer
from nxd_finetune.sft.engine import build_engine

pytest.importorskip("bitsandbytes")

TOL = 1e-5
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(9))
DORA_SPECS = {"nf4": QuantSpec("nf4"), "nf4-double": SPECS["nf4-double"], "fp4": SPECS["fp4"]}
QUANT = ["lora.use_dora=true", "model.quantization.method=nf4", "model.quantization.double_quant=true"]


def peft_dora_on_quantized(base: Path, spec: QuantSpec, out: Path, dropout: float) -> peft.PeftModel:
    """peft's DoRA (all-linear, r=4, ``dropout``) on transformers' quantized model, every trainable
    tensor moved off its init (the magnitudes stay near ``||W||``), saved to ``out``."""
    hf = peft.prepare_model_for_kbit_training(hf_quantized(base, spec), use_gradient_checkpointing=False)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True,
                                                 lora_dropout=dropout, task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(str(out))
    return pm.train()


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))


def _dequantized(linear: torch.nn.Module) -> torch.Tensor:
    """A bitsandbytes ``Linear4bit``'s weight dequantized."""
    from bitsandbytes.functional import dequantize_4bit

    weight = linear.get_parameter("weight")
    return dequantize_4bit(weight.data, weight.quant_state)  # type: ignore[attr-defined]


def _peft_key(name: str) -> str:
    """peft's parameter name -> ours."""
    name = name.replace("base_model.model.", "").replace("magnitude_vector.default.weight", "magnitude_vector")
    return name.replace(".default", "")


@pytest.mark.parametrize("name, dropout", [*((n, 0.0) for n in DORA_SPECS), ("nf4-double", 0.2)])
def test_dora_step_equals_peft_on_their_quantized_model(make_tiny_hf, tmp_path, name, dropout):
    """With dropout while training DoRA's ``W drop(x)`` multiplies the dequantized weight (the same
    masks drawn in the same order)."""
    spec = DORA_SPECS[name]
    base = make_tiny_hf("llama", intermediate_size=128)[1]
    pm = peft_dora_on_quantized(base, spec, tmp_path / "adapter", dropout)
    ours = load_pretrained(base)
    inject_lora(ours, read_adapter(tmp_path / "adapter")[0])
    load_adapter(ours, tmp_path / "adapter", inject=False)
    quantize_base(ours, spec, torch.device("cpu"))
    ours.train()
    theirs = {_peft_key(n): p for n, p in pm.named_parameters() if p.requires_grad}
    mine = dict((n, p) for n, p in ours.named_parameters() if p.requires_grad)
    assert sorted(mine) == sorted(theirs) and sum(n.endswith("magnitude_vector") for n in mine) == 14
    opt_a = torch.optim.AdamW(list(mine.values()), lr=1e-2)
    opt_b = torch.optim.AdamW(list(theirs.values()), lr=1e-2)
    for step in range(2):
        torch.manual_seed(11 + step)  # dropout masks
        logits_a = ours(IDS)
        torch.manual_seed(11 + step)
        logits_b = pm(input_ids=IDS).logits
        torch.testing.assert_close(logits_a, logits_b, atol=TOL, rtol=TOL, msg=f"step {step} logits")
        _loss(logits_a).backward()
        _loss(logits_b).backward()
        for n in mine:
            torch.testing.assert_close(mine[n].grad, theirs[n].grad, atol=TOL, rtol=1e-4, msg=f"step {step} {n}")
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    for n in mine:
        torch.testing.assert_close(mine[n], theirs[n], atol=TOL, rtol=1e-4, msg=n)


def test_a_runs_fresh_magnitudes_are_the_dequantized_norms_as_peft(quickstart_cache, tmp_path):
    """The engine quantizes each weight as it is read, then sets ``m = ||W||`` from the dequantized
    weight (peft's ``DoraLinearLayer.update_layer`` on a ``Linear4bit``)."""
    recipe = load_recipe(QUICKSTART, [*FAST, *QUANT, f"output.dir={tmp_path}"])
    model_dir = resolve_model_dir(recipe.model.path)
    built = build_engine(recipe, model_dir, torch.device("cpu"), 1)
    layers = [(n, m) for n, m in lora_modules(built.model) if isinstance(m, DoraLinear)]
    pm = peft.get_peft_model(hf_quantized(model_dir, SPECS["nf4-double"]),
                             peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", use_dora=True))
    full = load_pretrained(model_dir)
    assert len(layers) == 4 * 7
    for n, m in layers:
        expected = pm.get_parameter(f"base_model.model.{n}.lora_magnitude_vector.default.weight")
        torch.testing.assert_close(m.lora_magnitude_vector, expected, atol=1e-6, rtol=1e-6, msg=n)
        theirs = pm.get_submodule(f"base_model.model.{n}").base_layer
        assert torch.equal(dequantized_weight(m.base_layer), _dequantized(theirs)), n
    n, m = layers[0]
    assert (m.lora_magnitude_vector - full.get_submodule(n).weight.norm(dim=1)).abs().max() > 1e-4


def test_quantized_dora_run_loads_in_peft_and_merges_into_the_full_precision_base(quickstart_cache, tmp_path):
    spec = SPECS["nf4-double"]
    summary = trainer.run(load_recipe(QUICKSTART, [*FAST, *QUANT, f"output.dir={tmp_path / 'run'}"]))
    adapter = Path(summary["output"])
    assert all(torch.isfinite(torch.tensor([h["train_loss"] for h in summary["history"]])))
    base = resolve_model_dir("builtin:tiny-llama")
    pm = peft.PeftModel.from_pretrained(hf_quantized(base, spec), adapter).train()
    assert pm.peft_config["default"].use_dora
    ours = load_pretrained(base)
    load_adapter(ours, adapter)
    quantize_base(ours, spec, torch.device("cpu"))
    with torch.no_grad():
        mine, theirs = ours.train()(IDS), pm(input_ids=IDS).logits
        plain = hf_quantized(base, spec)(input_ids=IDS).logits
    torch.testing.assert_close(mine, theirs, atol=TOL, rtol=TOL)
    assert (theirs - plain).abs().max() > 1e-4  # the trained adapter changes the logits
    # merged into the original full-precision base: peft's merge_and_unload on the unquantized model
    merge_adapter(adapter, base, tmp_path / "merged")
    got = load_file(tmp_path / "merged" / "model.safetensors")
    expected = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                              adapter).merge_and_unload().state_dict()
    for key, t in got.items():
        torch.testing.assert_close(t, expected[key], atol=1e-6, rtol=1e-6, msg=key)
    # not peft's merge onto the 4-bit base (the fold requantized, its quantization error kept)
    q = "model.layers.0.self_attn.q_proj"
    on_4bit = pm.merge_and_unload().get_submodule(q)
    assert (_dequantized(on_4bit) - got[f"{q}.weight"]).abs().max() > 1e-3


@pytest.mark.usefixtures("workers_tmpdir")
def test_tp2_dora_equals_one_process_on_its_dequantized_shards(quickstart_cache, tmp_path):
    """tp2: each rank's norms read its dequantized shard (row-parallel layers sum the squares over
    TP), so the run equals one process with DoRA on the base its shards dequantize to (1e-5)."""
    tp2 = recipe(tmp_path / "tp2", 2, "parallel.tp=2", "training.grad_accum=2", "lora.use_dora=true")
    shard = recipe(tmp_path / "shards", 2, "parallel.tp=2", "training.grad_accum=2").to_dict()
    results = launch(_worker, 2, [tp2.to_dict()], shard, str(tmp_path / "dequantized"), start_method="fork")
    got = results[0][0][0]
    assert got is not None and sum(k.endswith(".lora_magnitude_vector") for k in _adapter(got)) == 4 * 7
    on_shards = trainer.run(recipe(tmp_path / "on-shards", 1, "training.grad_accum=2", "model.quantization=null",
                                   f"model.path={tmp_path / 'dequantized'}", "lora.use_dora=true"))
    _same("tp2 DoRA against one process on its dequantized shards", got, on_shards)

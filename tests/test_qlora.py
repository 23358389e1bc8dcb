"""QLoRA (``model.quantization``): a frozen base quantized by bitsandbytes under LoRA, against
transformers + bitsandbytes (``BitsAndBytesConfig`` with the same settings) and peft.

- the recipe section and its one-line refusals (full fine-tuning, 4-bit settings on int8, a
  missing bitsandbytes);
- our quantized base holds the same bytes as transformers' loader and gives the same logits;
- one LoRA training step (gradients, then AdamW) equals peft's on transformers' quantized model;
- a quantized run's adapter loads in peft on transformers' quantized model with the same logits.

transformers' models run in train mode (no dropout in these configs): in eval without gradients
bitsandbytes' ``Linear4bit`` repacks its weight for an AVX512-BF16 CPU kernel (bf16 arithmetic, and
it fails on widths that are not a multiple of the block size), which our frozen base never takes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import yaml
from cli_run import run_cli
from qlora_helpers import FAST, QUICKSTART, ROOT, SPECS, held_bytes, hf_quantized
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nxd_finetune.errors import RecipeError
from nxd_finetune.lora import LoraConfig, base_param_name, inject_lora, load_adapter, lora_modules, read_adapter
from nxd_finetune.lora.quantized import (
    QuantSpec,
    dequantized_weight,
    is_quantized,
    quantizable,
    quantize_base,
    quantize_on_load,
    trained_quantization,
)
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, materialize
from nxd_finetune.preflight.report import run_checks
from nxd_finetune.quickstart import resolve_model_path
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.sft import trainer

pytest.importorskip("bitsandbytes")  # the [qlora] extra (in .[dev])

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture
def tiny(make_tiny_hf) -> Path:
    return make_tiny_hf("llama", intermediate_size=128)[1]


def test_recipe_section_and_one_line_refusals():
    recipe = load_recipe(QUICKSTART, ["model.quantization.method=nf4", "model.quantization.double_quant=true",
                                      "model.quantization.compute_dtype=bfloat16"])
    q = recipe.model.quantization
    assert q is not None and (q.method, q.double_quant, q.compute_dtype, q.block_size) == ("nf4", True, "bfloat16", 64)
    cases = {
        ("lora=null", "model.quantization.method=nf4"): "full fine-tuning of a quantized base is not supported",
        ("model.quantization.method=int8", "model.quantization.double_quant=true"):
            "model.quantization.double_quant applies to the 4-bit methods",
        ("model.quantization.method=nf4", "model.quantization.block_size=48"): "block_size",
        ("model.quantization.method=int4",): "method",
    }
    for overrides, message in cases.items():
        with pytest.raises(RecipeError) as err:
            load_recipe(QUICKSTART, list(overrides))
        assert message in str(err.value) and "\n" not in str(err.value), (overrides, str(err.value))


def test_an_int8_recipe_round_trips_through_its_dict():
    """The dict ``run --nproc N`` hands its workers (and a checkpoint's recipe) holds every field,
    the 4-bit ones at their defaults too: an int8 recipe reads back from it."""
    recipe = load_recipe(QUICKSTART, ["model.quantization.method=int8"])
    again = recipe_from_dict(recipe.to_dict())
    assert again.model.quantization == recipe.model.quantization and again.to_dict() == recipe.to_dict()


def test_a_quantized_base_recomputes_activations_unless_the_recipe_says_otherwise(quickstart_cache, capsys):
    """``model.quantization`` without ``parallel.activation_checkpointing`` resolves to ``full`` (as
    peft's ``prepare_model_for_kbit_training`` turns gradient checkpointing on); an explicit value,
    ``none`` included, stays; ``validate`` says so and its activations estimate follows it."""
    quant = ["model.quantization.method=nf4"]
    assert load_recipe(QUICKSTART).parallel.activation_checkpointing == "none"
    recipe = load_recipe(QUICKSTART, quant)
    assert recipe.parallel.activation_checkpointing == "full"
    assert recipe_from_dict(recipe.to_dict()).parallel.activation_checkpointing == "full"
    for explicit in ("none", "selective", "full"):
        kept = load_recipe(QUICKSTART, [*quant, f"parallel.activation_checkpointing={explicit}"])
        assert kept.parallel.activation_checkpointing == explicit
    off = load_recipe(QUICKSTART, [*quant, "parallel.activation_checkpointing=none"])
    assert run_checks(recipe).memory["activations"] < run_checks(off).memory["activations"]
    code, out, _ = run_cli(capsys, "validate", str(QUICKSTART), "model.quantization.method=nf4")
    assert code == 0 and "checkpointing full (the default with model.quantization)" in " ".join(out.split()), out
    code, out, _ = run_cli(capsys, "validate", str(QUICKSTART), "model.quantization.method=nf4",
                           "parallel.activation_checkpointing=none")
    assert code == 0 and "checkpointing none;" in " ".join(out.split()), out
    code, out, _ = run_cli(capsys, "validate", str(QUICKSTART), "model.quantization.method=nf4",
                           "parallel.activation_checkpointing=full")  # set by the user: not called the default
    assert code == 0 and "checkpointing full;" in " ".join(out.split()), out


def test_the_docs_recipe_block_is_a_valid_recipe():
    block = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "qlora.md").read_text(), flags=re.S)[0]
    shown = yaml.safe_load(block)
    recipe = load_recipe(QUICKSTART).to_dict()
    recipe["model"].update(shown["model"])
    recipe["lora"].update(shown["lora"])
    q = recipe_from_dict(recipe).model.quantization
    assert q is not None and (q.method, q.double_quant, q.compute_dtype) == ("nf4", True, "bfloat16")


def test_missing_bitsandbytes_is_one_line(quickstart_cache, tmp_path):
    code = ("import sys; sys.modules['bitsandbytes'] = None\n"  # as if it were not installed
            "from nxd_finetune.cli import main\n"
            f"main(['run', {str(QUICKSTART)!r}, 'model.quantization.method=nf4', 'output.dir={tmp_path}', "
            + ", ".join(repr(o) for o in FAST) + "])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert lines == ["error: model.quantization needs bitsandbytes, which is not installed: "
                     "pip install 'nxd-finetune[qlora]' (bitsandbytes)"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", list(SPECS))
def test_quantized_base_equals_transformers_bitsandbytes(tiny, name):
    spec = SPECS[name]
    hf = hf_quantized(tiny, spec)
    ours = load_pretrained(tiny).requires_grad_(False)
    names = quantize_base(ours, spec, torch.device("cpu"))
    hf_linears = {n: m for n, m in hf.named_modules() if hasattr(m, "weight") and m.weight.dtype in
                  (torch.uint8, torch.int8)}
    assert sorted(hf_linears) == sorted(names) and len(names) == 14
    for n in names:
        theirs, mine = hf_linears[n].weight, ours.get_submodule(n).weight
        assert torch.equal(theirs.data, mine.data), n  # the same quantized bytes
        if spec.four_bit:
            assert torch.equal(theirs.quant_state.absmax, mine.quant_state.absmax), n
    assert not is_quantized(ours.lm_head) and ours.lm_head.weight.dtype == torch.float32
    ours.train()
    torch.testing.assert_close(ours(IDS), hf(IDS).logits, atol=1e-5, rtol=1e-5)
    full = load_pretrained(tiny)(IDS)
    assert (ours(IDS) - full).abs().max() > 1e-3  # the base is really quantized


def _peft_on_quantized(tiny: Path, spec: QuantSpec, out: Path) -> peft.PeftModel:
    """peft's QLoRA model (``prepare_model_for_kbit_training``) with every LoRA tensor random; saved to ``out``."""
    hf = peft.prepare_model_for_kbit_training(hf_quantized(tiny, spec), use_gradient_checkpointing=False)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, p in sorted(pm.named_parameters()):
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(out)
    return pm.train()


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), IDS[:, 1:].reshape(-1))


@pytest.mark.parametrize("name", ["nf4-double", "int8"])
def test_lora_step_equals_peft_on_their_quantized_model(tiny, tmp_path, name):
    spec = SPECS[name]
    pm = _peft_on_quantized(tiny, spec, tmp_path / "adapter")
    ours = load_pretrained(tiny)
    inject_lora(ours, read_adapter(tmp_path / "adapter")[0])
    load_adapter(ours, tmp_path / "adapter", inject=False)
    quantize_base(ours, spec, torch.device("cpu"))
    ours.train()
    theirs = {n.replace("base_model.model.", "").replace(".default", ""): p
              for n, p in pm.named_parameters() if p.requires_grad}
    mine = dict((n, p) for n, p in ours.named_parameters() if p.requires_grad)
    assert sorted(mine) == sorted(theirs) and len(mine) == 28
    opt_a = torch.optim.AdamW(list(mine.values()), lr=1e-2)
    opt_b = torch.optim.AdamW(list(theirs.values()), lr=1e-2)
    for step in range(2):
        loss_a, loss_b = _loss(ours(IDS)), _loss(pm(input_ids=IDS).logits)
        torch.testing.assert_close(loss_a, loss_b, atol=1e-5, rtol=1e-5, msg=f"step {step} loss")
        loss_a.backward()
        loss_b.backward()
        for n in mine:
            torch.testing.assert_close(mine[n].grad, theirs[n].grad, atol=1e-5, rtol=1e-4, msg=f"step {step} {n}")
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    for n in mine:
        torch.testing.assert_close(mine[n], theirs[n], atol=1e-5, rtol=1e-4, msg=n)


def test_quantized_run_adapter_loads_in_peft_on_their_quantized_model(quickstart_cache, tmp_path):
    spec = QuantSpec("nf4", double_quant=True)
    recipe = load_recipe(QUICKSTART, [*FAST, f"output.dir={tmp_path}", "model.quantization.method=nf4",
                                      "model.quantization.double_quant=true"])
    summary = trainer.run(recipe)
    final = Path(summary["output"])
    losses = [h["train_loss"] for h in summary["history"]]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    plain_run = trainer.run(load_recipe(QUICKSTART, [*FAST, f"output.dir={tmp_path / 'plain'}"]))
    plain_losses = [h["train_loss"] for h in plain_run["history"]]
    assert abs(losses[0] - plain_losses[0]) > 1e-4, (losses, plain_losses)  # trained on the quantized base
    assert abs(losses[0] - plain_losses[0]) < 0.05 * plain_losses[0]
    base = Path(resolve_model_path("builtin:tiny-llama"))
    n_base = sum(p.numel() for p in load_pretrained(base).parameters())
    assert summary["parameters"] == n_base + summary["trainable_parameters"]  # 4-bit weights at their own size
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] and cfg["r"] == 16
    pm = peft.PeftModel.from_pretrained(hf_quantized(base, spec), final).train()
    ours = load_pretrained(base)
    load_adapter(ours, final)
    assert {f"{n}.base_layer" for n, _ in lora_modules(ours)} == {n for n, _ in quantizable(ours)}  # all-linear
    quantize_base(ours, spec, torch.device("cpu"))
    ids = IDS % 100
    with torch.no_grad():
        mine = ours.train()(ids)
        theirs = pm(input_ids=ids).logits
        plain = hf_quantized(base, spec)(input_ids=ids).logits
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert (theirs - plain).abs().max() > 1e-4  # the trained adapter changes the logits


def test_merge_folds_into_the_full_precision_base_and_metadata_records_the_quantization(
        quickstart_cache, tmp_path, capsys):
    quant = ["model.quantization.method=nf4", "model.quantization.double_quant=true",
             "model.quantization.compute_dtype=bfloat16"]
    merged = Path(trainer.run(load_recipe(QUICKSTART, [*FAST, *quant, f"output.dir={tmp_path / 'm'}",
                                                       "checkpoint.save_mode=merged"]))["output"])
    both = Path(trainer.run(load_recipe(QUICKSTART, [*FAST, *quant, f"output.dir={tmp_path / 'b'}",
                                                     "checkpoint.save_mode=base_and_adapter"]))["output"])
    recorded = trained_quantization(both / "adapter")
    assert recorded is not None and {k: recorded[k] for k in ("method", "double_quant", "compute_dtype", "block_size",
                                                              "library")} == {
        "method": "nf4", "double_quant": True, "compute_dtype": "bfloat16", "block_size": 64, "library": "bitsandbytes"}
    base = Path(resolve_model_path("builtin:tiny-llama"))
    # the field's merge onto the original base: peft's merge_and_unload on transformers' unquantized model
    expected = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                              both / "adapter").merge_and_unload().state_dict()
    got = load_file(merged / "model.safetensors")
    q_key = "model.layers.0.self_attn.q_proj.weight"
    assert set(got) <= set(expected) and q_key in got
    for key, t in got.items():
        torch.testing.assert_close(t, expected[key], atol=1e-6, rtol=1e-6, msg=key)
    dequantized = hf_quantized(base, SPECS["nf4-double"]).get_submodule(q_key.removesuffix(".weight"))
    from bitsandbytes.functional import dequantize_4bit

    delta = got[q_key] - load_file(base / "model.safetensors")[q_key]
    on_4bit = dequantize_4bit(dequantized.weight.data, dequantized.weight.quant_state) + delta
    assert (on_4bit - got[q_key]).abs().max() > 1e-3  # not the dequantized 4-bit base
    code, out, err = run_cli(capsys, "merge", "--adapter", str(both / "adapter"), "--base", "builtin:tiny-llama",
                             "--out", str(tmp_path / "cli-merged"))
    assert code == 0, err
    assert ("(the full-precision base, from its checkpoint files; the adapter was trained on its nf4 (double_quant "
            "true, compute_dtype \"bfloat16\", block_size 64; bitsandbytes ") in out
    for key, t in load_file(tmp_path / "cli-merged" / "model.safetensors").items():
        assert torch.equal(t, got[key]), key


@pytest.mark.parametrize("method", ["nf4-double", "fp4", "int8"])
def test_validate_estimates_the_quantized_base_as_held(quickstart_cache, method):
    """``validate``'s weights part with ``model.quantization`` against the bytes our quantized model
    holds (packed weights, block scales, everything left in fp32, the fp32 adapter)."""
    spec = SPECS[method]
    overrides = [f"model.quantization.method={spec.method}"] + (
        ["model.quantization.double_quant=true"] if spec.double_quant else [])
    recipe = load_recipe(QUICKSTART, overrides)
    estimate = run_checks(recipe).memory["weights"]
    plain = run_checks(load_recipe(QUICKSTART)).memory["weights"]
    model = load_pretrained(Path(resolve_model_path("builtin:tiny-llama")))
    inject_lora(model, LoraConfig.from_section(recipe.lora))
    quantize_base(model, spec, torch.device("cpu"))
    held = held_bytes(model)
    assert estimate == pytest.approx(held, rel=0.01), (estimate, held)
    assert estimate < 0.6 * plain


def test_loading_quantizes_each_linear_as_soon_as_its_weight_is_read(tiny):
    """``quantize_on_load`` as the engine hands it to the checkpoint reader: no weight read in the
    file's dtype waits for the rest of the model before it is quantized, and nothing keeps the
    checkpoint's memory map."""
    model = build_model(DecoderConfig.from_hf(tiny))  # on the meta device
    inject_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    linears = [m for _, m in quantizable(model)]
    quantize = quantize_on_load(model, SPECS["nf4-double"], torch.device("cpu"))
    waiting = []

    def on_loaded(module: torch.nn.Module, attr: str) -> None:
        quantize(module, attr)
        waiting.append(sum(not is_quantized(m) and m.weight.device.type != "meta" for m in linears))

    materialize(model, tiny, name_map=base_param_name, on_loaded=on_loaded)
    assert len(linears) == 14 and all(is_quantized(m) for m in linears) and max(waiting) == 0
    # every other tensor read has memory of its own, not a view of the checkpoint's memory map
    # (which would keep the pages the quantization read resident); a plain load keeps views
    kept = [n for n, p in model.named_parameters() if not p.requires_grad and p.dtype.is_floating_point]
    assert kept and all(model.get_parameter(n).untyped_storage().resizable() for n in kept)
    plain = load_pretrained(tiny)
    assert not any(plain.get_parameter(n.replace(".base_layer", "")).untyped_storage().resizable() for n in kept)
    reference = load_pretrained(tiny).requires_grad_(False)
    quantize_base(reference, SPECS["nf4-double"], torch.device("cpu"))
    torch.testing.assert_close(model.train()(IDS), reference.train()(IDS), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["nf4-double", "int8"])
def test_dequantized_weight_is_what_the_matmul_multiplies(tiny, name):
    model = load_pretrained(tiny).requires_grad_(False)
    quantize_base(model, SPECS[name], torch.device("cpu"))
    layer = model.get_submodule("model.layers.0.mlp.down_proj")
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
    w = dequantized_weight(layer)
    assert w.shape == (layer.out_features, layer.in_features) and w.dtype == torch.float32
    tol = 1e-5 if SPECS[name].four_bit else 0.05  # int8 in eval: LLM.int8()'s integer matmul of the input too
    torch.testing.assert_close(layer.train()(x), x @ w.T, atol=tol, rtol=tol)
    assert dequantized_weight(model.lm_head) is model.lm_head.weight.detach() or torch.equal(
        dequantized_weight(model.lm_head), model.lm_head.weight)

"""What a quantized base holds (``model.quantization``), structurally; the numbers are
``bench/bench_qlora.py``'s:

- loading reads the checkpoint without a memory map, so the pages the quantization reads are not
  kept resident while the rest of the file is read (each weight in the file's dtype is held alone,
  then freed), and the quantized model equals a mapped load's quantization.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from qlora_helpers import FAST, QUICKSTART, SPECS

import nxd_finetune.lora.quantized as quantized
from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.lora import LoraConfig, base_param_name, inject_lora
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, materialize
from nxd_finetune.recipe import load_recipe
from nxd_finetune.sft.engine import build_engine

pytest.importorskip("bitsandbytes")  # the [qlora] extra (in .[dev])
MAPS = Path("/proc/self/maps")
QUANT = ["model.quantization.method=nf4", "model.quantization.double_quant=true"]
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def _mapped(model_dir: Path) -> bool:
    """Whether a file of ``model_dir`` is memory-mapped in this process now."""
    return str(model_dir.resolve()) in MAPS.read_text()


@pytest.mark.skipif(not MAPS.exists(), reason="reads /proc/self/maps (Linux)")
def test_a_quantized_run_reads_its_checkpoint_without_a_memory_map(quickstart_cache, tmp_path, monkeypatch):
    """Each time the engine quantizes a weight as it is read, no checkpoint file is mapped (a
    mapped read would keep resident every page the quantization has read so far, the whole base in
    the file's dtype by the end of the file). A plain load does map it (the check can see one)."""
    recipe = load_recipe(QUICKSTART, [*FAST, *QUANT, f"output.dir={tmp_path}"])
    model_dir = resolve_model_dir(recipe.model.path)
    seen: list[bool] = []
    quantize = quantized.quantize_module

    def observed(module: torch.nn.Module, spec: quantized.QuantSpec, device: torch.device) -> None:
        seen.append(_mapped(model_dir))
        quantize(module, spec, device)

    monkeypatch.setattr(quantized, "quantize_module", observed)
    engine = build_engine(recipe, model_dir, torch.device("cpu"), 1)
    assert len(seen) == 4 * 7 and not any(seen)
    assert sum(quantized.is_quantized(m) for m in engine.model.modules()) == 4 * 7

    plain = build_model(DecoderConfig.from_hf(model_dir))
    materialize(plain, model_dir, on_loaded=lambda module, attr: seen.append(_mapped(model_dir)))
    assert seen[-1]  # the default (mapped) read, as an unquantized run loads


def test_an_unmapped_load_quantizes_to_the_same_model(tiny_llama_dir):
    model = build_model(DecoderConfig.from_hf(tiny_llama_dir))
    inject_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    materialize(model, tiny_llama_dir, name_map=base_param_name, mapped=False,
                on_loaded=quantized.quantize_on_load(model, SPECS["nf4-double"], torch.device("cpu")))
    reference = load_pretrained(tiny_llama_dir).requires_grad_(False)
    quantized.quantize_base(reference, SPECS["nf4-double"], torch.device("cpu"))
    torch.testing.assert_close(model.train()(IDS), reference.train()(IDS), atol=0, rtol=0)
    unquantized = load_pretrained(tiny_llama_dir)
    unmapped = build_model(DecoderConfig.from_hf(tiny_llama_dir))
    materialize(unmapped, tiny_llama_dir, mapped=False)
    for name, p in unquantized.named_parameters():
        assert torch.equal(unmapped.get_parameter(name), p), name


@pytest.mark.parametrize("double_quant", [False, True])
def test_a_4bit_linear_is_quantized_a_chunk_at_a_time_to_bitsandbytes_bytes(double_quant, monkeypatch):
    """Each ``quantize_4bit`` call of a linear's quantization gets at most ``QUANTIZE_CHUNK_ELEMENTS``
    elements (its CPU kernel holds several fp32 copies of its input: the whole weight at once was
    the load's largest temporary), and the packed bytes and state equal bitsandbytes' ``Params4bit``
    quantizing the whole weight at once, a last chunk of less than a block included."""
    bnb = pytest.importorskip("bitsandbytes")
    functional = bnb.functional
    monkeypatch.setattr(quantized, "QUANTIZE_CHUNK_ELEMENTS", 5 * 64, raising=False)
    seen: list[int] = []
    quantize_4bit = functional.quantize_4bit

    def spy(a: torch.Tensor, *args: object, **kwargs: object) -> object:
        seen.append(a.numel())
        return quantize_4bit(a, *args, **kwargs)

    monkeypatch.setattr(functional, "quantize_4bit", spy)
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 41, bias=False, dtype=torch.bfloat16).requires_grad_(False)  # 3936 = 61.5 blocks
    weight = linear.weight.detach().clone()
    spec = quantized.QuantSpec("nf4", double_quant=double_quant, compute_dtype="bfloat16")
    quantized.quantize_module(linear, spec, torch.device("cpu"))
    assert seen and max(seen) <= 5 * 64, seen
    monkeypatch.setattr(functional, "quantize_4bit", quantize_4bit)
    ref = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=double_quant,
                            quant_storage=torch.uint8).to("cpu")
    got, state = linear.weight, linear.weight.quant_state
    assert got.shape == ref.shape and torch.equal(got.data, ref.data)
    assert torch.equal(state.absmax, ref.quant_state.absmax) and state.nested == double_quant
    assert state.shape == ref.quant_state.shape and state.dtype == ref.quant_state.dtype
    if double_quant:
        assert torch.equal(state.offset, ref.quant_state.offset)
        assert torch.equal(state.state2.absmax, ref.quant_state.state2.absmax)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    assert torch.equal(linear(x), bnb.matmul_4bit(x, ref, quant_state=ref.quant_state))

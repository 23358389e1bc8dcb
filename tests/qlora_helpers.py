"""Helpers of the QLoRA tests (``test_qlora``, ``test_qlora_layouts``, ``test_qlora_dora``):
transformers' quantized model, the recipes and the gloo workers of the layout runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.lora import lora_modules
from nxd_finetune.lora.quantized import DTYPES, QuantSpec, dequantized_weight, is_quantized
from nxd_finetune.parallel.placement import Placement, gather_full
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.sft import trainer
from nxd_finetune.sft.engine import build_engine

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
FAST = ["data.max_seq_len=64", "training.max_steps=3", "training.micro_batch_size=2", "training.warmup_steps=1",
        "logging.progress=false", "logging.every_n_steps=1", "eval.every_n_steps=null", "checkpoint.every_n_steps=null"]
SPECS = {
    "nf4-double": QuantSpec("nf4", double_quant=True),
    "fp4": QuantSpec("fp4"),
    "nf4-bf16-compute": QuantSpec("nf4", compute_dtype="bfloat16", block_size=64),
    "int8": QuantSpec("int8"),
}
BASE = ["data.max_seq_len=64", "training.max_steps=4", "training.micro_batch_size=2", "training.warmup_steps=1",
        "training.eps=1e-6", "logging.progress=false", "logging.every_n_steps=1", "eval.every_n_steps=null",
        "checkpoint.every_n_steps=2", "checkpoint.keep_last=2"]
QUANT = {"nf4": ["model.quantization.method=nf4", "model.quantization.double_quant=true"],
         "fp4": ["model.quantization.method=fp4", "model.quantization.double_quant=true"],
         "int8": ["model.quantization.method=int8"]}
"""The layout runs' ``model.quantization`` per method (int8 takes none of the 4-bit settings)."""


def hf_quantized(path: Path, spec: QuantSpec) -> torch.nn.Module:
    """transformers' model of ``path`` quantized by bitsandbytes with ``spec``'s settings."""
    kw = spec.bnb_config()
    if "bnb_4bit_compute_dtype" in kw:
        kw["bnb_4bit_compute_dtype"] = DTYPES[str(kw["bnb_4bit_compute_dtype"])]
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**kw),
                                                dtype=torch.float32, device_map="cpu",
                                                attn_implementation="eager").train()


def recipe(out: Path, nproc: int, *overrides: str, method: str = "nf4"):
    return load_recipe(QUICKSTART, [*BASE, *QUANT[method], f"parallel.nproc={nproc}", f"output.dir={out}",
                                    *overrides])


def _bnb_quantized(piece: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """bitsandbytes' quantized bytes of ``piece`` (a weight, or a shard's slice of one) with ``spec``:
    ``quantize_4bit`` as ``Params4bit`` calls it, or ``int8_vectorwise_quant`` of its fp16 values
    as ``Int8Params`` does."""
    import bitsandbytes.functional as bnbf

    if spec.four_bit:
        return bnbf.quantize_4bit(piece.contiguous(), blocksize=spec.block_size, quant_type=spec.method,
                                  compress_statistics=spec.double_quant)[0]
    return bnbf.int8_vectorwise_quant(piece.contiguous().to(torch.float16))[0]


def _shard_checks(recipe_dict: dict, dequantized_dir: str) -> dict[str, bool]:
    """This tp rank's quantized shards against bitsandbytes' quantization of its slice of the full
    weight; rank 0 writes the base with every quantized weight replaced by its shards' dequantized
    values, gathered (the numbers the tp2 run computes with)."""
    from nxd_finetune.models import load_pretrained

    r = recipe_from_dict(recipe_dict)
    assert r.model.quantization is not None
    quant = QuantSpec.from_section(r.model.quantization)
    model_dir = resolve_model_dir(r.model.path)
    engine = build_engine(r, model_dir, torch.device("cpu"), total_steps=1)
    full = load_pretrained(model_dir)
    out, dequantized = {}, {}
    for name, m in lora_modules(engine.modules[0]):
        base = m.base_layer
        out[f"{name} quantized"] = is_quantized(base)
        spec: Placement = base.placements["weight"]
        piece = spec.take(full.get_submodule(name).weight.detach())
        state = getattr(base.weight, "quant_state", None)  # 4-bit: the unpacked shape; int8: the weight's own
        shape = tuple(base.weight.shape if state is None else state.shape)
        out[f"{name} shard shape"] = shape == tuple(piece.shape) != spec.full_shape
        out[f"{name} bytes"] = torch.equal(base.weight.data, _bnb_quantized(piece, quant))
        local = dequantized_weight(base)
        dequantized[f"{name}.weight"] = gather_full(local, spec, engine.state).contiguous()
    if engine.state.rank == 0:
        shutil.copytree(model_dir, dequantized_dir)
        tensors = {**load_file(model_dir / "model.safetensors"), **dequantized}
        save_file(tensors, Path(dequantized_dir) / "model.safetensors", metadata={"format": "pt"})
    return out


def _worker(recipe_dicts: list[dict], shard_recipe: dict, dequantized_dir: str
            ) -> tuple[list[dict | None], dict[str, bool]]:
    torch.set_num_threads(1)
    summaries = [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]
    return summaries, _shard_checks(shard_recipe, dequantized_dir)


def _curve(summary: dict) -> torch.Tensor:
    return torch.tensor([h["train_loss"] for h in summary["history"]], dtype=torch.float64)


def _adapter(summary: dict) -> dict[str, torch.Tensor]:
    return load_file(Path(summary["output"]) / "adapter_model.safetensors")


def _same(name: str, got: dict, ref: dict) -> None:
    a, b = _curve(got), _curve(ref)
    assert a.shape == b.shape == (4,), name
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (name, a.tolist(), b.tolist())
    ta, tb = _adapter(got), _adapter(ref)
    assert ta.keys() == tb.keys(), name
    for k in tb:
        diff = (ta[k] - tb[k]).abs().max().item()
        assert diff <= 2e-5, (name, k, diff)


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes a (quantized) model holds: its parameters' data plus bitsandbytes' block scales
    (4-bit ``quant_state`` absmax, double quantization's second level) and LLM.int8()'s ``SCB``."""
    held = 0
    for p in model.parameters():
        held += p.data.nbytes
        state = getattr(p, "quant_state", None)
        for t in (state.absmax, getattr(state.state2, "absmax", None)) if state is not None else ():
            held += t.nbytes if t is not None else 0
        scales = getattr(p, "SCB", None)
        held += scales.nbytes if scales is not None else 0
    return held

"""``model.quantization.embeddings``: the input embedding and the output layer in 4 bits
(bitsandbytes' ``Params4bit``), the tied pair sharing one quantized weight.

- the quantized bytes and block scales are bitsandbytes' ``quantize_4bit`` of the whole weight
  (quantized a chunk of rows at a time, double quantization over all of them); a lookup equals
  bitsandbytes' ``Embedding4bit`` (without double quantization, which it does not read) and the
  weight's full dequantization indexed; the head equals ``matmul_4bit`` (``Linear4bit``'s call),
  forward and the input's gradient, while no dequantized piece larger than one chunk of rows exists;
- a tied run with it equals, within 1e-5 (four losses and AdamW steps, the merged adapter), the
  same run on the base whose embedding is that dequantization, and differs from the run with the
  embedding in full precision; ``save_mode: merged`` writes the original embedding;
- pp2 equals one process (1e-5); tp2 quantizes each rank's vocabulary shard (bitsandbytes' bytes
  of its slice) and starts within 2% of one process;
- ``validate``'s weights part equals the bytes the quantized model holds (1%);
- the engine's load quantizes the embedding as soon as it is read, before any decoder linear;
- int8, LoRA or ``modules_to_save`` on the embedding or head, a hidden size the block size does
  not divide: one line each.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from qlora_helpers import _curve, _same, held_bytes, recipe
from safetensors.torch import load_file, save_file
from torch import nn

import nxd_finetune.lora.quantized as quantized
from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.errors import NxdError, RecipeError
from nxd_finetune.lora import LoraConfig, inject_lora
from nxd_finetune.lora import quantized_embedding as qe
from nxd_finetune.lora.quantized import QuantSpec, quantize_base
from nxd_finetune.models import load_pretrained
from nxd_finetune.parallel.launch import launch
from nxd_finetune.preflight.report import run_checks
from nxd_finetune.quickstart import resolve_model_path
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.sft import trainer
from nxd_finetune.sft.engine import build_engine

bnb = pytest.importorskip("bitsandbytes")
CPU = torch.device("cpu")
EMB = ["model.quantization.embeddings=true"]
SPECS = {"nf4": QuantSpec("nf4", embeddings=True), "nf4-double": QuantSpec("nf4", double_quant=True, embeddings=True),
         "fp4": QuantSpec("fp4", embeddings=True)}

pytestmark = pytest.mark.usefixtures("workers_tmpdir")


class _Tied(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(*weight.shape).requires_grad_(False)
        self.embed_tokens.weight.data.copy_(weight)
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.lm_head.weight = self.embed_tokens.weight


@pytest.fixture(scope="module")
def tied(quickstart_cache, tmp_path_factory) -> Path:
    """The quickstart's tiny Llama with tied embeddings (its checkpoint without ``lm_head.weight``)."""
    out = tmp_path_factory.mktemp("tied") / "model"
    shutil.copytree(Path(resolve_model_path("builtin:tiny-llama")), out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tensors = load_file(out / "model.safetensors")
    tensors.pop("lm_head.weight")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_the_quantized_embedding_and_head_are_bitsandbytes(name, monkeypatch):
    spec = SPECS[name]
    torch.manual_seed(0)
    weight = torch.randn(1000, 128)
    model = _Tied(weight)
    monkeypatch.setattr(quantized, "QUANTIZE_CHUNK_ELEMENTS", 300 * 128)  # quantized 300 rows at a time
    assert qe.quantize_embeddings(model, spec, CPU) == ["embed_tokens", "lm_head"]
    packed = model.embed_tokens.weight
    assert model.lm_head.weight is packed  # the tied pair: one quantized weight
    ref, state = bnb.functional.quantize_4bit(weight, blocksize=64, quant_type=spec.method,
                                              compress_statistics=spec.double_quant)
    assert torch.equal(packed.data, ref)  # bitsandbytes' bytes and scales of the whole weight at once
    assert torch.equal(packed.quant_state.absmax, state.absmax) and packed.quant_state.nested == spec.double_quant
    full = bnb.functional.dequantize_4bit(ref, state)
    ids = torch.randint(0, 1000, (3, 7))
    assert torch.equal(model.embed_tokens(ids), full[ids])
    if not spec.double_quant:  # bitsandbytes' Embedding4bit reads no double-quantized scales
        emb = bnb.nn.Embedding4bit(1000, 128, quant_type=spec.method)
        emb.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=spec.method,
                                       compress_statistics=False, module=emb)
        assert torch.equal(model.embed_tokens(ids), emb.to("cpu")(ids))
    sizes: list[int] = []
    dequantize = bnb.functional.dequantize_4bit

    def recorded(a: torch.Tensor, quant_state: object) -> torch.Tensor:
        out = dequantize(a, quant_state)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(qe, "CHUNK_BYTES", 100 * 128 * 4)  # 100 rows a chunk
    monkeypatch.setattr(bnb.functional, "dequantize_4bit", recorded)
    x = torch.randn(2, 5, 128, requires_grad=True)
    out = model.lm_head(x)
    out.square().sum().backward()
    assert sizes and max(sizes) == 100 * 128, sizes  # forward and backward: one chunk of rows at a time
    monkeypatch.setattr(bnb.functional, "dequantize_4bit", dequantize)
    x_ref = x.detach().clone().requires_grad_(True)
    out_ref = bnb.matmul_4bit(x_ref, packed.t(), quant_state=packed.quant_state)  # Linear4bit's call
    out_ref.square().sum().backward()
    assert torch.allclose(out, out_ref, rtol=1e-5, atol=1e-5)
    assert x.grad is not None and x_ref.grad is not None
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5 * x_ref.grad.abs().max().item())


def _dequantized_copy(tied: Path, out: Path) -> tuple[torch.Tensor, Path]:
    """The tied checkpoint with its embedding replaced by the run's quantization dequantized."""
    r = recipe(out / "engine", 1, f"model.path={tied}", *EMB)
    engine = build_engine(r, tied, CPU, total_steps=1)
    model = engine.modules[0]
    weight = model.model.embed_tokens.weight
    assert model.lm_head.weight is weight and weight.quant_state.nested  # nf4, double quantization
    original = load_file(tied / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(weight.data, bnb.functional.quantize_4bit(original, blocksize=64, quant_type="nf4",
                                                                 compress_statistics=True)[0])
    shutil.copytree(tied, out / "dequantized")
    tensors = load_file(tied / "model.safetensors")
    tensors["model.embed_tokens.weight"] = bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    save_file(tensors, out / "dequantized" / "model.safetensors", metadata={"format": "pt"})
    return original, out / "dequantized"


def test_a_tied_run_equals_one_on_its_dequantized_embedding_and_merges_into_the_original(tied, tmp_path):
    original, dequantized = _dequantized_copy(tied, tmp_path)
    merged = ["checkpoint.save_mode=merged", "training.grad_accum=2"]
    got = trainer.run(recipe(tmp_path / "q", 1, f"model.path={tied}", *EMB, *merged))
    ref = trainer.run(recipe(tmp_path / "ref", 1, f"model.path={dequantized}", *merged))
    plain = trainer.run(recipe(tmp_path / "plain", 1, f"model.path={tied}", *merged))
    assert torch.allclose(_curve(got), _curve(ref), rtol=1e-5, atol=0), (_curve(got), _curve(ref))
    assert not torch.allclose(_curve(got), _curve(plain), rtol=1e-5, atol=0)  # it trained on the 4-bit embedding
    ours, theirs = (load_file(Path(s["output"]) / "model.safetensors") for s in (got, ref))
    assert torch.equal(ours["model.embed_tokens.weight"], original)  # the full-precision base, not the 4-bit one
    assert ours.keys() == theirs.keys()
    for key in ours.keys() - {"model.embed_tokens.weight"}:
        assert torch.allclose(ours[key], theirs[key], rtol=0, atol=2e-5), key


def _worker(recipe_dicts: list[dict], shard_recipe: dict) -> tuple[list[dict | None], dict[str, bool]]:
    torch.set_num_threads(1)
    summaries = [trainer.run_rank(recipe_from_dict(d)) for d in recipe_dicts]
    r = recipe_from_dict(shard_recipe)
    model_dir = resolve_model_dir(r.model.path)
    engine = build_engine(r, model_dir, CPU, total_steps=1)
    model = engine.modules[0]
    emb = model.model.embed_tokens
    full = load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]
    piece = full[emb.vocab_start:emb.vocab_end]
    ref = bnb.functional.quantize_4bit(piece.contiguous(), blocksize=64, quant_type="nf4", compress_statistics=True)[0]
    return summaries, {"tied shard": model.lm_head.weight is emb.weight,
                       "shard shape": tuple(emb.weight.quant_state.shape) == tuple(piece.shape) != tuple(full.shape),
                       "shard bytes": torch.equal(emb.weight.data, ref)}


def test_tp2_and_pp2_with_a_quantized_embedding(tied, tmp_path):
    layouts = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"]}
    common = [f"model.path={tied}", *EMB, "training.grad_accum=2"]
    ref = trainer.run(recipe(tmp_path / "ref", 1, *common))
    dicts = [recipe(tmp_path / name, 2, *common, *layout).to_dict() for name, layout in layouts.items()]
    shard = recipe(tmp_path / "shards", 2, *common, "parallel.tp=2").to_dict()
    results = launch(_worker, 2, dicts, shard, start_method="fork")
    for rank, (_, checks) in enumerate(results):
        assert all(checks.values()), (rank, checks)
    summaries = dict(zip(layouts, results[0][0], strict=True))
    _same("pp2", summaries["pp2"], ref)
    first_tp2, first_ref = summaries["tp2"]["history"][0]["train_loss"], ref["history"][0]["train_loss"]
    assert first_tp2 != first_ref and abs(first_tp2 - first_ref) < 2e-2 * first_ref


def test_loading_quantizes_the_embedding_as_soon_as_it_is_read(tied, tmp_path, monkeypatch):
    """The engine's load quantizes the (tied) embedding when its weight is read, before any decoder
    linear (its weight in the file's dtype is not held to the end of the load), once; the tied
    head then shares the quantized weight."""
    events: list[str] = []
    by_rows, quantize_module = qe.quantized_by_rows, quantized.quantize_module

    def embedding(weight: torch.Tensor, spec: QuantSpec) -> nn.Parameter:
        events.append("embedding")
        return by_rows(weight, spec)

    def linear(module: nn.Module, spec: QuantSpec, device: torch.device) -> None:
        events.append("linear")
        quantize_module(module, spec, device)

    monkeypatch.setattr(qe, "quantized_by_rows", embedding)
    monkeypatch.setattr(quantized, "quantize_module", linear)
    r = recipe(tmp_path, 1, f"model.path={tied}", *EMB)
    model = build_engine(r, resolve_model_dir(r.model.path), CPU, total_steps=1).modules[0]
    assert events[0] == "embedding" and events.count("embedding") == 1, events
    assert events.count("linear") == sum(quantized.is_quantized(m) for m in model.modules()) > 0
    assert isinstance(model.lm_head, qe.QuantizedHead) and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight_dtype == torch.float32


def test_validate_counts_the_quantized_embedding_as_held(tied):
    r = recipe(Path("unused"), 1, f"model.path={tied}", *EMB)
    estimate = run_checks(r).memory["weights"]
    without = run_checks(recipe(Path("unused"), 1, f"model.path={tied}")).memory["weights"]
    model = load_pretrained(tied)
    assert r.lora is not None and r.model.quantization is not None
    inject_lora(model, LoraConfig.from_section(r.lora))
    spec = QuantSpec.from_section(r.model.quantization)
    quantize_base(model, spec, CPU)
    qe.quantize_embeddings(model, spec, CPU)
    held = held_bytes(model)
    assert estimate == pytest.approx(held, rel=0.01), (estimate, held)
    assert estimate < 0.8 * without


def test_refusals_are_one_line(tied, tmp_path):
    with pytest.raises(RecipeError, match="embeddings needs a 4-bit method") as e:
        recipe(tmp_path, 1, "model.quantization.method=int8", "model.quantization.double_quant=false", *EMB,
               method="int8")
    assert "\n" not in str(e.value)
    with pytest.raises(RecipeError, match="lora on lm_head with model.quantization.embeddings"):
        recipe(tmp_path, 1, *EMB, "lora.modules_to_save=[lm_head]")
    with pytest.raises(NxdError, match="hidden size 256 does not divide by block_size 512") as e:
        trainer.run(recipe(tmp_path / "run", 1, f"model.path={tied}", *EMB, "model.quantization.block_size=512"))
    assert "\n" not in str(e.value)
    gap = qe.embedding_gap(2048, dataclasses.replace(SPECS["nf4"], block_size=4096))
    assert gap is not None and "2048" in gap


def test_generate_and_eval_quantize_the_embedding_as_trained(tied, tmp_path):
    from nxd_finetune.lora import load_adapter
    from nxd_finetune.serve.evaluate import evaluate_recipe
    from nxd_finetune.serve.generate import load_model

    adapter = Path(trainer.run(recipe(tmp_path / "run", 1, f"model.path={tied}", *EMB))["output"])
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(7))
    with load_model(str(adapter), device="cpu") as loaded, torch.no_grad():
        got = loaded.model(input_ids=ids).logits
        assert "embeddings true" in loaded.description
        assert isinstance(loaded.model.get_input_embeddings(), qe.QuantizedEmbedding)
    ours = load_pretrained(tied)
    load_adapter(ours, adapter)
    spec = SPECS["nf4-double"]
    quantize_base(ours, spec, CPU)
    qe.quantize_embeddings(ours, spec, CPU)
    with torch.no_grad():
        torch.testing.assert_close(got, ours.train()(ids), atol=1e-5, rtol=1e-5)  # the training side's model
    without = load_pretrained(tied)
    load_adapter(without, adapter)
    quantize_base(without, spec, CPU)
    with torch.no_grad():
        assert (without.train()(ids) - got).abs().max() > 1e-4  # the embedding in 4 bits changes the logits
    evals = ["eval.max_batches=2", "data.max_seq_len=64"]
    as_trained = evaluate_recipe(recipe(tmp_path / "e1", 1, f"model.path={tied}", "model.quantization=null", *evals),
                                 str(adapter))["eval_loss"]
    assert as_trained == evaluate_recipe(recipe(tmp_path / "e2", 1, f"model.path={tied}", *EMB, *evals),
                                         str(adapter))["eval_loss"]

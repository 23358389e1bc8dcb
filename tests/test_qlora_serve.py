"""``generate`` / ``chat`` / ``eval`` with an adapter trained on a quantized base (QLoRA): the base
is quantized as the adapter's metadata records it was trained on, so the adapter behaves as
trained; ``--full-precision`` loads it unquantized.

- the logits ``generate`` computes with equal peft's on transformers' model quantized by
  bitsandbytes with the same ``BitsAndBytesConfig`` and the training side's quantized model (1e-5),
  and differ from those on the unquantized base (``full_precision``);
- ``nxd-finetune generate`` runs on it, with and without ``--full-precision``; unreadable recorded
  settings are refused in one line;
- ``eval`` scores it on the recorded quantization whatever the recipe says (the same loss as a
  recipe with that quantization), and on the unquantized base with ``full_precision``.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
from cli_run import run_cli
from qlora_helpers import FAST, QUICKSTART, SPECS, hf_quantized
from safetensors.torch import load_file, save_file

from nxd_finetune.lora import load_adapter
from nxd_finetune.lora.quantized import METADATA_KEY, quantize_base
from nxd_finetune.models import load_pretrained
from nxd_finetune.quickstart import resolve_model_path
from nxd_finetune.recipe import load_recipe
from nxd_finetune.serve.evaluate import evaluate_recipe
from nxd_finetune.serve.generate import load_model
from nxd_finetune.sft import trainer

pytest.importorskip("bitsandbytes")  # the [qlora] extra (in .[dev])

QUANT = ["model.quantization.method=nf4", "model.quantization.double_quant=true"]
IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def adapter(quickstart_cache: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qlora-serve")
    return Path(trainer.run(load_recipe(QUICKSTART, [*FAST, *QUANT, f"output.dir={out}"]))["output"])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_generate_loads_the_base_quantized_as_the_adapter_was_trained(adapter):
    base = Path(resolve_model_path("builtin:tiny-llama"))
    with load_model(str(adapter), device="cpu") as loaded:
        got = _logits(loaded.model)
        description = loaded.description
    theirs = _logits(peft.PeftModel.from_pretrained(hf_quantized(base, SPECS["nf4-double"]), adapter).train())
    torch.testing.assert_close(got, theirs, atol=1e-5, rtol=1e-5)  # transformers + bitsandbytes, same settings
    ours = load_pretrained(base)
    load_adapter(ours, adapter)
    quantize_base(ours, SPECS["nf4-double"], torch.device("cpu"))
    with torch.no_grad():
        torch.testing.assert_close(got, ours.train()(IDS), atol=1e-5, rtol=1e-5)  # the training side's model
    assert "on its nf4 (double_quant true, compute_dtype \"float32\", block_size 64; bitsandbytes" in description
    with load_model(str(adapter), device="cpu", full_precision=True) as loaded:
        full = _logits(loaded.model)
        assert "nf4" not in loaded.description
    assert (full - got).abs().max() > 1e-4  # the unquantized base gives other logits


def test_generate_cli_with_and_without_full_precision_and_bad_settings_refused(adapter, tmp_path, capsys):
    argv = ["generate", "--adapter", str(adapter), "--prompt", "7", "--max-new-tokens", "4", "--device", "cpu"]
    for extra in ([], ["--full-precision"]):
        code, out, err = run_cli(capsys, *argv, *extra)
        assert code == 0 and out.strip(), (extra, err)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in adapter.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    recorded = {"method": "nf5", "library": "bitsandbytes"}
    save_file(load_file(adapter / "adapter_model.safetensors"), bad / "adapter_model.safetensors",
              metadata={"format": "pt", METADATA_KEY: json.dumps(recorded)})
    code, out, err = run_cli(capsys, "generate", "--adapter", str(bad), "--prompt", "7", "--device", "cpu")
    line = err.strip()
    assert code == 2 and "\n" not in line and f"its {METADATA_KEY} metadata" in line and "nf5" in line, (code, err)


def test_eval_scores_on_the_recorded_quantization(adapter, tmp_path):
    plain = load_recipe(QUICKSTART, [*FAST, "eval.max_batches=2", f"output.dir={tmp_path / 'plain'}"])
    quant = load_recipe(QUICKSTART, [*FAST, *QUANT, "eval.max_batches=2", f"output.dir={tmp_path / 'quant'}"])
    as_trained = evaluate_recipe(plain, str(adapter))["eval_loss"]
    assert as_trained == evaluate_recipe(quant, str(adapter))["eval_loss"]
    full = evaluate_recipe(quant, str(adapter), full_precision=True)["eval_loss"]
    assert isinstance(as_trained, float) and isinstance(full, float) and abs(full - as_trained) > 1e-5

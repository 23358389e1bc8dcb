"""The one exporter (``nxd_finetune.export``): every save mode x layout writes the same files.

Each run starts from one random adapter (``lora.init_from``, B non-zero, so merging changes the
weights) and takes one optimizer step with ``lr=1e-30``, which leaves every weight as it was: all
layouts then hold the same values bit for bit, and their outputs must be the single-process
output byte for byte. Checked: LoRA in ``adapter`` / ``base_and_adapter`` / ``merged`` at 1
process, tp2, pp2 and dp2+ZeRO-1; full SFT at 1 process and tp2. The single-process outputs are
checked against the oracles: ``peft`` loads the adapter (alone and over ``base/``), ``transformers``
loads the merged and full checkpoints, and all give the same logits; the written checkpoints keep
the source's ``config.json`` (dtype key aside) and ``generation_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.lora import lora_modules, save_adapter
from nxd_finetune.parallel.launch import launch
from nxd_finetune.recipe import load_recipe, recipe_from_dict
from nxd_finetune.sft import trainer
from nxd_finetune.sft.engine import build_engine

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
BASE = ["data.max_seq_len=64", "training.max_steps=1", "training.micro_batch_size=2", "training.warmup_steps=0",
        "training.lr=1e-30", "logging.progress=false", "eval.every_n_steps=null", "eval.max_batches=1",
        "checkpoint.every_n_steps=null"]
LORA_MODES = ("adapter", "base_and_adapter", "merged")
LAYOUTS = {  # 4 rows per optimizer step in every layout
    "tp2": ["parallel.tp=2", "training.grad_accum=2"],
    "pp2": ["parallel.pp=2", "training.grad_accum=2"],
    "dp2-zero1": ["parallel.zero1=true", "training.grad_accum=1"],
}
SFT = ["lora=null"]

pytestmark = pytest.mark.usefixtures("workers_tmpdir")


def _recipe(out: Path, nproc: int, *overrides: str):
    return load_recipe(QUICKSTART, [*BASE, f"parallel.nproc={nproc}", f"output.dir={out}", *overrides])


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _run_all(dicts: list[dict]) -> list[dict | None]:
    torch.set_num_threads(1)
    return [trainer.run_rank(recipe_from_dict(d)) for d in dicts]


@pytest.fixture(scope="module")
def start_adapter(quickstart_cache, tmp_path_factory) -> Path:
    """A random all-linear r16 adapter of the quickstart model (non-zero B)."""
    out = tmp_path_factory.mktemp("start")
    rec = _recipe(out, 1, "training.grad_accum=2")
    engine = build_engine(rec, resolve_model_dir(rec.model.path), torch.device("cpu"), 1)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for _, m in lora_modules(engine.model):
            for p in (m.lora_A.weight, m.lora_B.weight):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return save_adapter(engine.model, engine.lora_config, out / "adapter", base_model_name_or_path=None)


@pytest.fixture(scope="module")
def single(start_adapter, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("single")
    runs = {mode: [f"checkpoint.save_mode={mode}", f"lora.init_from={start_adapter}"] for mode in LORA_MODES}
    runs["sft"] = SFT
    return {name: Path(trainer.run(_recipe(out / name, 1, "training.grad_accum=2", *extra))["output"])
            for name, extra in runs.items()}


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(ids).logits


def test_single_process_outputs_load_in_peft_and_transformers(single, quickstart_cache):
    import peft
    from transformers import AutoModelForCausalLM

    source = resolve_model_dir("builtin:tiny-llama")
    ids = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    hf = lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    adapter_cfg = json.loads((single["adapter"] / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(source)  # a builtin base is named by its directory
    with_adapter = _logits(peft.AutoPeftModelForCausalLM.from_pretrained(single["adapter"]), ids)
    over_base = _logits(peft.PeftModel.from_pretrained(hf(single["base_and_adapter"] / "base"),
                                                       single["base_and_adapter"] / "adapter"), ids)
    merged = _logits(hf(single["merged"]), ids)
    plain = _logits(hf(source), ids)
    assert (with_adapter - plain).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(over_base, with_adapter, rtol=0, atol=1e-6)
    torch.testing.assert_close(merged, with_adapter, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(hf(single["sft"]), ids), plain, rtol=0, atol=1e-6)  # lr=1e-30: unchanged

    src_config = json.loads((source / "config.json").read_text())
    for out in (single["merged"], single["sft"]):
        written = json.loads((out / "config.json").read_text())
        dtype_keys = [k for k in ("dtype", "torch_dtype") if k in src_config] or ["torch_dtype"]
        assert {k: v for k, v in written.items() if k not in dtype_keys} == \
            {k: v for k, v in src_config.items() if k not in dtype_keys}, out
        assert all(written[k] == "float32" for k in dtype_keys)
        assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    base = single["base_and_adapter"] / "base"
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (base / name).read_bytes() == (source / name).read_bytes(), name
    assert (single["merged"] / "tokenizer.json").is_file() and (base / "tokenizer.json").is_file()


def test_every_layout_writes_the_single_process_files(single, start_adapter, tmp_path):
    dicts, names = [], []
    for layout, overrides in LAYOUTS.items():
        for mode in LORA_MODES:
            names.append((layout, mode))
            dicts.append(_recipe(tmp_path / layout / mode, 2, *overrides, f"checkpoint.save_mode={mode}",
                                 f"lora.init_from={start_adapter}").to_dict())
    names.append(("tp2", "sft"))
    dicts.append(_recipe(tmp_path / "tp2" / "sft", 2, *LAYOUTS["tp2"], *SFT).to_dict())
    results = launch(_run_all, 2, dicts, start_method="fork")
    assert all(r is None for r in results[1])  # only global rank 0 writes
    for (layout, mode), summary in zip(names, results[0], strict=True):
        got, want = _files(Path(summary["output"])), _files(single[mode])
        assert got.keys() == want.keys(), (layout, mode, sorted(set(got) ^ set(want)))
        differ = [name for name in want if got[name] != want[name]]
        assert not differ, (layout, mode, differ)

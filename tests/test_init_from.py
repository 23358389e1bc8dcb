"""``lora.init_from`` and ``publish_run``: continuing from an adapter pulled from an S3 registry is
the same as continuing from the local directory; the start values are the adapter's (ours and
PEFT's, with PEFT's forward as the oracle); a different LoRA is one error line; the manifest of a
published run records its lineage."""

from __future__ import annotations

import json
import os
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from nxd_finetune.cli import main
from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.errors import NxdWarning
from nxd_finetune.lora import lora_modules, read_adapter
from nxd_finetune.lora.io import adapter_config_hash
from nxd_finetune.recipe import load_recipe
from nxd_finetune.registry import pull, show
from nxd_finetune.registry.publish import publish_run
from nxd_finetune.sft import trainer
from nxd_finetune.sft.engine import build_engine

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
# three steps of the quickstart on 64-token rows, no eval
FAST = ["data.max_seq_len=64", "training.max_steps=3", "training.micro_batch_size=4", "training.warmup_steps=1",
        "logging.progress=false", "logging.every_n_steps=1", "data.eval=null", "eval.every_n_steps=null"]
REGISTRY = "s3://nxd-test/init-from"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The tiny quickstart model in a private cache; one torch thread (the 2 cores are shared, and
    tiny matmuls only lose from a second thread under contention)."""
    path = tmp_path_factory.mktemp("nxd-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("NXD_FINETUNE_CACHE", str(path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from nxd_finetune.quickstart import ensure_tiny_model

    ensure_tiny_model()
    yield path
    torch.set_num_threads(threads)
    mp.undo()


def recipe(out_dir, *overrides):
    return load_recipe(QUICKSTART, [*FAST, f"output.dir={out_dir}", *overrides])


@pytest.fixture(scope="module")
def trained(cache, moto_s3, tmp_path_factory):
    """A 3-step adapter, published to the S3 registry with publish_run: (local dir, version)."""
    out = tmp_path_factory.mktemp("first")
    rec = recipe(out)
    summary = trainer.run(rec)
    version = publish_run(out / "final", f"{REGISTRY}/qs-bot", recipe_dict=rec.model_dump(mode="json"),
                          metrics={"final_loss": summary["final_loss"], "nan": float("nan")},
                          parallel=rec.parallel.model_dump(mode="json"), lineage=None)
    return out / "final", version


def lora_values(model) -> dict[str, torch.Tensor]:
    return {f"{n}.lora_{x}.weight": getattr(m, f"lora_{x}").weight.detach()
            for n, m in lora_modules(model) for x in "AB"}


def test_publish_run_manifest(trained):
    final, v = trained
    assert v.version == 1 and v.ref == f"{REGISTRY}/qs-bot:1"
    m = show(v.ref).manifest
    # the tokenizer travels with the adapter, chat template included
    assert set(m["files"]) == set(ADAPTER_FILES) | {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert m["lineage"] is None and m["metrics"]["nan"] is None and m["metrics"]["final_loss"] > 0
    assert m["recipe"]["lora"]["rank"] == 16 and m["parallel"]["nproc"] == 1
    # a builtin base is named by the directory it is materialised in (peft and vLLM load it)
    base_dir = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert (Path(base_dir) / "config.json").is_file()
    assert m["base_model"] == {"name_or_path": base_dir, "revision": None, "config_hash": adapter_config_hash(final)}
    assert len(m["base_model"]["config_hash"]) == 16


def test_start_values_equal_the_adapter_and_lineage_is_recorded(trained, tmp_path):
    final, v = trained
    rec = recipe(tmp_path, f"lora.init_from={REGISTRY}/qs-bot")  # latest -> pinned to :1
    built = build_engine(rec, resolve_model_dir(rec.model.path), torch.device("cpu"), 1)
    assert built.lineage == v.ref
    _, tensors = read_adapter(final)
    values = lora_values(built.model)
    assert values.keys() == tensors.keys()
    assert all(torch.equal(values[k], tensors[k]) for k in tensors)
    v2 = publish_run(final, f"{REGISTRY}/qs-bot-child", recipe_dict=None, metrics=None, parallel=None,
                     lineage=built.lineage)
    pulled = tmp_path / "pulled"
    pull(v2.ref, pulled)
    assert json.loads((pulled / "manifest.json").read_text())["lineage"] == v.ref


def test_continuing_from_registry_equals_continuing_from_directory(trained, tmp_path):
    final, v = trained
    trainer.run(recipe(tmp_path / "from-reg", f"lora.init_from={v.ref}"))
    trainer.run(recipe(tmp_path / "from-dir", f"lora.init_from={final}"))
    reg, local = tmp_path / "from-reg" / "final", tmp_path / "from-dir" / "final"
    for name in ADAPTER_FILES:
        assert (reg / name).read_bytes() == (local / name).read_bytes(), name
    _, start = read_adapter(final)
    _, end = read_adapter(tmp_path / "from-dir" / "final")
    assert any(not torch.equal(start[k], end[k]) for k in start)  # it trained on from the adapter


def test_peft_adapter_as_init_from(cache, tmp_path):
    from transformers import AutoModelForCausalLM

    rec = recipe(tmp_path)
    model_dir = resolve_model_dir(rec.model.path)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    pm = peft.get_peft_model(hf, peft.LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32,
                                                 target_modules="all-linear"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, p in sorted((n, p) for n, p in pm.named_parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    pm.save_pretrained(tmp_path / "peft")
    ids = torch.randint(0, hf.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = pm.eval()(ids).logits
        with pm.disable_adapter():
            plain = pm(ids).logits
    built = build_engine(recipe(tmp_path, f"lora.init_from={tmp_path / 'peft'}"), model_dir,
                         torch.device("cpu"), 1)
    assert built.lineage is None
    with torch.no_grad():
        got = built.model.eval()(ids)
    assert (expected - plain).abs().max() > 1e-3  # the adapter matters
    assert (got - expected).abs().max() <= 1e-5


@pytest.mark.parametrize(("override", "needle"), [
    ("lora.rank=8", "the recipe has lora.rank=8 but the adapter has 16"),
    ("lora.target_modules=[q_proj,v_proj]", "lora.target_modules"),
])
def test_a_different_lora_is_one_error_line(trained, tmp_path, capsys, override, needle):
    final, _ = trained
    with pytest.raises(SystemExit) as info:
        main(["run", str(QUICKSTART), *FAST, f"output.dir={tmp_path}", override, f"lora.init_from={final}"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert info.value.code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("error: lora.init_from ") and needle in lines[0], err


def test_an_adapter_without_base_fingerprint_warns(trained, tmp_path):
    final, _ = trained
    edited = tmp_path / "edited"
    edited.mkdir()
    for name in ADAPTER_FILES:
        (edited / name).write_bytes((final / name).read_bytes())
    weights = edited / "adapter_model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt", "nxd_config_hash": "f" * 16})
    rec = recipe(tmp_path, f"lora.init_from={edited}")
    with pytest.warns(NxdWarning, match="no base fingerprint.*config hash ffffffffffffffff"):
        build_engine(rec, resolve_model_dir(rec.model.path), torch.device("cpu"), 1)


def test_missing_source_is_one_line(cache, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", str(QUICKSTART), *FAST, f"output.dir={tmp_path}", f"lora.init_from={tmp_path / 'nope'}"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.count("\n") == 0 and "no such directory" in err, err
    assert os.path.basename(str(tmp_path / "nope")) in err

"""An adapter records its base (config + weights fingerprint); ``lora.init_from`` (``run`` and
``validate``) and ``merge`` refuse another base with one line naming the difference, unless allowed
on purpose. The adapter comes from a real 3-step quickstart run (the exporter writes the identity);
the other bases are the quickstart model with (a) a Mistral config with a sliding window, same
shapes, (b) the same config with other random weights."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import peft
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nxd_finetune.cli import main
from nxd_finetune.data.inputs import resolve_model_dir
from nxd_finetune.errors import NxdWarning
from nxd_finetune.lora.identity import (
    BASE_CONFIG_KEY,
    BASE_WEIGHTS_KEY,
    FINGERPRINT_PREFIX,
    sampled_fingerprint,
    weights_fingerprint,
)
from nxd_finetune.models import DecoderConfig
from nxd_finetune.recipe import load_recipe
from nxd_finetune.sft import trainer
from nxd_finetune.sft.engine import build_engine

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
FAST = ["data.max_seq_len=64", "training.max_steps=3", "training.micro_batch_size=4", "training.warmup_steps=1",
        "logging.progress=false", "logging.every_n_steps=1", "data.eval=null", "eval.every_n_steps=null",
        "eval.before=false"]
NEEDLES = {
    "config": "config differs in architecture ('LlamaForCausalLM' vs 'MistralForCausalLM'), model_type ('llama' vs "
              "'mistral'), sliding_window (None vs 16) (adapter's base vs this base)",
    "weights": "same config but other weights",
}


@pytest.fixture(scope="module")
def bases(quickstart_cache, tmp_path_factory) -> dict[str, Path]:
    """The trained adapter (``adapter``), its base (``same``) and the two other bases."""
    root = tmp_path_factory.mktemp("identity")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer.run(load_recipe(QUICKSTART, [*FAST, f"output.dir={root / 'run'}"]))
    finally:
        torch.set_num_threads(threads)
    base = resolve_model_dir("builtin:tiny-llama")
    other_config = root / "other-config"
    shutil.copytree(base, other_config)
    cfg = json.loads((other_config / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    (other_config / "config.json").write_text(json.dumps(cfg))
    other_weights = root / "other-weights"
    shutil.copytree(base, other_weights)
    g = torch.Generator().manual_seed(7)
    tensors = {k: torch.randn(v.shape, generator=g).to(v.dtype) * 0.02
               for k, v in load_file(other_weights / "model.safetensors").items()}
    save_file(tensors, other_weights / "model.safetensors", metadata={"format": "pt"})
    return {"adapter": root / "run" / "final", "same": base, "config": other_config, "weights": other_weights}


def cli(capsys, *args) -> tuple[int, list[str], list[str]]:
    """(exit code, error lines, warning lines) of the CLI."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return info.value.code or 0, [ln for ln in err if not ln.startswith("warning:")], \
        [ln for ln in err if ln.startswith("warning:")]


def test_export_records_the_base_and_peft_still_loads_it(bases):
    with safe_open(str(bases["adapter"] / "adapter_model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta[BASE_WEIGHTS_KEY] == weights_fingerprint(bases["same"])
    assert json.loads(meta[BASE_CONFIG_KEY])["model_type"] == "llama"
    assert weights_fingerprint(bases["weights"]) != meta[BASE_WEIGHTS_KEY]
    assert peft.LoraConfig.from_pretrained(str(bases["adapter"])).r == 16


def test_fingerprint_ignores_sharding_but_not_values(bases, tmp_path):
    tensors = load_file(bases["same"] / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / fname, metadata={"format": "pt", "x": fname})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weights_fingerprint(tmp_path) == weights_fingerprint(bases["same"])
    first = names[0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] += 1.0
    save_file({k: tensors[k] for k in parts["model-00001-of-00002.safetensors"]},
              tmp_path / "model-00001-of-00002.safetensors")
    assert weights_fingerprint(tmp_path) != weights_fingerprint(bases["same"])


@pytest.mark.parametrize("other", ["config", "weights"])
def test_another_base_is_refused_with_one_line(bases, other, tmp_path, capsys):
    adapter, base = bases["adapter"], bases[other]
    run_args = [QUICKSTART, *FAST, f"output.dir={tmp_path / 'run'}", f"model.path={base}", f"lora.init_from={adapter}"]
    code, lines, _ = cli(capsys, "run", *run_args)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"error: lora.init_from {adapter}: the adapter was trained on another base than {base}: "
                        f"{NEEDLES[other]}; set lora.allow_other_base: true to use it anyway")
    assert not (tmp_path / "run" / "final").exists()
    code, validate_lines, _ = cli(capsys, "validate", *run_args)
    assert code == 2 and validate_lines == lines  # validate refuses what run refuses, with the same line

    code, merge_lines, _ = cli(capsys, "merge", "--adapter", adapter, "--base", base, "--out", tmp_path / "m")
    assert code == 2 and merge_lines == [
        f"error: merge: the adapter was trained on another base than {base}: {NEEDLES[other]}; "
        "pass --allow-other-base to use it anyway"], merge_lines
    assert not (tmp_path / "m").exists()

    # on purpose: one warning line, and it goes through
    code, lines, warnings = cli(capsys, "merge", "--adapter", adapter, "--base", base, "--out", tmp_path / "m",
                                "--allow-other-base")
    assert code == 0 and len(warnings) == 1 and NEEDLES[other] in warnings[0], (lines, warnings)
    assert (tmp_path / "m" / "model.safetensors").is_file()
    rec = load_recipe(QUICKSTART, [*run_args[1:], "lora.allow_other_base=true"])
    with pytest.warns(NxdWarning, match="trained on another base"):
        built = build_engine(rec, base, torch.device("cpu"), 1)
    assert built.model is not None
    code, lines, warnings = cli(capsys, "validate", *run_args, "lora.allow_other_base=true")
    assert code == 0 and not lines and len(warnings) == 1, (lines, warnings)


def test_the_same_base_passes_without_a_word(bases, tmp_path, capsys):
    adapter = bases["adapter"]
    code, lines, warnings = cli(capsys, "validate", QUICKSTART, *FAST, f"lora.init_from={adapter}")
    assert code == 0 and not lines and not warnings, (lines, warnings)
    code, lines, warnings = cli(capsys, "merge", "--adapter", adapter, "--base", "builtin:tiny-llama",
                                "--out", tmp_path / "m")
    assert code == 0 and not lines and not warnings, (lines, warnings)


def test_validate_refuses_a_non_lora_adapter_as_run_does(bases, tmp_path, capsys):
    ia3 = tmp_path / "ia3"
    shutil.copytree(bases["adapter"], ia3)
    cfg = json.loads((ia3 / "adapter_config.json").read_text())
    (ia3 / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    args = [QUICKSTART, *FAST, f"output.dir={tmp_path / 'run'}", f"lora.init_from={ia3}"]
    code, run_lines, _ = cli(capsys, "run", *args)
    assert code == 2 and run_lines == [f"error: lora.init_from {ia3}: adapter peft_type is 'IA3'; "
                                       "only LORA is supported"], run_lines
    code, lines, _ = cli(capsys, "validate", *args)
    assert code == 2 and lines == run_lines


def test_allow_other_base_needs_init_from(capsys):
    code, lines, _ = cli(capsys, "validate", QUICKSTART, "lora.allow_other_base=true")
    assert code == 2 and len(lines) == 1 and "lora.allow_other_base" in lines[0] and "lora.init_from" in lines[0]


def _flip_middle_byte(model_dir: Path) -> str:
    """Change one byte in the middle of the largest tensor's data, in place; returns its name."""
    path = model_dir / "model.safetensors"
    raw = bytearray(path.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0])
    begin, end = header[name]["data_offsets"]
    assert end - begin > 64 * 1024  # far more than the 4 KiB samples at either end
    raw[8 + n + (begin + end) // 2] ^= 0x40
    path.write_bytes(bytes(raw))
    return name


def test_a_base_changed_in_the_middle_of_a_tensor_is_another_base(bases, tmp_path, capsys):
    base = tmp_path / "middle"
    shutil.copytree(bases["same"], base)
    _flip_middle_byte(base)
    assert sampled_fingerprint(base) == sampled_fingerprint(bases["same"])  # what the older check saw
    assert weights_fingerprint(base) != weights_fingerprint(bases["same"])
    code, lines, _ = cli(capsys, "merge", "--adapter", bases["adapter"], "--base", base, "--out", tmp_path / "m")
    assert code == 2 and lines == [f"error: merge: the adapter was trained on another base than {base}: "
                                   f"{NEEDLES['weights']}; pass --allow-other-base to use it anyway"], lines
    run_args = [QUICKSTART, *FAST, f"output.dir={tmp_path / 'run'}", f"model.path={base}",
                f"lora.init_from={bases['adapter']}"]
    code, lines, _ = cli(capsys, "validate", *run_args)
    assert code == 2 and len(lines) == 1 and NEEDLES["weights"] in lines[0], lines


def test_an_adapter_with_the_older_sampled_fingerprint_is_checked_as_it_was(bases, tmp_path, capsys):
    """Adapters written before whole tensors were hashed record a bare hex digest of samples: they
    still load on their base without a word, and are still refused on another one."""
    adapter = tmp_path / "older"
    shutil.copytree(bases["adapter"], adapter)
    weights = adapter / "adapter_model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        meta = dict(f.metadata())
    assert meta[BASE_WEIGHTS_KEY].startswith(FINGERPRINT_PREFIX)
    meta[BASE_WEIGHTS_KEY] = sampled_fingerprint(bases["same"])
    save_file(load_file(weights), weights, metadata=meta)
    code, lines, warnings = cli(capsys, "merge", "--adapter", adapter, "--base", "builtin:tiny-llama",
                                "--out", tmp_path / "m")
    assert code == 0 and not lines and not warnings, (lines, warnings)
    code, lines, _ = cli(capsys, "merge", "--adapter", adapter, "--base", bases["weights"], "--out", tmp_path / "m2")
    assert code == 2 and len(lines) == 1 and NEEDLES["weights"] in lines[0], lines


def test_an_adapter_recorded_before_newer_config_fields_still_fits_its_base(bases, tmp_path, capsys):
    """Fields added to the model config later (Gemma 2's ``embed_scale``...) are absent from what an
    older adapter recorded; their defaults are what its base had, so the adapter still fits."""
    adapter = tmp_path / "older-config"
    shutil.copytree(bases["adapter"], adapter)
    weights = adapter / "adapter_model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        meta = dict(f.metadata())
    recorded = json.loads(meta[BASE_CONFIG_KEY])
    defaults = {f.name: f.default for f in dataclasses.fields(DecoderConfig)
                if f.default is not dataclasses.MISSING and isinstance(f.default, bool)}
    dropped = [k for k in recorded if k in defaults and recorded[k] == defaults[k]]
    assert dropped
    meta[BASE_CONFIG_KEY] = json.dumps({k: v for k, v in recorded.items() if k not in dropped})
    save_file(load_file(weights), weights, metadata=meta)
    code, lines, warnings = cli(capsys, "merge", "--adapter", adapter, "--base", "builtin:tiny-llama",
                                "--out", tmp_path / "m")
    assert code == 0 and not lines and not warnings, (lines, warnings)
    code, lines, _ = cli(capsys, "merge", "--adapter", adapter, "--base", bases["config"], "--out", tmp_path / "m2")
    assert code == 2 and len(lines) == 1 and "config differs in architecture" in lines[0], lines

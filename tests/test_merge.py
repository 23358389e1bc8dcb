"""``nxd-finetune merge``: streamed adapter merging against PEFT's ``merge_and_unload`` (oracle),
sharded in and out, dtype, the CLI from an S3 registry REF, one-line errors, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from nxd_finetune.cli import main
from nxd_finetune.errors import NxdWarning
from nxd_finetune.lora import LoraConfig, inject_lora, save_adapter, trainable_parameters
from nxd_finetune.lora.merge import merge_adapter, parse_size
from nxd_finetune.models import load_pretrained
from nxd_finetune.registry import push

TOL = 1e-5
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))


def hf_load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kw).eval()


def logits(model):
    with torch.no_grad():
        return model(IDS).logits.float()


def randomize(params, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(params):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def sharded_base(make_tiny_hf, tmp_path, family="llama", **overrides) -> Path:
    """A tiny HF model saved in ~20 KB shards (so the merge reads a sharded index)."""
    hf, path = make_tiny_hf(family, **overrides)
    out = tmp_path / f"base-{family}"
    hf.save_pretrained(out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file()
    (out / "tokenizer_config.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")
    return out


def peft_adapter(base: Path, out: Path, **kw) -> Path:
    pm = peft.get_peft_model(hf_load(base), peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=16, **kw))
    randomize([(n, p) for n, p in pm.named_parameters() if p.requires_grad], seed=2)
    pm.save_pretrained(out)
    return out


def our_adapter(base: Path, out: Path, cfg: LoraConfig) -> Path:
    model = load_pretrained(base)
    inject_lora(model, cfg)
    randomize(trainable_parameters(model), seed=1)
    save_adapter(model, cfg, out, base_model_name_or_path=str(base), base_dir=base)
    return out


def oracle_logits(base: Path, adapter: Path) -> torch.Tensor:
    return logits(peft.PeftModel.from_pretrained(hf_load(base), adapter).merge_and_unload().eval())


def shards(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("model-*.safetensors"))


@pytest.mark.parametrize("source", ["peft", "ours"])
def test_merge_equals_peft_merge_and_unload(source, make_tiny_hf, tmp_path):
    if source == "peft":  # qwen2 biases, all-linear, trained biases, a full lm_head copy
        base = sharded_base(make_tiny_hf, tmp_path, "qwen2")
        adapter = peft_adapter(base, tmp_path / "adapter", target_modules="all-linear", bias="lora_only",
                               modules_to_save=["lm_head"])
    else:  # attention biases trained in place (bias=all), a regex target
        base = sharded_base(make_tiny_hf, tmp_path, "llama", attention_bias=True)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=r".*\.(q|v|down)_proj", bias="all")
        adapter = our_adapter(base, tmp_path / "adapter", cfg)
    out = merge_adapter(adapter, base, tmp_path / "merged", max_shard_bytes=30_000)

    assert len(shards(out)) > 1 and (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    merged = hf_load(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    expected = oracle_logits(base, adapter)
    assert (expected - logits(hf_load(base))).abs().max() > 1e-3  # the adapter matters
    assert (logits(merged) - expected).abs().max() <= TOL


def test_merge_unties_a_changed_tied_head(make_tiny_hf, tmp_path):
    """LoRA on a tied lm_head: the head is written untied and the embeddings stay the base's. The
    oracle is PEFT's unmerged forward: its merge_and_unload adds the delta to the shared tensor,
    changing the embeddings too (PEFT warns about it)."""
    base = sharded_base(make_tiny_hf, tmp_path, "llama", tie_word_embeddings=True)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])
    adapter = our_adapter(base, tmp_path / "adapter", cfg)
    out = merge_adapter(adapter, base, tmp_path / "merged", max_shard_bytes=30_000)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    merged = hf_load(out)
    assert torch.equal(merged.model.embed_tokens.weight, hf_load(base).model.embed_tokens.weight)
    expected = logits(peft.PeftModel.from_pretrained(hf_load(base), adapter).eval())
    assert (logits(merged) - expected).abs().max() <= TOL


def test_merge_bf16_output(make_tiny_hf, tmp_path):
    base = sharded_base(make_tiny_hf, tmp_path)
    adapter = our_adapter(base, tmp_path / "adapter", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    out = merge_adapter(adapter, base, tmp_path / "bf16", dtype="bf16")
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    source = json.loads((base / "config.json").read_text())
    written = json.loads((out / "config.json").read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in source] or ["torch_dtype"]  # the source's key is kept
    assert all(written[k] == "bfloat16" for k in keys) and set(written) == set(source) | set(keys)
    fp32 = merge_adapter(adapter, base, tmp_path / "fp32")
    assert {t.dtype for t in load_file(fp32 / "model.safetensors").values()} == {torch.float32}
    a, b = load_file(out / "model.safetensors"), load_file(fp32 / "model.safetensors")
    assert all(torch.equal(a[k], b[k].to(torch.bfloat16)) for k in b)  # merged in fp32, then cast once


def test_merge_streams_tensor_by_tensor(make_tiny_hf, tmp_path, monkeypatch):
    """Each base tensor is read once, and the elements read but not yet written out never exceed
    one tensor's: the merge holds neither the model nor a shard."""
    import nxd_finetune.models.loading as loading

    base = sharded_base(make_tiny_hf, tmp_path, num_hidden_layers=4)
    adapter = our_adapter(base, tmp_path / "adapter", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    reads: Counter[str] = Counter()
    pending = [0]  # elements read and not yet written
    peak = [0]
    real_open, real_write = loading.safe_open, loading.write_tensor

    class Reader:
        def __init__(self, f):
            self.f = f

        def get_slice(self, key):
            return self.f.get_slice(key)

        def get_tensor(self, key):
            t = self.f.get_tensor(key)
            reads[key] += 1
            pending[0] += t.numel()
            peak[0] = max(peak[0], pending[0])
            return t

    @contextmanager
    def counting_open(path, framework, **kw):
        with real_open(path, framework=framework, **kw) as f:
            yield Reader(f)

    def recording_write(f, tensor):
        pending[0] -= tensor.numel()
        return real_write(f, tensor)

    monkeypatch.setattr(loading, "safe_open", counting_open)
    monkeypatch.setattr(loading, "write_tensor", recording_write)
    shard_bytes = 40_000
    out = merge_adapter(adapter, base, tmp_path / "merged", max_shard_bytes=shard_bytes)

    sizes = {k: t.numel() for f in base.glob("*.safetensors") for k, t in load_file(f).items()}
    assert dict(reads) == dict.fromkeys(sizes, 1)
    assert pending == [0]
    assert sum(sizes.values()) > 10 * max(sizes.values())  # a bound that means something
    assert peak[0] <= max(sizes.values())
    assert len(shards(out)) > 5


def test_cli_merge_from_s3_registry_ref(moto_s3, make_tiny_hf, tmp_path):
    base = sharded_base(make_tiny_hf, tmp_path)
    adapter = peft_adapter(base, tmp_path / "adapter", target_modules=["q_proj", "up_proj"])
    v = push(adapter, "s3://nxd-test/merge-test/bot")
    out = tmp_path / "merged"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "nxd_finetune", "merge", "--adapter", v.ref, "--base", str(base), "--out", str(out),
         "--max-shard-size", "40KB"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"merged {v.ref}" in proc.stdout
    assert len(shards(out)) > 1 and not any((tmp_path / "tmp").iterdir())  # the pulled copy is gone
    assert (logits(hf_load(out)) - oracle_logits(base, adapter)).abs().max() <= TOL


def cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()  # drop what fixtures printed
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    return info.value.code or 0, capsys.readouterr().err


@pytest.mark.parametrize("case", ["shape", "target"])
def test_adapter_that_does_not_fit_exits_2(case, make_tiny_hf, tmp_path, capsys):
    base = sharded_base(make_tiny_hf, tmp_path)
    if case == "shape":  # trained on a wider MLP
        _, other = make_tiny_hf("llama", intermediate_size=80)
        adapter = our_adapter(other, tmp_path / "adapter", LoraConfig(r=4, lora_alpha=8, target_modules=["up_proj"]))
    else:  # targets a module this architecture lacks
        adapter = our_adapter(base, tmp_path / "adapter", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["qkv_proj"]}))
    code, err = cli(capsys, "merge", "--adapter", adapter, "--base", base, "--out", tmp_path / "out")
    assert code == 2 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: adapter ") and "does not fit base" in lines[0]
    if case == "shape":
        assert "up_proj.lora_B.weight' has shape (80, 4), the base model expects (96, 4)" in err
    else:
        assert "qkv_proj" in err and "matched no module" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_truncated_base_checkpoint_is_one_line_at_merge_and_run(quickstart_cache, tmp_path, capsys):
    """A base ``model.safetensors`` cut to 1,000 bytes: ``merge`` and ``run`` end with one
    ``error:`` line naming the file, exit 2, no traceback, nothing written."""
    import shutil

    from nxd_finetune.data.inputs import resolve_model_dir

    base = tmp_path / "base"
    shutil.copytree(resolve_model_dir("builtin:tiny-llama"), base)
    adapter = our_adapter(base, tmp_path / "adapter", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    code, err = cli(capsys, "merge", "--adapter", adapter, "--base", base, "--out", tmp_path / "out")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot read checkpoint file {weights}"), err
    assert not (tmp_path / "out").exists()
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    code, err = cli(capsys, "run", recipe, f"model.path={base}", f"output.dir={tmp_path / 'run'}",
                    "training.max_steps=1", "training.warmup_steps=0", "logging.progress=false")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"error: cannot read checkpoint file {weights}"), err
    assert not (tmp_path / "run" / "final").exists()


def test_warns_when_base_config_differs(make_tiny_hf, tmp_path):
    base = sharded_base(make_tiny_hf, tmp_path)
    adapter = our_adapter(base, tmp_path / "adapter", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "revision": "v1"}))
    weights = adapter / "adapter_model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt", "nxd_config_hash": "0" * 16})
    with pytest.warns(NxdWarning) as record:
        merge_adapter(adapter, base, tmp_path / "out", base_revision="v2")
    (line,) = [str(w.message) for w in record if w.category is NxdWarning]
    assert "no base fingerprint" in line and "config hash 0000000000000000" in line
    assert "'v1'" in line and "'v2'" in line


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("40KB") == 40_000 and parse_size("1000") == 1000
    with pytest.raises(Exception, match="invalid size"):
        parse_size("lots")

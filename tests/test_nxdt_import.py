"""``nxd-finetune import nxdt-checkpoint``: NxD-layout checkpoints built from a tiny random HF Llama
exactly as NxD lays them out (tests/nxdt_helpers.py), imported and compared with the HF weights bit
for bit at tp 1/2/4 and pp 1/2; NxD LoRA checkpoints imported into PEFT adapters that ``peft`` loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from nxdt_helpers import assert_bit_equal, read_hf, shard_lora, shard_model, write_checkpoint
from safetensors.torch import load_file

from nxd_finetune.cli import main

CASES = [(tp, pp) for tp in (1, 2, 4) for pp in (1, 2)]


def cli(capsys, *args: object) -> tuple[int, str, str]:
    capsys.readouterr()  # what fixtures printed (transformers' progress bars)
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return info.value.code or 0, out.out, out.err


def run_ok(capsys, *args: object) -> str:
    try:
        main([str(a) for a in args])
    except SystemExit as e:
        assert not e.code, capsys.readouterr().err
    return capsys.readouterr().out


def hf_tensors(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def llama(make_tiny_hf):
    """Tiny GQA Llama (4 query heads, 2 KV heads) with 3 layers, so pp=2 splits them 1 + 2."""
    model, path = make_tiny_hf("llama", num_hidden_layers=3)
    return model, path, json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(("tp", "pp"), CASES)
def test_model_bit_exact(capsys, tmp_path, llama, tp, pp):
    model, path, cfg = llama
    m = max(1, tp // cfg["num_key_value_heads"])  # kv_replicator NxD needs at tp=4 (2 KV heads)
    shards = shard_model(hf_tensors(model), cfg, tp, pp, m=m)
    tag = write_checkpoint(tmp_path / "ckpt", "step=5.ckpt", shards)
    out = tmp_path / "hf"
    said = run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", out, "--config", path / "config.json")
    assert f"tp={tp}, pp={pp}" in said
    assert_bit_equal(read_hf(out), hf_tensors(model))


@pytest.mark.parametrize("variant", ["trn2", "gqa_fused", "mha_fused", "xser"])
def test_model_layout_variants(capsys, tmp_path, make_tiny_hf, variant):
    kv = 4 if variant == "mha_fused" else 2
    model, path = make_tiny_hf("llama", num_key_value_heads=kv)
    cfg = json.loads((path / "config.json").read_text())
    tp, pp = (4, 1) if variant == "trn2" else (2, 2)
    shards = shard_model(hf_tensors(model), cfg, tp, pp, m=tp // kv if tp > kv else 1,
                         hw="trn2" if variant == "trn2" else "trn1",
                         qkv=variant if variant in ("gqa_fused", "mha_fused") else "gqa")
    tag = write_checkpoint(tmp_path / "ckpt", "t", shards, xser=variant == "xser")
    if variant == "xser":
        assert (tag / "model" / "dp_rank_00_tp_rank_01_pp_rank_01.pt.tensors" / "tensor_0.pt").is_file()
    out = tmp_path / "hf"
    run_ok(capsys, "import", "nxdt-checkpoint", tag / "model", "--out", out, "--config", path)
    assert_bit_equal(read_hf(out), hf_tensors(model))


def test_imported_model_runs_in_transformers(capsys, tmp_path, llama):
    from transformers import AutoModelForCausalLM

    model, path, cfg = llama
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_model(hf_tensors(model), cfg, 4, 2, m=2))
    run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "hf", "--config", path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 11))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_kv_layout_is_read_not_assumed(capsys, tmp_path, llama):
    """A Trn2 (blocked) checkpoint read as Trn1 (interleaved) is refused, not silently scrambled."""
    model, path, cfg = llama
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_model(hf_tensors(model), cfg, 4, 1, m=2, hw="trn2"))
    code, _, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "o", "--config", path,
                       "--kv-layout", "interleaved")
    assert code == 2 and err.count("\n") == 1 and "do not follow the interleaved replication" in err


def test_root_picks_newest_complete_tag(capsys, tmp_path, llama, make_tiny_hf):
    model, path, cfg = llama
    other, _ = make_tiny_hf("llama", seed=1, num_hidden_layers=3)
    root = tmp_path / "checkpoints"
    write_checkpoint(root, "step=1", shard_model(hf_tensors(other), cfg, 2, 1))
    write_checkpoint(root, "step=2", shard_model(hf_tensors(model), cfg, 2, 1))
    write_checkpoint(root, "step=3", shard_model(hf_tensors(other), cfg, 2, 1), done=False)  # save interrupted
    run_ok(capsys, "import", "nxdt-checkpoint", root, "--out", tmp_path / "hf", "--config", path)
    assert_bit_equal(read_hf(tmp_path / "hf"), hf_tensors(model))


def test_bad_checkpoints_are_one_line(capsys, tmp_path, llama):
    model, path, cfg = llama
    shards = shard_model(hf_tensors(model), cfg, 2, 1)
    cases = {}
    cases["no 'done' marker"] = write_checkpoint(tmp_path / "a", "t", shards, done=False)
    missing = write_checkpoint(tmp_path / "b", "t", shards)
    (missing / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt").unlink()
    cases["misses 1 of its 2x1 shards"] = missing
    last = write_checkpoint(tmp_path / "e", "t", shards)
    (last / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt").unlink()
    cases["shard files are missing"] = last
    pickled = write_checkpoint(tmp_path / "c", "t", shards)
    torch.save({**shards[(0, 0)], "extra": torch.optim.SGD}, pickled / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    cases["needs a full unpickler"] = pickled
    for i, (words, tag) in enumerate(cases.items()):
        code, out, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / f"o{i}", "--config", path)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, err
        assert not (tmp_path / f"o{i}").exists()
    other = {k: v for k, v in shards[(0, 0)].items() if "layers.2." not in k}
    tag = write_checkpoint(tmp_path / "d", "t", {(0, 0): other, (1, 0): {k: shards[(1, 0)][k] for k in other}})
    code, _, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "o9", "--config", path)
    assert code == 2 and "does not fit the model config" in err


# ----------------------------------------------------------------------------------- LoRA

NXD_LORA_CONFIG = {"bias": "none", "init_lora_weights": "default", "lora_alpha": 16, "lora_dropout": 0.05,
                   "lora_rank": 4, "r": 4, "use_rslora": False, "modules_to_save": None, "save_lora_base": False,
                   "merge_lora": False, "save_lora_config_adapter": True,
                   "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def reference_adapter(model, seed: int = 3, targets: list[str] = PEFT_TARGETS, r: int = 4):
    """A PEFT model on ``model`` whose q/k/v share one A and gate/up one A (as NxD's fused layers
    train one A), every LoRA weight random; returns (peft model, its adapter tensors by file key)."""
    import copy

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=r, lora_alpha=16, lora_dropout=0.05,
                                                                 target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(peft_model.named_parameters()):
            if "lora_" in _:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for layer in peft_model.base_model.model.model.layers if "q_proj" in targets else []:
            for proj in ("k_proj", "v_proj"):
                getattr(layer.self_attn, proj).lora_A.default.weight.copy_(layer.self_attn.q_proj.lora_A.default.weight)
            layer.mlp.up_proj.lora_A.default.weight.copy_(layer.mlp.gate_proj.lora_A.default.weight)
    from peft import get_peft_model_state_dict

    files = {"base_model.model." + k.removeprefix("base_model.model."): v.clone()
             for k, v in get_peft_model_state_dict(peft_model).items()}
    return peft_model.eval(), files


def load_adapter_logits(base_model, adapter_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    import copy

    from peft import PeftModel

    with torch.no_grad():
        return PeftModel.from_pretrained(copy.deepcopy(base_model), adapter_dir).eval()(ids).logits


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2), (4, 1), (4, 2)])
def test_lora_into_peft(capsys, tmp_path, llama, tp, pp):
    model, path, cfg = llama
    peft_model, files = reference_adapter(model)
    m = max(1, tp // cfg["num_key_value_heads"])
    shards = shard_lora(files, cfg, tp, pp, m=m)
    assert "model.layers.0.self_attn.qkv_proj.lora_B.weight_q" in shards[(0, 0)]
    tag = write_checkpoint(tmp_path / "ckpt", "step=10", shards, extra={"lora_config": NXD_LORA_CONFIG})
    out = tmp_path / "adapter"
    said = run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", out, "--config", path)
    assert "LoRA adapter" in said and "21 modules" in said  # 7 per layer
    assert_bit_equal(load_file(out / "adapter_model.safetensors"), files)
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 4 and adapter_cfg["lora_alpha"] == 16
    assert adapter_cfg["base_model_name_or_path"] == str(path)
    assert sorted(adapter_cfg["target_modules"]) == sorted(PEFT_TARGETS)
    ids = torch.randint(0, cfg["vocab_size"], (2, 9))
    with torch.no_grad():
        want = peft_model(ids).logits
    assert torch.equal(load_adapter_logits(model, out, ids), want)


def test_lora_merged_shards_and_base(capsys, tmp_path, llama):
    """``merge_sharded_lora`` (every rank holds the gathered adapter) and ``save_lora_base`` (the base
    under ``base_layer`` names beside it): out/base is the HF model, out/adapter its adapter."""
    model, path, cfg = llama
    _, files = reference_adapter(model)
    base = shard_model(hf_tensors(model), cfg, 2, 2)
    lora = shard_lora(files, cfg, 2, 2, merged=True)
    both = {}
    for rank in base:
        named = {k.replace(".qkv_proj.weight", ".qkv_proj.base_layer.weight") if "lora" not in k else k: v
                 for k, v in base[rank].items()}
        both[rank] = {**named, **lora[rank]}
    tag = write_checkpoint(tmp_path / "ckpt", "t", both, extra={"lora_config": {**NXD_LORA_CONFIG,
                                                                                 "save_lora_base": True}})
    out = tmp_path / "out"
    run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", out, "--config", path)
    assert_bit_equal(read_hf(out / "base"), hf_tensors(model))
    assert_bit_equal(load_file(out / "adapter" / "adapter_model.safetensors"), files)
    adapter_cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(out / "base")


def test_lora_merged_gqa_with_replication_refused(capsys, tmp_path, llama):
    model, path, cfg = llama
    _, files = reference_adapter(model)
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_lora(files, cfg, 4, 1, m=2, merged=True))
    code, _, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "o", "--config", path)
    assert code == 2 and "merge_sharded_lora: false" in err and err.count("\n") == 1


def test_lora_o_proj_alone_needs_the_kv_layout(capsys, tmp_path, llama):
    """Without a qkv_proj adapter nothing in the files shows whether the 2x kv replication was Trn1's
    or Trn2's, which decides o_proj's column order: one line asks for --kv-layout; given, bit exact."""
    model, path, cfg = llama
    _, files = reference_adapter(model, targets=["o_proj", "down_proj"])
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_lora(files, cfg, 4, 2, m=2))
    code, _, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "o", "--config", path)
    assert code == 2 and err.count("\n") == 1 and "--kv-layout interleaved (Trn1) or blocked (Trn2)" in err
    run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "o", "--config", path,
           "--kv-layout", "interleaved")
    assert_bit_equal(load_file(tmp_path / "o" / "adapter_model.safetensors"), files)


def test_bf16_checkpoint_keeps_its_dtype(capsys, tmp_path, llama):
    model, path, cfg = llama
    hf = {k: v.to(torch.bfloat16) for k, v in hf_tensors(model).items()}
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_model(hf, cfg, 2, 2))
    run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "hf", "--config", path)
    assert_bit_equal(read_hf(tmp_path / "hf"), hf)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written.get("dtype", written.get("torch_dtype")) == "bfloat16"


def test_imported_adapter_merges_like_peft(capsys, tmp_path, llama):
    """The imported adapter records its base, so `merge` takes it; the merged weights are peft's
    ``merge_and_unload`` of the reference adapter."""
    model, path, cfg = llama
    peft_model, files = reference_adapter(model)
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_lora(files, cfg, 2, 1), extra={"lora_config": NXD_LORA_CONFIG})
    run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "adapter", "--config", path)
    run_ok(capsys, "merge", "--adapter", tmp_path / "adapter", "--base", path, "--out", tmp_path / "merged")
    want = {k: v.detach() for k, v in peft_model.merge_and_unload().state_dict().items()}
    got = read_hf(tmp_path / "merged")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)


def test_lora_rank_comes_from_the_tensors(capsys, tmp_path, llama):
    """NxD's saved lora_config says r=4 but the tensors are rank 8 (the config of another run, or
    NxD's default): the adapter says r=8, peft loads it, and its logits are the reference's."""
    model, path, cfg = llama
    peft_model, files = reference_adapter(model, r=8)
    assert files["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape[0] == 8
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_lora(files, cfg, 2, 1), extra={"lora_config": NXD_LORA_CONFIG})
    run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "adapter", "--config", path)
    adapter_cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 8 and adapter_cfg["lora_alpha"] == 16
    ids = torch.randint(0, cfg["vocab_size"], (2, 9))
    with torch.no_grad():
        want = peft_model(ids).logits
    assert torch.equal(load_adapter_logits(model, tmp_path / "adapter", ids), want)


def test_unreadable_shards_and_links_out_are_one_line(capsys, tmp_path, llama):
    """A model file that is text, or a symlink to a file outside the checkpoint (even a valid
    one), is refused with one line naming the file; a symlink inside the checkpoint is read."""
    model, path, cfg = llama
    shards = shard_model(hf_tensors(model), cfg, 2, 1)
    name = "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    text = write_checkpoint(tmp_path / "a", "t", shards)
    (text / "model" / name).write_text("hello, this is not a checkpoint\n")
    outside = write_checkpoint(tmp_path / "b", "t", shards)
    (outside / "model" / name).rename(tmp_path / "elsewhere.pt")
    (outside / "model" / name).symlink_to(tmp_path / "elsewhere.pt")
    etc = write_checkpoint(tmp_path / "c", "t", shards)
    (etc / "model" / name).unlink()
    (etc / "model" / name).symlink_to("/etc/hostname")
    cases = {text: f"{name}: not a PyTorch checkpoint", outside: f"{name} is a symlink leading out of",
             etc: f"{name} is a symlink leading out of"}
    for i, (tag, words) in enumerate(cases.items()):
        code, _, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / f"o{i}", "--config", path)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, err
        assert not (tmp_path / f"o{i}").exists()
    inside = write_checkpoint(tmp_path / "d", "t", shards)
    (inside / "model" / name).rename(inside / "moved.pt")
    (inside / "model" / name).symlink_to(inside / "moved.pt")
    run_ok(capsys, "import", "nxdt-checkpoint", inside, "--out", tmp_path / "hf", "--config", path)
    assert_bit_equal(read_hf(tmp_path / "hf"), hf_tensors(model))


def test_out_that_cannot_be_written_is_one_line(capsys, tmp_path, llama):
    model, path, cfg = llama
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_model(hf_tensors(model), cfg, 1, 1))
    (tmp_path / "file").write_text("x")
    cases = {tmp_path / "file" / "out": "is a file", Path("/proc/nxd-out"): "cannot write"}
    for out, words in cases.items():
        code, _, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", out, "--config", path)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, err


def test_full_disk_is_one_line(capsys, tmp_path, make_tiny_hf, full_disk):  # noqa: F811
    """The HF checkpoint (2.5 MB) does not fit a 512 KiB disk: one line, exit 1, nothing left there."""
    model, path = make_tiny_hf("llama", hidden_size=128, intermediate_size=384, num_hidden_layers=3)
    cfg = json.loads((path / "config.json").read_text())
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_model(hf_tensors(model), cfg, 2, 1))
    code, _, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", full_disk / "hf", "--config", path)
    lines = [ln for ln in err.splitlines() if not ln.startswith("warning:")]
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"error: no space left on device writing {full_disk}")
    assert list(full_disk.iterdir()) == []

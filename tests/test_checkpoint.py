"""Training checkpoints in one process: exact round trip and continuation, keep-last-K, a checkpoint
is visible only with its manifest, corrupt files are detected by sha256 (the previous complete one is
used, with a warning), async saves equal sync ones, and the same through S3 (moto over HTTP).

Multi-rank resharding is in ``test_checkpoint_reshard.py``; kill-and-resume of the CLI in
``test_checkpoint_resume.py``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import IDS, LABELS, TINY, make_run, train, trainable
from safetensors.torch import load_file

from nxd_finetune.checkpoint import CheckpointError, CheckpointManager, CheckpointWarning, list_checkpoints
from nxd_finetune.lora import LoraConfig, inject_lora
from nxd_finetune.loss import causal_lm_loss
from nxd_finetune.models import DecoderConfig, DecoderForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread_and_tmpdir")


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys() and sa["state"]
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)


def save_run(mgr: CheckpointManager, step: int, model, opt, sched, **more) -> str:
    extra = {"scheduler": sched.state_dict(), "rng": torch.get_rng_state(), "counters": {"step": step}, **more}
    return mgr.save(step, [model], opt, extra)


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-sft"])
def test_round_trip_is_exact_and_training_continues_bit_for_bit(tmp_path, lora):
    model, opt, sched = make_run(lora)
    train(model, opt, sched, 3)
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    rng = torch.get_rng_state()
    uri = save_run(mgr, 3, model, opt, sched, recipe="model: {path: x}\n", pair=(1, 2.5), nested=[{"t": IDS}])
    assert uri == f"{tmp_path / 'ckpt'}/step-00000003"

    fresh, fresh_opt, fresh_sched = make_run(lora, seed=1)
    if lora:  # a different starting point, so equality below is the checkpoint's doing
        pairs = zip(trainable(fresh).values(), trainable(model).values(), strict=True)
        assert any(not torch.equal(a, b) for a, b in pairs)
    ref = mgr.resolve("latest")
    assert ref.step == 3
    extra = mgr.load(ref, [fresh], fresh_opt)
    fresh_sched.load_state_dict(extra["scheduler"])
    assert_same_params(trainable(fresh), trainable(model))
    assert_same_optimizer(fresh_opt, opt)
    assert torch.equal(extra["rng"], rng) and extra["counters"] == {"step": 3}
    assert extra["recipe"] == "model: {path: x}\n" and extra["pair"] == [1, 2.5]
    assert torch.equal(extra["nested"][0]["t"], IDS)
    # the step after the resume is the step the uninterrupted run takes
    assert train(fresh, fresh_opt, fresh_sched, 2) == train(model, opt, sched, 2)
    assert_same_params(trainable(fresh), trainable(model))


def test_files_are_safetensors_and_json_keyed_by_global_name(tmp_path):
    model, opt, sched = make_run()
    train(model, opt, sched, 1)
    save_run(CheckpointManager(tmp_path), 1, model, opt, sched)
    d = tmp_path / "step-00000001"
    assert sorted(p.name for p in d.iterdir()) == ["extra.json", "extra.safetensors", "manifest.json",
                                                   "state-pp00.json", "state-pp00.safetensors"]
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["layout"] == {"tp": 1, "pp": 1, "dp": 1, "zero1": False} and manifest["step"] == 1
    tensors = load_file(d / "state-pp00.safetensors")
    name = "model.layers.1.mlp.down_proj.lora_A.weight"
    assert torch.equal(tensors[f"param/{name}"], model.get_parameter(name))
    assert torch.equal(tensors[f"optim/{name}/exp_avg"], opt.state[model.get_parameter(name)]["exp_avg"])
    assert tensors[f"optim/{name}/step"].shape == () and set(manifest["tensors"]) == set(tensors)
    assert not any("base_layer" in k for k in tensors)  # frozen weights are not saved
    assert "__tensor__" in (d / "extra.json").read_text()


def test_load_refuses_a_checkpoint_of_another_lora_rank(tmp_path):
    model, opt, sched = make_run()
    mgr = CheckpointManager(tmp_path)
    save_run(mgr, 0, model, opt, sched)
    torch.manual_seed(0)
    other = DecoderForCausalLM(DecoderConfig(**TINY))
    inject_lora(other, LoraConfig(r=8, lora_alpha=8, target_modules="all-linear"))
    with pytest.raises(CheckpointError, match=r"has shape \(4, 64\).*\(8, 64\)"):
        mgr.load(mgr.resolve("latest"), [other])


def test_extra_must_be_json_or_tensors(tmp_path):
    model, opt, _ = make_run()
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"extra\.a\[1\]: a object"):
        mgr.save(1, [model], opt, {"a": [1, object()]})
    with pytest.raises(CheckpointError, match=r"extra\.x: nan"):
        mgr.save(1, [model], opt, {"x": math.nan})
    assert list_checkpoints(mgr.storage) == []


# ----------------------------------------------------------------------------- visibility, retention, integrity


def test_keep_last_k_and_stale_incomplete_dirs_are_pruned(tmp_path):
    model, opt, sched = make_run()
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 4):
        train(model, opt, sched, 1)
        save_run(mgr, step, model, opt, sched)
    assert mgr.steps() == [2, 3]
    # a save killed before its manifest: files but no manifest
    shutil.copytree(tmp_path / "step-00000003", tmp_path / "step-00000004")
    (tmp_path / "step-00000004" / "manifest.json").unlink()
    assert mgr.resolve("latest").step == 3
    assert list_checkpoints(mgr.storage) == [(2, True), (3, True), (4, False)]
    for step in (5, 6):
        save_run(mgr, step, model, opt, sched)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005", "step-00000006"]
    with pytest.raises(CheckpointError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_manifest_is_written_last_and_a_dir_without_it_is_never_loaded(tmp_path):
    model, opt, sched = make_run()
    mgr = CheckpointManager(tmp_path, keep_last=5)
    save_run(mgr, 1, model, opt, sched)
    before = trainable(model)
    train(model, opt, sched, 1)
    save_run(mgr, 2, model, opt, sched)
    d = tmp_path / "step-00000002"
    manifest = json.loads((d / "manifest.json").read_text())
    newest = max((d / name).stat().st_mtime_ns for name in manifest["files"])
    assert (d / "manifest.json").stat().st_mtime_ns >= newest
    (d / "manifest.json").unlink()
    ref = mgr.resolve("latest")
    assert ref.step == 1
    fresh, fresh_opt, _ = make_run(seed=1)
    mgr.load(ref, [fresh], fresh_opt)
    assert_same_params(trainable(fresh), before)
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        mgr.resolve(str(d))
    # an empty root, or nothing asked for: start fresh
    assert CheckpointManager(tmp_path / "empty").resolve("latest") is None
    assert mgr.resolve(None) is None


def test_truncated_or_altered_file_falls_back_to_the_previous_checkpoint(tmp_path):
    model, opt, sched = make_run()
    mgr = CheckpointManager(tmp_path, keep_last=3)
    params = {}
    for step in (1, 2, 3):
        train(model, opt, sched, 1)
        save_run(mgr, step, model, opt, sched)
        params[step] = trainable(model)
    state3 = tmp_path / "step-00000003" / "state-pp00.safetensors"
    state3.write_bytes(state3.read_bytes()[:-100])  # truncated
    with pytest.warns(CheckpointWarning, match=r"step-00000003.*bytes, the manifest says"):
        assert mgr.resolve("latest").step == 2
    state2 = tmp_path / "step-00000002" / "state-pp00.safetensors"
    data = bytearray(state2.read_bytes())
    data[-5] ^= 0x01  # one flipped bit in a tensor value, same size
    state2.write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning) as warned:
        ref = mgr.resolve("latest")
    assert ref.step == 1
    assert [("step-00000003" in str(w.message), "sha256" in str(w.message)) for w in warned] == [
        (True, False), (False, True)]
    fresh, fresh_opt, _ = make_run(seed=1)
    mgr.load(ref, [fresh], fresh_opt)
    assert_same_params(trainable(fresh), params[1])
    with pytest.raises(CheckpointError, match="sha256"):
        mgr.resolve("step-00000002")  # asked for by name: an error, not a fallback
    (tmp_path / "step-00000001" / "extra.json").write_text("{}")
    with pytest.warns(CheckpointWarning), pytest.raises(
            CheckpointError, match=r"no usable checkpoint in .*: step-00000003, step-00000002, step-00000001 failed "
                                   r"verification; .*--no-resume"):
        mgr.resolve("latest")  # checkpoints there, none usable: not a silent fresh start


# ----------------------------------------------------------------------------- async


def test_async_save_equals_sync_save_and_snapshots_the_state(tmp_path):
    model, opt, sched = make_run()
    train(model, opt, sched, 2)
    snapshot = trainable(model)
    sync = CheckpointManager(tmp_path / "sync")
    save_run(sync, 2, model, opt, sched)
    background = CheckpointManager(tmp_path / "async", async_save=True)
    save_run(background, 2, model, opt, sched)
    train(model, opt, sched, 1)  # the live state moves on while the save may still be writing
    background.wait()
    a = json.loads((tmp_path / "sync" / "step-00000002" / "manifest.json").read_text())
    b = json.loads((tmp_path / "async" / "step-00000002" / "manifest.json").read_text())
    for name in ("state-pp00.safetensors", "extra.json", "extra.safetensors"):  # byte-identical files
        assert a["files"][name] == b["files"][name], name
    fresh, fresh_opt, _ = make_run(seed=1)
    background.load(background.resolve("latest"), [fresh], fresh_opt)
    assert_same_params(trainable(fresh), snapshot)
    # back-to-back async saves: the second waits for the first; keep_last still applies
    for step in (3, 4, 5):
        save_run(background, step, model, opt, sched)
    background.wait()
    assert background.steps() == [4, 5]


def test_sync_saves_write_the_live_tensors_async_saves_copy_them():
    """A synchronous save is written before training goes on, so it needs no host copy of the
    stage's weights and optimizer state (for full SFT that would be three times the model); an
    async save must snapshot them."""
    from nxd_finetune.checkpoint.state import collect
    from nxd_finetune.checkpoint.state import trainable as stage_params

    model, opt, sched = make_run(lora=False)
    train(model, opt, sched, 1)
    params = stage_params([model])
    live = {p.data_ptr() for p in model.parameters()} | {
        v.data_ptr() for st in opt.state.values() for v in st.values() if v.dim() > 0}
    for copy in (False, True):
        out = collect(params, opt, None, copy=copy)
        big = [t for t in out.values() if t.dim() > 0]
        assert len(big) == 3 * len(params)  # weight, exp_avg, exp_avg_sq of each
        shared = sum(t.data_ptr() in live for t in big)
        assert shared == (0 if copy else len(big)), (copy, shared, len(big))


def test_async_save_failure_is_raised_by_wait(tmp_path):
    model, opt, sched = make_run()
    blocker = tmp_path / "root"
    blocker.write_text("a file where the checkpoint directory should be")
    mgr = CheckpointManager(blocker, async_save=True)
    save_run(mgr, 1, model, opt, sched)
    with pytest.raises(CheckpointError, match="saving checkpoint step-00000001 .* failed"):
        mgr.wait()
    mgr.wait()  # reported once


# ----------------------------------------------------------------------------- S3


def test_s3_round_trip_retention_and_corruption(moto_s3, tmp_path):
    import boto3

    model, opt, sched = make_run()
    mgr = CheckpointManager("s3://nxd-test/runs/ckpt", keep_last=2, async_save=True)
    params = {}
    for step in (1, 2, 3):
        train(model, opt, sched, 1)
        save_run(mgr, step, model, opt, sched)
        params[step] = trainable(model)
    mgr.wait()
    assert mgr.steps() == [2, 3]
    ref = mgr.resolve("latest")
    fresh, fresh_opt, fresh_sched = make_run(seed=1)
    extra = mgr.load(ref, [fresh], fresh_opt)
    fresh_sched.load_state_dict(extra["scheduler"])
    assert_same_params(trainable(fresh), params[3])
    assert_same_optimizer(fresh_opt, opt)
    assert not list(tmp_path.glob("nxd-ckpt-*"))  # downloads cleaned up
    s3 = boto3.session.Session().client("s3", endpoint_url=moto_s3, region_name="us-east-1")
    key = "runs/ckpt/step-00000003/state-pp00.safetensors"
    body = bytearray(s3.get_object(Bucket="nxd-test", Key=key)["Body"].read())
    body[-5] ^= 0x01
    s3.put_object(Bucket="nxd-test", Key=key, Body=bytes(body))
    with pytest.warns(CheckpointWarning, match="sha256"):
        ref = mgr.resolve("latest")
    assert ref.step == 2
    mgr.load(ref, [fresh], fresh_opt)
    assert_same_params(trainable(fresh), params[2])
    assert mgr.resolve("s3://nxd-test/runs/ckpt/step-00000002").step == 2
    assert Path(tmp_path).exists()


def test_zero1_bf16_keeps_fp32_masters_and_loads_into_plain_adamw(tmp_path):
    """ZeRO-1 (dp=1, one process) over bf16 LoRA factors: the fp32 masters are saved next to the
    bf16 parameters and restored exactly; a plain AdamW loads the same checkpoint (moments cast)."""
    from nxd_finetune.parallel.zero1 import Zero1Optimizer

    def zero1_run(seed: int):
        model, _, _ = make_run(seed=seed)
        model.to(torch.bfloat16)
        return model, Zero1Optimizer([p for p in model.parameters() if p.requires_grad], torch.optim.AdamW, None,
                                     lr=1e-2)

    model, opt = zero1_run(0)
    for _ in range(2):
        causal_lm_loss(model(IDS).float(), LABELS).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    mgr = CheckpointManager(tmp_path)
    mgr.save(2, [model], opt)
    tensors = load_file(tmp_path / "step-00000002" / "state-pp00.safetensors")
    name = "model.layers.0.mlp.up_proj.lora_B.weight"
    assert tensors[f"param/{name}"].dtype == torch.bfloat16 and tensors[f"optim/{name}/master"].dtype == torch.float32
    assert not torch.equal(tensors[f"optim/{name}/master"], tensors[f"param/{name}"].float())  # more precise

    fresh, fresh_opt = zero1_run(1)
    mgr.load(mgr.resolve("latest"), [fresh], fresh_opt)
    assert_same_params(trainable(fresh), trainable(model))
    for mine, theirs in zip(fresh_opt.flats, opt.flats, strict=True):
        assert torch.equal(mine.master, theirs.master)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh_opt.inner.state[mine.master][key], opt.inner.state[theirs.master][key])

    plain, _, _ = make_run(seed=1)
    plain.to(torch.bfloat16)
    adamw = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    mgr.load(mgr.resolve("latest"), [plain], adamw)
    p = plain.get_parameter(name)
    assert torch.equal(p, model.get_parameter(name)) and adamw.state[p]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(adamw.state[p]["exp_avg"], tensors[f"optim/{name}/exp_avg"].to(torch.bfloat16))


def test_streamed_stage_file_is_a_safetensors_file(tmp_path):
    """``write_streamed`` (a synchronous save at tp > 1 writes each tensor as it is gathered) lays
    out the header from the plan and the bytes as they come: safetensors reads every dtype, shape,
    scalar and empty tensor back; a tensor that differs from its plan entry is an error."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from nxd_finetune.checkpoint.writer import write_streamed

    g = torch.Generator().manual_seed(3)
    tensors = {"param/a": torch.randn(5, 3, generator=g).to(torch.bfloat16), "optim/a/step": torch.tensor(7.0),
               "param/b": torch.randn(4, generator=g, dtype=torch.float64), "x/empty": torch.zeros(0, 2),
               "x/mask": torch.rand(3, 3, generator=g) > 0.5, "x/ids": torch.arange(6, dtype=torch.int64).view(2, 3),
               "x/half": torch.randn(2, 2, generator=g).half()}
    plan = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    path = tmp_path / "stage.safetensors"
    assert write_streamed(str(path), plan, iter(tensors.items())) == list(tensors)
    back = load_file(path)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_slice("param/a")[1:3], tensors["param/a"][1:3])
    wrong = dict(tensors, **{"param/b": torch.zeros(5, dtype=torch.float64)})
    with pytest.raises(CheckpointError, match=r"param/b .* came as param/b: torch.float64 \(5,\)"):
        write_streamed(str(path), plan, iter(wrong.items()))

"""The NxD-style API and the launcher: config validation, meta init and activation checkpointing
in one process; the launcher's results and its one error line; and pipeline parallel (real gloo
groups, 4 forked processes): tp=2 x pp=2 full SFT of a tiny Llama with tied embeddings,
initialised from per-rank slices of a checkpoint and trained with
``model.run_train(micro_batches)``, equals one process training the whole model on the whole batch
(losses, gradient norms, every final weight); ``param_init_fn`` initialisation gives the two
copies of a tied embedding the same values; at tp=2 (2 forked processes) the full-model export
and a synchronous checkpoint save stream one gathered tensor at a time into their files."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nxd_finetune.api import (
    PipelineModel,
    apply_activation_checkpointing,
    initialize_parallel_model,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
)
from nxd_finetune.errors import NxdError
from nxd_finetune.loss import causal_lm_loss
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, save_pretrained
from nxd_finetune.parallel import gather_full, iter_placements
from nxd_finetune.parallel.launch import device_backend, init_distributed, launch, smoke_test

TINY = DecoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)
STEPS = 3
SMALL = DecoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)


pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path


def _batches():
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, TINY.vocab_size, (STEPS, 4, 8), generator=g)
    labels = ids.clone()
    labels[:, :, :3] = -100
    labels[:, 1, 3:5] = -100  # uneven target counts between the micro-batches
    return ids, labels


def _reference(model_dir: str) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    ids, labels = _batches()
    ref = load_pretrained(model_dir)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    losses, norms = [], []
    for s in range(STEPS):
        n = (labels[s][:, 1:] != -100).sum()
        loss = causal_lm_loss(ref(ids[s]), labels[s], reduction="sum") / n
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, {k: v.detach().clone() for k, v in ref.named_parameters()}


def _worker(model_dir: str) -> dict:
    init_distributed()
    torch.set_num_threads(1)
    ids, labels = _batches()
    config = neuronx_distributed_config(
        tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_config={"num_microbatches": 2},
        optimizer_config={"max_grad_norm": 0.5, "grad_reduction": "sum"},
        model_init_config={"meta_device_init": True, "checkpoint": model_dir})
    state = config.state
    model = initialize_parallel_model(config, build_model, DecoderConfig.from_hf(model_dir))
    assert isinstance(model, PipelineModel) and len(model.stages) == 1
    with pytest.raises(NxdError, match="run_train"):
        model(ids[0])
    opt = initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=1e-2, eps=1e-4)
    losses, norms = [], []
    for s in range(STEPS):
        loss = model.run_train([{"input_ids": ids[s][r:r + 2], "labels": labels[s][r:r + 2]} for r in (0, 2)])
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        norms.append(float(opt.grad_norm))
    stage = model.stages[0]
    specs = {n: sp for n, _, _, sp in iter_placements(stage)}
    weights = {n: (gather_full(p, specs[n], state) if n in specs else p.detach()).clone()
               for n, p in stage.named_parameters()}

    # param_init_fn: each rank draws its own values; the tied lm_head copy gets stage 0's embedding
    torch.manual_seed(100 + dist.get_rank())
    init_cfg = neuronx_distributed_config(
        pipeline_parallel_size=2, tensor_parallel_size=2,
        model_init_config={"meta_device_init": True, "param_init_fn": lambda m: [
            torch.nn.init.normal_(p) for p in m.parameters(recurse=False)]})
    fresh = initialize_parallel_model(init_cfg, build_model, TINY).stages[0]
    tied = fresh.model.embed_tokens.weight if fresh.model.embed_tokens is not None else fresh.lm_head.weight
    copies = [torch.empty_like(tied) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tied.detach().contiguous())
    dist.destroy_process_group()
    return {"rank": (state.coord("pp"), state.coord("tp")), "losses": losses, "norms": norms, "weights": weights,
            "tied copies": copies}


def test_tp2_pp2_api_training_matches_one_process(tmp_path):
    torch.manual_seed(1)
    model = build_model(TINY, device="cpu")
    save_pretrained(TINY, model.state_dict().items(), tmp_path / "tiny")
    ref_losses, ref_norms, ref_weights = _reference(str(tmp_path / "tiny"))
    results = launch(_worker, 4, str(tmp_path / "tiny"), start_method="fork")
    assert min(ref_norms) > 0.5  # clipping was active
    seen: set[str] = set()
    for out in results:
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=0), out["rank"]
        assert out["norms"] == pytest.approx(ref_norms, rel=1e-5, abs=0), out["rank"]
        for name, got in out["weights"].items():
            want = ref_weights["model.embed_tokens.weight" if name == "lm_head.weight" else name]  # tied
            torch.testing.assert_close(got, want, atol=2e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
            seen.add(name)
        # ranks (pp 0, tp t) hold the embedding and (pp 1, tp t) the head: each pair equal
        copies = out["tied copies"]
        assert torch.equal(copies[0], copies[2]) and torch.equal(copies[1], copies[3])
        assert not torch.equal(copies[0], copies[1])  # tp shards of different rows
    assert seen == set(ref_weights) | {"lm_head.weight"}  # every weight checked, the tied head on pp rank 1


def _recorded(events: list[str], stream, write):
    """``stream`` (a generator function of ``(key, tensor)``) and ``write`` (a file writer) that
    also append ``"tensor KEY"`` / ``"write"`` to ``events``."""

    def streamed(*args, **kwargs):
        for item in stream(*args, **kwargs):
            events.append(f"tensor {item[0]}")
            yield item

    def written(f, t):
        events.append("write")
        write(f, t)

    return streamed, written


def _most_pending(events: list[str]) -> int:
    """The most tensors handed out and not yet written at any point of ``events``."""
    pending = most = 0
    for event in events:
        pending += 1 if event.startswith("tensor") else -1
        most = max(most, pending)
    return most


def _export_worker(model_dir: str, out_dir: str) -> list[str]:
    """tp=2 full-model export (the full-SFT path) with the stream and the file writes recorded."""
    from pathlib import Path

    import nxd_finetune.export as export
    import nxd_finetune.models.loading as loading
    from nxd_finetune.parallel.parallelize import RankModel

    init_distributed()
    torch.set_num_threads(1)
    config = neuronx_distributed_config(tensor_parallel_size=2,
                                        model_init_config={"meta_device_init": True, "checkpoint": model_dir})
    model = initialize_parallel_model(config, build_model, DecoderConfig.from_hf(model_dir))
    events: list[str] = []
    # this forked worker only
    export._streamed_model, loading.write_tensor = _recorded(events, export._streamed_model, loading.write_tensor)
    spec = export.ExportSpec("full", Path(model_dir), model_dir, torch.float32)
    export.export_model(RankModel([model], config.state), Path(out_dir), spec, config=model.config, lora=None)
    dist.destroy_process_group()
    return events


def test_tp2_full_export_streams_one_tensor_at_a_time(tmp_path):
    """At tp > 1 the full-model export gathers each tensor when the writer asks for it: rank 0
    writes a tensor before the next one is gathered (never holds the model), and the file is the
    source checkpoint again."""
    torch.manual_seed(2)
    model = build_model(TINY, device="cpu")
    save_pretrained(TINY, model.state_dict().items(), tmp_path / "tiny")
    writer, other = launch(_export_worker, 2, str(tmp_path / "tiny"), str(tmp_path / "out"), start_method="fork")
    tensors = [e for e in writer if e.startswith("tensor")]
    assert len(tensors) == len(model.state_dict()) and other == tensors  # both ranks walk every tensor
    assert _most_pending(writer) <= 2, writer  # the tied lm_head is skipped, so at most one more
    assert writer.count("write") == len(tensors) - 1  # lm_head.weight is not written (tied)
    got = load_pretrained(tmp_path / "out").state_dict()
    for name, want in model.state_dict().items():
        torch.testing.assert_close(got[name], want, atol=0, rtol=0, msg=name)


def _save_worker(model_dir: str, root: str) -> tuple[list[str], dict[str, torch.Tensor]]:
    """tp=2 full SFT, one AdamW step, then a synchronous checkpoint save with the stage stream and
    the file writes recorded; returns them and the gathered parameters."""
    from nxd_finetune.checkpoint import CheckpointManager
    from nxd_finetune.checkpoint import state as ckpt_state
    from nxd_finetune.checkpoint import writer as ckpt_writer

    init_distributed()
    torch.set_num_threads(1)
    config = neuronx_distributed_config(tensor_parallel_size=2,
                                        model_init_config={"meta_device_init": True, "checkpoint": model_dir})
    model = initialize_parallel_model(config, build_model, DecoderConfig.from_hf(model_dir))
    opt = initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=1e-2)
    ids, _ = _batches()
    model(ids[0]).float().square().mean().backward()
    opt.step()
    events: list[str] = []
    # this forked worker only
    ckpt_state.StageTensors.tensors, ckpt_writer.write_tensor = _recorded(
        events, ckpt_state.StageTensors.tensors, ckpt_writer.write_tensor)
    CheckpointManager(root, state=config.state).save(1, [model], opt, {"step": 1})
    specs = {n: sp for n, _, _, sp in iter_placements(model)}
    params = {n: (gather_full(p, specs[n], config.state) if n in specs else p).detach().clone()
              for n, p in model.named_parameters()}
    dist.destroy_process_group()
    return events, params


def test_tp2_checkpoint_save_streams_one_tensor_at_a_time(tmp_path):
    """A synchronous save at tp > 1 gathers each parameter and optimizer state when the writer
    asks for it: rank 0 writes every tensor before the next one is gathered."""
    import json

    from safetensors.torch import load_file

    torch.manual_seed(3)
    save_pretrained(TINY, build_model(TINY, device="cpu").state_dict().items(), tmp_path / "tiny")
    (writer, params), (other, _) = launch(_save_worker, 2, str(tmp_path / "tiny"), str(tmp_path / "ckpt"),
                                          start_method="fork")
    tensors = [e for e in writer if e.startswith("tensor")]
    assert len(tensors) > 3 * len(params) and other == tensors  # params, exp_avg, exp_avg_sq, step
    assert _most_pending(writer) <= 1, writer
    assert writer.count("write") == len(tensors)
    step = tmp_path / "ckpt" / "step-00000001"
    files = sorted(set(json.loads((step / "manifest.json").read_text())["tensors"].values()))
    saved = {k: v for f in files for k, v in load_file(step / f).items()}
    for name, want in params.items():
        torch.testing.assert_close(saved[f"param/{name}"], want, atol=0, rtol=0, msg=name)


# ----------------------------------------------------------------------------- launcher


def _failing(bad_rank: int) -> None:
    init_distributed()
    if dist.get_rank() == bad_rank:
        raise ValueError(f"bad value on rank {bad_rank}\nsecond line")
    dist.barrier()  # the other rank blocks here until the launcher stops it


def test_launch_returns_results_and_reports_failing_rank(tmp_path):
    results = launch(smoke_test, 2, 10.0)  # the default spawn start method
    assert results == [{"rank": r, "world_size": 2, "sum": 21.0, "backend": "gloo", "tmpdir": str(tmp_path)}
                       for r in range(2)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("nxd-launch-")]  # log dir removed
    with pytest.raises(NxdError) as e:
        launch(_failing, 2, 1, start_method="fork")
    assert str(e.value).startswith("worker rank 1 failed: ValueError: bad value on rank 1")
    assert "\n" not in str(e.value)
    with pytest.raises(NxdError, match="nproc must be a positive integer, got 0"):
        launch(smoke_test, 0)


# ----------------------------------------------------------------------------- single process


def test_config_validation_and_backends():
    with pytest.raises(NxdError, match="optimizer_config key 'zero1_enabled' \\(did you mean 'zero_one_enabled'"):
        neuronx_distributed_config(optimizer_config={"zero1_enabled": True})
    with pytest.raises(NxdError, match="grad_reduction must be 'mean' or 'sum', got 'avg'"):
        neuronx_distributed_config(optimizer_config={"grad_reduction": "avg"})
    with pytest.raises(NxdError, match="world size 1 is not divisible by tp\\*pp = 2\\*1 = 2"):
        neuronx_distributed_config(tensor_parallel_size=2)
    with pytest.raises(NxdError, match="pad_model=True is not supported"):
        neuronx_distributed_config(pad_model=True)
    config = neuronx_distributed_config(pipeline_parallel_size=1)
    assert config["optimizer_config"]["grad_clipping"] is True and config.state.size("dp") == 1
    with pytest.raises(NxdError, match="set model_init_config 'checkpoint' or 'param_init_fn'"):
        initialize_parallel_model(neuronx_distributed_config(model_init_config={"meta_device_init": True}),
                                  build_model, SMALL)
    with pytest.raises(NxdError, match="device xla \\(Trainium\\) is not available"):
        device_backend("xla")
    cpu = device_backend("cpu")
    assert (cpu.name, cpu.dist_backend, cpu.device.type) == ("cpu", "gloo", "cpu")


def test_meta_init_and_activation_checkpointing_keep_gradients():
    def init_fn(module: nn.Module) -> None:
        with torch.no_grad():
            for p in module.parameters(recurse=False):
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p))

    config = neuronx_distributed_config(model_init_config={"meta_device_init": True, "param_init_fn": init_fn},
                                        activation_checkpoint_config="full")
    model = initialize_parallel_model(config, build_model, SMALL)
    ref = build_model(SMALL, device="cpu")
    for m in ref.modules():
        init_fn(m)
    ids = torch.randint(0, SMALL.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    F.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    F.cross_entropy(ref(ids).flatten(0, 1), ids.flatten()).backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, atol=1e-6, rtol=0, msg=name)
    assert apply_activation_checkpointing(ref, nn.Linear) == 7 * SMALL.num_hidden_layers + 1
    with pytest.raises(NxdError, match="must be None, 'full' or a module class"):
        apply_activation_checkpointing(ref, "selective")


def test_activation_checkpointing_records_no_graph_and_frees_the_inputs():
    """The checkpointed layers' forward records no autograd graph (its tensors get no grad_fn inside
    a layer), and after backward nothing keeps a layer's input alive, not even the loss's graph."""
    import weakref

    model = build_model(SMALL, device="cpu")
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("model.layers.0.mlp"))  # nothing before layer 0 is trainable
    assert apply_activation_checkpointing(model, "full") == SMALL.num_hidden_layers
    inputs: list[weakref.ref[torch.Tensor]] = []
    inner: list[bool] = []
    model.model.layers["1"].register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    model.model.layers["0"].mlp.register_forward_hook(lambda m, args, out: inner.append(out.grad_fn is not None))
    ids = torch.randint(0, SMALL.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    assert inner == [False, True]  # the forward, then the recomputation in backward
    assert all(p.grad is not None for p in model.model.layers["0"].mlp.parameters())
    assert inputs[0]() is None and loss.grad_fn is not None

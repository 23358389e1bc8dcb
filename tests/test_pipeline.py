"""Pipeline parallelism (``nxd_finetune.parallel.pipeline``) against the single-process trainer.

Unit tests cover ``split_layers`` (and its errors) and stage cutting in one process. The
distributed tests fork 2 gloo ranks (pp=2) once per test and run several cases each on a tiny
Llama (hidden 64, 4 layers, 4 heads / 2 kv heads, vocab 128, fixed seed) with packed micro-batches
(position/segment ids, -100 labels). The reference is ``micro_step`` below (full logits, loss summed
over a micro-batch's targets / targets of the whole step) with gradient accumulation, computed in
the parent before forking. Workers return ``{check: (got, expected)}``; the parent asserts to 1e-5.
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from gloo_world import run_world

from nxd_finetune.errors import NxdError
from nxd_finetune.lora import LoraConfig, inject_lora
from nxd_finetune.loss import IGNORE_INDEX, causal_lm_loss, shift_labels
from nxd_finetune.models import DecoderConfig
from nxd_finetune.models.llama import DecoderForCausalLM
from nxd_finetune.parallel import Layout, ParallelState
from nxd_finetune.parallel.pipeline import (
    PipelineRunner,
    build_stage_module,
    build_stages,
    split_layers,
    stage_ids_of_rank,
)
from nxd_finetune.sft.engine import autocast

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2)
CPU = torch.device("cpu")
# name: (schedule, virtual_stages, lora, tied, ragged last micro-batch)
GRAD_CASES = {
    "full-1f1b": ("1f1b", 1, False, False, False),
    "full-interleaved": ("interleaved_1f1b", 2, False, False, False),
    "lora-1f1b": ("1f1b", 1, True, False, True),
    "lora-interleaved": ("interleaved_1f1b", 2, True, False, False),
    "tied-gpipe": ("gpipe", 1, False, True, False),
    # the last stage returns hidden states; its head runs inside the loss, 3 target positions at a time
    "lora-1f1b-chunked": ("1f1b", 1, True, False, True, 3),
    "tied-interleaved-chunked": ("interleaved_1f1b", 2, False, True, False, 3),
}
CURVE_CASES = {"full-1f1b": GRAD_CASES["full-1f1b"], "lora-interleaved": GRAD_CASES["lora-interleaved"],
               "tied-1f1b": ("1f1b", 1, False, True, False)}
CURVE_STEPS, LR = 10, 3e-3



@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on shared, busy cores two OpenMP threads make these tiny models ~20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- model and data


def make_model(lora: bool = False, tied: bool = False) -> DecoderForCausalLM:
    """The tiny model, identical in every process: norms perturbed, LoRA B non-zero."""
    torch.manual_seed(0)
    model = DecoderForCausalLM(DecoderConfig(**TINY, tie_word_embeddings=tied))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    if lora:
        inject_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
    return model


def packed_batch(gen: torch.Generator, rows: int, seq: int) -> dict[str, torch.Tensor]:
    """Rows of 2-3 packed samples then padding (segment 0), like ``data.packing``: positions restart
    per sample, the first token of each sample, prompt tokens and padding have label -100."""
    batch = {k: torch.zeros(rows, seq, dtype=torch.long) for k in ("input_ids", "position_ids", "segment_ids")}
    batch["input_ids"] = torch.randint(0, TINY["vocab_size"], (rows, seq), generator=gen)
    batch["labels"] = torch.full((rows, seq), IGNORE_INDEX)
    for r in range(rows):
        t = 0
        for seg in range(1, 4):
            n = int(torch.randint(3, seq // 2, (1,), generator=gen))
            if t + n > seq:
                break
            batch["position_ids"][r, t : t + n] = torch.arange(n)
            batch["segment_ids"][r, t : t + n] = seg
            prompt = int(torch.randint(1, n - 1, (1,), generator=gen))
            batch["labels"][r, t + prompt : t + n] = batch["input_ids"][r, t + prompt : t + n]
            t += n
    return batch


def step_batches(step: int, ragged: bool = False) -> list[dict[str, torch.Tensor]]:
    """The 4 micro-batches of optimizer step ``step``; step 4 uses a shorter sequence (a new shape
    for the pipeline), ``ragged`` makes the last micro-batch smaller than the others."""
    gen = torch.Generator().manual_seed(100 + step)
    seq = 12 if step == 4 else 16
    return [packed_batch(gen, 1 if ragged and i == 3 else 2, seq - 4 if ragged and i == 3 else seq) for i in range(4)]


def n_targets(mbs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """As ``sft.trainer.train`` counts them."""
    return sum((shift_labels(b["labels"]) != IGNORE_INDEX).sum() for b in mbs).clamp(min=1)


def micro_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], n_targets: torch.Tensor,
               device: torch.device, precision: str) -> torch.Tensor:
    """Forward + backward of one micro-batch on a whole (unsharded) model with full logits;
    returns its summed loss / ``n_targets`` (detached). The reference the parallel paths are
    tested against (the engine computes the same loss, at target positions only)."""
    with autocast(device, precision):
        logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))
    loss = causal_lm_loss(logits, batch["labels"], reduction="sum") / n_targets
    loss.backward()
    return loss.detach()


def reference_step(model: torch.nn.Module, mbs: list[dict[str, torch.Tensor]]) -> float:
    n = n_targets(mbs)
    return float(sum(micro_step(model, b, n, CPU, "fp32") for b in mbs))


@torch.no_grad()
def reference_eval(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[loss sum, correct, targets]`` as ``sft.trainer.evaluate`` accumulates them."""
    logits = model(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
    targets = shift_labels(batch["labels"])
    mask = targets != IGNORE_INDEX
    loss = causal_lm_loss(logits, batch["labels"], reduction="sum")
    return torch.stack([loss, ((logits.argmax(-1) == targets) & mask).sum().float(), mask.sum().float()])


def reference_grads(case: tuple) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """Step loss, gradients by name and eval stats of ``step_batches(1)[0]``."""
    _, _, lora, tied, ragged, *_ = case  # the reference never chunks
    model = make_model(lora, tied)
    loss = reference_step(model, step_batches(0, ragged))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads, reference_eval(model, step_batches(1)[0])


def reference_curve(case: tuple) -> list[float]:
    _, _, lora, tied, _ = case
    model = make_model(lora, tied)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(CURVE_STEPS):
        losses.append(reference_step(model, step_batches(step)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


# ----------------------------------------------------------------------------- harness


def run_pp2(fn, tmp_path, monkeypatch, *args, timeout: float = 120.0) -> list[dict]:
    """Run ``fn(rank, world, *args)`` on 2 forked gloo ranks (``gloo_world.run_world``), temp files
    under ``tmp_path``; returns each rank's result."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return run_world(fn, 2, tmp_path, *args, timeout=timeout)


def pipeline(case: tuple, rank: int) -> tuple[PipelineRunner, list[torch.nn.Module]]:
    schedule, virtual, lora, tied, _, *chunk = case
    state = ParallelState(Layout.of(pp=2))
    assert state.coord("pp") == rank
    stages = build_stages(make_model(lora, tied), state, virtual)
    runner = PipelineRunner(stages, state, schedule, n_microbatches=4, loss_chunk_rows=chunk[0] if chunk else None)
    assert getattr(stages[-1], "return_hidden", False) == (bool(chunk) and rank == 1)  # the head runs in the loss
    return runner, stages


# ----------------------------------------------------------------------------- unit tests


def test_split_layers_even_and_cuts():
    assert split_layers(4, 2) == [[0, 1], [2, 3]]
    assert split_layers(4, 2, 2) == [[0], [1], [2], [3]]
    assert split_layers(4, 1) == [[0, 1, 2, 3]]
    assert split_layers(4, 2, cuts=[1]) == [[0], [1, 2, 3]]
    assert split_layers(8, 2, 2, cuts=[1, 2, 5]) == [[0], [1], [2, 3, 4], [5, 6, 7]]
    assert stage_ids_of_rank(1, 2, 2) == [1, 3] and stage_ids_of_rank(0, 4) == [0]


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        ((6, 4), {}, "6 layers do not split evenly into pp*virtual_stages=4*1=4 stages"),
        ((4, 2, 4), {}, "4 layers do not split evenly into pp*virtual_stages=2*4=8 stages"),
        ((4, 2), {"cuts": [1, 2]}, "has 2 entries; pp*virtual_stages=2*1=2 stages need 1"),
        ((8, 2, 2), {"cuts": [1, 5, 5]}, "must be strictly increasing layer indices in 1..7"),
        ((4, 2), {"cuts": [4]}, "must be strictly increasing layer indices in 1..3"),
        ((4, 2), {"cuts": [0]}, "must be strictly increasing"),
        ((4, 0), {}, "pp must be a positive integer, got 0"),
    ],
)
def test_split_layers_errors(args, kwargs, fragment):
    with pytest.raises(NxdError) as err:
        split_layers(*args, **kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_stage_modules_keep_names_and_compose_to_the_model():
    model = make_model(lora=True)
    full_names = {n for n, _ in model.named_parameters()}
    split = split_layers(4, 2, 2)
    stages = [build_stage_module(model, ids, s == 0, s == 3) for s, ids in enumerate(split)]
    assert {n for n, _ in model.named_parameters()} == full_names, "cutting must leave the model intact"
    names = [[n for n, _ in s.named_parameters()] for s in stages]
    assert set().union(*names) == full_names and sum(map(len, names)) == len(full_names)
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[3]
    assert any(n.startswith("model.layers.2.self_attn.q_proj.lora_A") for n in names[2])
    assert stages[1].model.embed_tokens is None and stages[1].model.norm is None and stages[1].lm_head is None
    assert list(stages[2].model.layers.keys()) == ["2"]
    assert stages[2].model.layers["2"] is model.model.layers["2"], "stages share the model's modules"
    batch = step_batches(0)[0]
    side = (batch["position_ids"], batch["segment_ids"])
    h = batch["input_ids"]
    for stage in stages:
        h = stage(h, *side)
    torch.testing.assert_close(h, model(batch["input_ids"], *side), atol=1e-6, rtol=1e-6)
    with pytest.raises(NxdError, match=r"pipeline stage layers \[7\] are not in the model \(layers 0..3\)"):
        build_stage_module(model, [3, 7], False, True)


def test_runner_refuses_bad_layouts():
    state = ParallelState(Layout.of())
    stage = build_stage_module(make_model(), [0, 1, 2, 3], True, True)
    with pytest.raises(NxdError, match="schedule 'zb' is not supported"):
        PipelineRunner([stage], state, "zb", 4)
    with pytest.raises(NxdError, match=r"needs pp >= 2 \(pp=1\)"):
        PipelineRunner([stage], state, "1f1b", 4)
    # the layout checks come before any process group is used
    pp2 = SimpleNamespace(size={"pp": 2, "tp": 1, "dp": 1}.__getitem__)
    with pytest.raises(NxdError, match="interleaved_1f1b needs at least 2 stage modules per rank, got 1"):
        PipelineRunner([stage], pp2, "interleaved_1f1b", 4)
    with pytest.raises(NxdError, match="gpipe needs exactly 1 stage module per rank, got 2"):
        PipelineRunner([stage, stage], pp2, "gpipe", 4)
    with pytest.raises(NxdError, match=r"1 micro-batches do not fit pipeline schedule 1f1b with pp=2 \(1f1b needs"):
        PipelineRunner([stage], pp2, "1f1b", 1)
    with pytest.raises(NxdError, match="5 micro-batches do not fit pipeline schedule interleaved_1f1b"):
        PipelineRunner([stage, stage], pp2, "interleaved_1f1b", 5)


# ----------------------------------------------------------------------------- distributed


def _grads_worker(rank: int, world: int, refs: dict) -> dict:
    out = {}
    for name, case in GRAD_CASES.items():
        runner, stages = pipeline(case, rank)
        ref_loss, ref_grads, ref_eval = refs[name]
        mbs = step_batches(0, ragged=case[4])
        loss = runner.step(mbs, n_targets(mbs) if rank == 0 else None)  # counted by the runner on rank 1
        out[f"{name}/loss"] = (loss, torch.tensor(ref_loss))
        norm_sq = sum(p.grad.pow(2).sum() for p in runner.grad_norm_parameters())
        dist.all_reduce(norm_sq)  # the pp group is the world here
        out[f"{name}/grad_norm_sq"] = (norm_sq, sum(g.pow(2).sum() for g in ref_grads.values()))
        out[f"{name}/eval"] = (runner.eval_step(step_batches(1)[0]), ref_eval)
        for stage in stages:
            for pname, p in stage.named_parameters():
                key = "model.embed_tokens.weight" if case[3] and pname == "lm_head.weight" else pname
                if not p.requires_grad:
                    assert p.grad is None, f"{name}: frozen {pname} got a gradient"
                    continue
                out[f"{name}/{pname}"] = (p.grad, ref_grads[key])
    return out


def test_pipeline_loss_and_grads_match_single_process(tmp_path, monkeypatch):
    refs = {name: reference_grads(case) for name, case in GRAD_CASES.items()}
    # the data has teeth: dropping the side inputs changes the loss
    model, mbs = make_model(), step_batches(0)
    no_side = float(sum(micro_step(model, {k: b[k] for k in ("input_ids", "labels")}, n_targets(mbs), CPU, "fp32")
                        for b in mbs))
    assert abs(no_side - refs["full-1f1b"][0]) > 1e-3
    results = run_pp2(_grads_worker, tmp_path, monkeypatch, refs)
    for name, (_, ref_grads, _) in refs.items():
        checked = {k.split("/", 1)[1] for r in results for k in r if k.startswith(name + "/")}
        checked -= {"loss", "grad_norm_sq", "eval"}
        if GRAD_CASES[name][3]:
            checked.discard("lm_head.weight")
        assert checked == set(ref_grads), f"{name}: parameters not covered: {set(ref_grads) ^ checked}"
    for rank, checks in enumerate(results):
        for key, (got, expected) in checks.items():
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, r=rank, k=key: f"rank {r} {k}: {m}")


def _curve_worker(rank: int, world: int) -> dict:
    out = {}
    for name, case in CURVE_CASES.items():
        runner, stages = pipeline(case, rank)
        params = [p for s in stages for p in s.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=LR)
        losses = []
        for step in range(CURVE_STEPS):
            losses.append(float(runner.step(step_batches(step))))
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = losses
        if case[3]:  # the two tied copies stayed equal
            tied = stages[0].model.embed_tokens if rank == 0 else stages[-1].lm_head
            out[name + "/tied"] = tied.weight.detach().clone()
    return out


def test_pipeline_adamw_loss_curve_matches_single_process(tmp_path, monkeypatch):
    refs = {name: reference_curve(case) for name, case in CURVE_CASES.items()}
    results = run_pp2(_curve_worker, tmp_path, monkeypatch)
    for name, ref in refs.items():
        assert ref[-1] < ref[0] - 0.05, f"{name}: the reference does not learn: {ref}"
        for rank in range(2):
            torch.testing.assert_close(torch.tensor(results[rank][name]), torch.tensor(ref), rtol=1e-5, atol=0,
                                       msg=lambda m, r=rank, n=name: f"rank {r} {n}: {m}")
    torch.testing.assert_close(results[0]["tied-1f1b/tied"], results[1]["tied-1f1b/tied"], rtol=0, atol=0)

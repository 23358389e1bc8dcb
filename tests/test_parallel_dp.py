"""Data parallel, ZeRO-1, grad-norm clipping and the NxD-style API over them, on real gloo groups.

Multi-rank tests start their workers with :func:`nxd_finetune.parallel.launch.launch` (the torch
elastic agent; ``fork`` for speed; the launcher's own test is in ``test_parallel_api.py``), so the
launcher is under test everywhere. A worker returns ``{check: (kind, got, expected, atol)}``; the parent asserts,
so a failure names the rank and the check. ``close``: within ``atol``; ``equal``: exactly (ints
or tensors); ``differ``: differs by 5% of the expected magnitude (proves a check has teeth).
Oracles are single-process torch runs on the whole batch (``torch.optim.AdamW``,
``torch.nn.utils.clip_grad_norm_``) computed inside each worker.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nxd_finetune.api import (
    initialize_parallel_model,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
)
from nxd_finetune.errors import NxdError
from nxd_finetune.loss import causal_lm_loss, vocab_parallel_cross_entropy
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, save_pretrained
from nxd_finetune.parallel import (
    ColumnParallelLinear,
    Layout,
    ParallelState,
    RowParallelLinear,
    gather_full,
    iter_placements,
)
from nxd_finetune.parallel.clip import clip_grad_norm, clip_grad_norm_zero1
from nxd_finetune.parallel.data_parallel import allreduce_gradients, allreduce_scalar_sum
from nxd_finetune.parallel.launch import init_distributed, launch
from nxd_finetune.parallel.zero1 import Zero1Optimizer

# The first optimizer built in a process imports torch._dynamo (seconds); do it once here, before
# the forked workers, instead of once per worker.
torch.optim.SGD([torch.zeros(1, requires_grad=True)])

TINY = DecoderConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64)


pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path


def assert_checks(results: list[dict]) -> int:
    n = 0
    for rank, checks in enumerate(results):
        for name, (kind, got, expected, atol) in checks.items():
            where = f"rank {rank}, {name}"
            if kind == "close":
                torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=lambda m, w=where: f"{w}: {m}")
            elif kind == "equal":
                if isinstance(expected, torch.Tensor):
                    assert torch.equal(got, expected), f"{where}: {got} != {expected}"
                else:
                    assert got == expected, f"{where}: {got!r} != {expected!r}"
            else:
                diff, scale = (got - expected).abs().max(), expected.abs().max()
                assert diff > 0.05 * scale, f"{where}: expected a difference, got {diff} (scale {scale})"
            n += 1
    return n


# ----------------------------------------------------------------------------- world 2: dp=2


def _bucket_checks(state: ParallelState, out: dict) -> None:
    """Bucketed all-reduce against the sum of both ranks' gradients computed locally."""
    shapes = [((3, 4), torch.float32), ((5,), torch.bfloat16), ((7, 2), torch.float32), ((6,), torch.bfloat16),
              ((2, 3), torch.float32)]

    def grads_of(rank: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + rank)
        return [torch.randn(s, generator=g).to(dt) for s, dt in shapes]

    expected = [a + b for a, b in zip(grads_of(0), grads_of(1), strict=True)]
    for bucket_bytes, n_expected in ((25 * 1024 * 1024, 2), (40, 4)):  # 40 B: 3 fp32 + 1 bf16
        params = [nn.Parameter(torch.zeros(s, dtype=dt)) for s, dt in shapes]
        for p, g in zip(params, grads_of(state.coord("dp")), strict=True):
            p.grad = g.clone()
        frozen = nn.Parameter(torch.zeros(3))  # no grad: skipped
        n = allreduce_gradients([*params, frozen, params[0]], state.group("dp"), bucket_bytes=bucket_bytes)
        out[f"collectives bucket={bucket_bytes}"] = ("equal", n, n_expected, 0)
        for i, (p, e) in enumerate(zip(params, expected, strict=True)):
            out[f"bucketed sum bucket={bucket_bytes} #{i}"] = ("equal", p.grad, e, 0)
        out[f"frozen grad bucket={bucket_bytes}"] = ("equal", frozen.grad is None, True, 0)
    p = nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), float(state.coord("dp") + 1))
    allreduce_gradients([p], state.group("dp"), average=True)
    out["average"] = ("close", p.grad, torch.full((4,), 1.5), 0)
    total = allreduce_scalar_sum(torch.tensor(state.coord("dp") + 3), state.group("dp"))
    out["scalar sum (long)"] = ("equal", total, torch.tensor(7), 0)


def _mlp(dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3), nn.Linear(3, 3)).to(dtype)
    model[3].requires_grad_(False)  # frozen (like a LoRA base): ZeRO-1 must skip it
    return model


def _groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.ndim == 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _mlp_data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(10, 8, 5, generator=g), torch.randn(10, 8, 3, generator=g)  # 10 steps x 8 rows


def _mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_global: int) -> torch.Tensor:
    x = x.to(next(model.parameters()).dtype)
    return (model(x).float() - y).square().sum() / n_global  # SUM over this rank's rows / global count


def _train(model, opt, steps, rows, clip=None, sched=None, start=0):
    xs, ys = _mlp_data()
    for s in range(start, start + steps):
        _mlp_loss(model, xs[s][rows], ys[s][rows], ys[s].numel()).backward()
        if clip is not None:
            clip(model)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)


def _lambda(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _zero1_mlp_checks(state: ParallelState, out: dict) -> None:
    rows = slice(4 * state.coord("dp"), 4 * state.coord("dp") + 4)
    ref = _mlp()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    _train(ref, ref_opt, 10, slice(None), sched=_lambda(ref_opt))

    model = _mlp()
    start = [p.detach().clone() for p in model.parameters()]
    opt = Zero1Optimizer(_groups(model), torch.optim.AdamW, state.group("dp"), lr=1e-2)
    _train(model, opt, 10, rows, sched=_lambda(opt))
    for (name, p), r, s in zip(model.named_parameters(), ref.parameters(), start, strict=True):
        out[f"zero1 fp32 {name}"] = ("close", p.detach(), r.detach(), 1e-6)
        if p.requires_grad:
            out[f"zero1 fp32 {name} moved"] = ("equal", torch.equal(p.detach(), s), False, 0)
    # states are 1/dp: trainable = 30 + 18 weights, 6 + 3 biases -> shards 24 + ceil(9/2) = 29 per rank
    n_state = sum(t.numel() for st in opt.inner.state.values() for k, t in st.items() if k != "step")
    n_plain = sum(t.numel() for st in ref_opt.state.values() for k, t in st.items() if k != "step")
    out["zero1 shard elements"] = ("equal", (opt.shard_numel, n_state, n_plain), (29, 58, 114), 0)
    out["zero1 master fp32"] = ("equal", {f.master.dtype for f in opt.flats}, {torch.float32}, 0)

    # plain data parallel: bucketed all-reduce + AdamW reproduces the same run
    model = _mlp()
    opt2 = torch.optim.AdamW(_groups(model), lr=1e-2)
    dp_clip = lambda m: allreduce_gradients(m.parameters(), state.group("dp"), bucket_bytes=64)
    _train(model, opt2, 10, rows, clip=dp_clip, sched=_lambda(opt2))
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        out[f"plain dp fp32 {name}"] = ("close", p.detach(), r.detach(), 1e-6)

    # state_dict round trip: 5 steps, save, fresh optimizer + scheduler, load, 5 more == 10 straight
    model = _mlp()
    opt = Zero1Optimizer(_groups(model), torch.optim.AdamW, state.group("dp"), lr=1e-2)
    sched = _lambda(opt)
    _train(model, opt, 5, rows, sched=sched)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict(), "model": model.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model = _mlp()
    model.load_state_dict(saved["model"])
    opt = Zero1Optimizer(_groups(model), torch.optim.AdamW, state.group("dp"), lr=1e-2)
    sched = _lambda(opt)
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    _train(model, opt, 5, rows, sched=sched, start=5)
    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        out[f"zero1 resumed {name}"] = ("close", p.detach(), r.detach(), 1e-6)
    layout = saved["opt"]["zero1"]
    out["zero1 layout"] = ("equal", (layout["dp_size"], [f["numel"] for f in layout["flats"]]), (2, [48, 9]), 0)
    other = Zero1Optimizer(list(_mlp().parameters()), torch.optim.AdamW, state.group("dp"), lr=1e-2)
    with pytest.raises(NxdError, match=r"does not match the optimizer's parameters: saved \[\(0, 'float32', 48\)"):
        other.load_state_dict(saved["opt"])

    # bf16 parameters, fp32 master: reference = fp32 master stepped by AdamW on the fp32 sum of
    # the two ranks' bf16 gradients (computed here for both halves with the same bf16 weights)
    model = _mlp(torch.bfloat16)
    opt = Zero1Optimizer(_groups(model), torch.optim.AdamW, state.group("dp"), lr=1e-2)
    _train(model, opt, 10, rows)
    ref_bf16 = _mlp(torch.bfloat16)
    master = [p.detach().float().clone() for p in ref_bf16.parameters()]
    master_groups = [{"params": [m for m in master if m.ndim == 2], "weight_decay": 0.1},
                     {"params": [m for m in master if m.ndim < 2], "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(master_groups, lr=1e-2)
    trainable = [p.requires_grad for p in ref_bf16.parameters()]
    xs, ys = _mlp_data()
    for s in range(10):
        grads = [torch.zeros_like(m) for m in master]
        for r in range(2):
            _mlp_loss(ref_bf16, xs[s][4 * r : 4 * r + 4], ys[s][4 * r : 4 * r + 4], ys[s].numel()).backward()
            for g, p in zip(grads, ref_bf16.parameters(), strict=True):
                if p.grad is not None:
                    g += p.grad.float()
            ref_bf16.zero_grad(set_to_none=True)
        for m, g, t in zip(master, grads, trainable, strict=True):
            m.grad = g if t else None
        ref_opt.step()
        with torch.no_grad():
            for p, m, t in zip(ref_bf16.parameters(), master, trainable, strict=True):
                if t:
                    p.copy_(m)
    for (name, p), r in zip(model.named_parameters(), ref_bf16.parameters(), strict=True):
        out[f"zero1 bf16 {name}"] = ("equal", p.detach(), r.detach(), 0)
        if p.requires_grad:
            out[f"zero1 bf16 {name} dtype"] = ("equal", p.dtype, torch.bfloat16, 0)
    full_master = torch.cat([f.master for f in opt.flats])
    gathered = [torch.zeros_like(full_master) for _ in range(2)]
    dist.all_gather(gathered, full_master, group=state.group("dp"))
    mine = torch.cat([torch.cat([m.reshape(-1) for m, t in zip(master, trainable, strict=True) if t and m.ndim == d])
                      for d in (2, 1)])
    shards = [torch.cat([g[:24] for g in gathered]), torch.cat([g[24:] for g in gathered])[:9]]
    out["zero1 bf16 fp32 master"] = ("close", torch.cat(shards), mine, 1e-6)


class _TiedLM(nn.Module):
    """An embedding and a head sharing one Parameter, a hidden layer and a frozen scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed, self.mid, self.head = nn.Embedding(11, 4), nn.Linear(4, 4), nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(ids))) * self.scale)


def _storage(t: torch.Tensor | None) -> int:
    return t.untyped_storage().data_ptr() if t is not None else 0


def _zero1_buffer_checks(state: ParallelState, out: dict) -> None:
    """fp32 parameters: ZeRO-1 holds the parameters (with the master shards as views) and the
    gradients in one flat buffer each per flat space, so trainable parameters + gradients + Adam
    states take 4N + 4N + 8N/dp bytes (no master copy), and it still equals AdamW on the whole
    batch, also when a step's ``.grad`` or a parameter's ``.data`` is put elsewhere from outside.
    The wrapped AdamW steps the shards in chunks of 8 elements here: bit for bit the same as in one
    piece, also through export_param_states / import_param_states."""
    g = torch.Generator().manual_seed(4)
    ids, targets = torch.randint(0, 11, (4, 8, 5), generator=g), torch.randint(0, 11, (4, 8, 5), generator=g)

    def loss(model: nn.Module, s: int, rows: slice) -> torch.Tensor:
        logits = model(ids[s][rows]).flatten(0, 1)
        return F.cross_entropy(logits, targets[s][rows].flatten(), reduction="sum") / targets[s].numel()

    ref = _TiedLM()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    for s in range(4):
        loss(ref, s, slice(None)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = _TiedLM()
    rows = slice(4 * state.coord("dp"), 4 * state.coord("dp") + 4)
    opt = Zero1Optimizer(_groups(model), torch.optim.AdamW, state.group("dp"), lr=1e-2, inner_chunk_numel=8)
    twin = _TiedLM()
    twin_opt = Zero1Optimizer(_groups(twin), torch.optim.AdamW, state.group("dp"), lr=1e-2)
    # flat spaces: embed/head 44 + mid.weight 16 = 60 (shards 30 = 8 + 8 + 8 + 6), mid.bias 4 (shards 2)
    out["buffer sizes"] = ("equal", [(f.numel, f.shard_size, len(f.chunks)) for f in opt.flats],
                           [(60, 30, 4), (4, 2, 1)], 0)
    out["params and master share a buffer"] = (
        "equal", [len({_storage(p) for p in f.params} | {_storage(f.master)}) for f in opt.flats], [1, 1], 0)
    out["tied head is the embedding"] = ("equal", _storage(model.head.weight), _storage(model.embed.weight), 0)
    for s in range(4):
        if s == 1:
            model.mid.weight.grad = None  # backward then makes a new tensor: copied into the buffer
        loss(model, s, rows).backward()
        if s == 0:
            out["grads share a buffer after backward"] = (
                "equal", [len({_storage(p.grad) for p in f.params}) for f in opt.flats], [1, 1], 0)
        if s == 2:
            model.mid.bias.data = model.mid.bias.data.clone()  # the step puts it back into the buffer
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss(twin, s, rows).backward()
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
    for name, p in model.named_parameters():
        out[f"buffers == AdamW {name}"] = ("close", p.detach().clone(), ref.get_parameter(name).detach(), 1e-6)
        out[f"chunked == one piece {name}"] = ("equal", p.detach().clone(), twin.get_parameter(name).detach(), 0)
    exported = opt.export_param_states()
    out["chunked export == one piece"] = ("equal", all(
        st.keys() == st2.keys() and all(torch.equal(st[k], st2[k]) for k in st)
        for (_, st), (_, st2) in zip(exported, twin_opt.export_param_states(), strict=True)), True, 0)
    again = _TiedLM()
    again.load_state_dict(model.state_dict())
    again_opt = Zero1Optimizer(_groups(again), torch.optim.AdamW, state.group("dp"), lr=1e-2, inner_chunk_numel=8)
    by_name = {n: st for p, st in exported for n, q in model.named_parameters() if q is p}
    names = {id(q): n for n, q in again.named_parameters()}
    again_opt.import_param_states(lambda p: by_name[names[id(p)]])
    for m, o in ((model, opt), (again, again_opt)):
        loss(m, 0, rows).backward()
        o.step()
        o.zero_grad()
    for name, p in model.named_parameters():
        out[f"imported chunks step on {name}"] = ("equal", again.get_parameter(name).detach(), p.detach(), 0)
    with pytest.raises(NxdError, match=r"shards in \[1, 1\] optimizer chunks, this optimizer in \[4, 1\]"):
        again_opt.load_state_dict(twin_opt.state_dict())
    out["frozen grad stays None"] = ("equal", model.scale.grad is None, True, 0)
    out["params back in the buffers"] = (
        "equal", [len({_storage(p) for p in f.params} | {_storage(f.master)}) for f in opt.flats], [1, 1], 0)
    out["zeroed grads are views"] = (
        "equal", [({_storage(p.grad) for p in f.params}, f.grad_buffer is not None and not f.grad_buffer.any())
                  for f in opt.flats],
        [({_storage(f.grad_buffer)}, True) for f in opt.flats], 0)
    # bytes of the distinct storages behind the trainable parameters, their gradients, the masters
    # and the Adam moments: buffers (60 + 4) * 4 B each, moments 2 * (30 + 2) * 4 B
    trainable = [p for p in model.parameters() if p.requires_grad]
    tensors = [*trainable, *(p.grad for p in trainable), *(f.master for f in opt.flats),
               *(t for st in opt.inner.state.values() for t in st.values() if t.dim() > 0)]
    held = {_storage(t): t.untyped_storage().nbytes() for t in tensors if t is not None}
    out["bytes held"] = ("equal", sum(held.values()), 256 + 256 + 256, 0)
    out["saved master is a copy"] = ("equal", [m.untyped_storage().nbytes() for m in opt.state_dict()["master"]],
                                     [30 * 4, 2 * 4], 0)


def _tiny_llama() -> nn.Module:
    torch.manual_seed(3)
    return build_model(TINY, device="cpu")


def _llama_batches(steps: int):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, TINY.vocab_size, (steps, 4, 8), generator=g)
    labels = ids.clone()
    labels[:, :, :3] = -100
    labels[:, 1, 3:5] = -100  # uneven target counts between the dp ranks
    return ids, labels


def _lora_api_checks(state: ParallelState, out: dict) -> None:
    """LoRA on a tiny Llama through the NxD-style API (dp=2, with and without ZeRO-1, clipping
    active) against one process on the whole batch with AdamW and clip_grad_norm_."""
    from nxd_finetune.lora import LoraConfig, inject_lora

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    ids, labels = _llama_batches(4)
    ref = _tiny_llama()
    inject_lora(ref, lora)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, lr=2e-2)
    ref_norms = []
    for s in range(4):
        n = (labels[s][:, 1:] != -100).sum()
        (causal_lm_loss(ref(ids[s]), labels[s], reduction="sum") / n).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(trainable, 0.05))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    rows = slice(2 * state.coord("dp"), 2 * state.coord("dp") + 2)
    for zero1 in (True, False):
        config = neuronx_distributed_config(
            optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": 0.05, "grad_reduction": "sum"},
            lora_config=lora)
        model = initialize_parallel_model(config, _tiny_llama)
        opt = initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=2e-2)
        for s in range(4):
            local = (labels[s][rows, 1:] != -100).sum()
            n = allreduce_scalar_sum(local, state.group("dp"))
            (causal_lm_loss(model(ids[s][rows]), labels[s][rows], reduction="sum") / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out[f"api zero1={zero1} grad norm step {s}"] = ("close", opt.grad_norm, ref_norms[s], 1e-6)
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            if p.requires_grad:
                out[f"api zero1={zero1} {name}"] = ("close", p.detach(), r.detach(), 1e-6)
    out["clipping was active"] = ("equal", bool(min(ref_norms) > 0.05), True, 0)


def _dp_worker() -> dict:
    init_distributed()
    torch.set_num_threads(1)
    state = ParallelState(Layout.of(dp=dist.get_world_size()))
    out: dict = {}
    _bucket_checks(state, out)
    _zero1_mlp_checks(state, out)
    _zero1_buffer_checks(state, out)
    _lora_api_checks(state, out)
    dist.destroy_process_group()
    return out


def test_data_parallel_zero1_and_api_match_single_process_dp2():
    results = launch(_dp_worker, 2, start_method="fork")
    assert assert_checks(results) == 2 * 99
    assert results[0]["zero1 fp32 0.weight"][1].shape == (6, 5)


# ----------------------------------------------------------------------------- world 4: tp=2 x dp=2, pp


class _Norm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))  # no placements: replicated on every TP rank


def _clip_models(state: ParallelState):
    """A reference model and its TP-sharded twin (column, row with replicated bias, a KV-style
    column replicated on both TP ranks, a replicated norm); gradients set from the reference."""
    torch.manual_seed(5)
    ref = nn.ModuleDict({"col": nn.Linear(8, 12), "row": nn.Linear(12, 6), "kv": nn.Linear(8, 4), "norm": _Norm(6)})
    for p in ref.parameters():
        p.grad = torch.randn_like(p)
    g = state.group("tp")
    par = nn.ModuleDict({
        "col": ColumnParallelLinear.from_linear(ref["col"], g),
        "row": RowParallelLinear.from_linear(ref["row"], g, input_is_parallel=True),
        "kv": ColumnParallelLinear.from_linear(ref["kv"], g, replicas=state.size("tp")),
        "norm": copy.deepcopy(ref["norm"]),
    })
    par["norm"].weight.grad = ref["norm"].weight.grad.clone()
    for _, module, attr, spec in iter_placements(par):
        full = ref.get_submodule(_name(par, module)).get_parameter(attr).grad
        module._parameters[attr].grad = spec.take(full).clone()
    return ref, par


def _name(root: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in root.named_modules() if m is module)


def _clip_checks(out: dict) -> None:
    state = ParallelState(Layout.of(tp=2, dp=2))
    ref, par = _clip_models(state)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    naive = torch.stack([p.grad.norm() for p in par.parameters()]).square().sum()
    dist.all_reduce(naive, group=state.group("tp"))
    out["naive tp norm counts replicas twice"] = ("differ", naive.sqrt(), ref_norm, 0)
    norm = clip_grad_norm(par, 1.0, state)
    out["tp2 norm"] = ("close", norm, ref_norm, 1e-5)
    specs = {n: s for n, _, _, s in iter_placements(par)}
    for name, p in par.named_parameters():
        spec = specs.get(name)
        full = gather_full(p.grad, spec, state) if spec else p.grad
        out[f"tp2 clipped grad {name}"] = ("close", full, ref.get_parameter(name).grad, 1e-6)
    with pytest.raises(ValueError, match="needs the sharding metadata"):
        clip_grad_norm(list(par.parameters()), 1.0, state)

    # ZeRO-1 variant: each dp rank holds part of the gradient; the shards' norm is summed over dp
    ref, par = _clip_models(state)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    share = 0.25 if state.coord("dp") == 0 else 0.75
    for p in par.parameters():
        p.grad = p.grad * share
    before = {n: p.detach().clone() for n, p in par.named_parameters()}
    opt = Zero1Optimizer(par.parameters(), torch.optim.SGD, state.group("dp"), lr=1.0)
    opt.reduce_gradients()
    norm = clip_grad_norm_zero1(opt, 1.0, state, specs=par)
    out["zero1 tp2 dp2 norm"] = ("close", norm, ref_norm, 1e-5)
    opt.step()
    specs = {n: s for n, _, _, s in iter_placements(par)}
    for name, p in par.named_parameters():
        spec = specs.get(name)
        delta = before[name] - p.detach()
        full = gather_full(delta, spec, state) if spec else delta
        out[f"zero1 clipped update {name}"] = ("close", full, ref.get_parameter(name).grad, 1e-6)
    out["zero1 unclipped grads differ"] = ("differ", ref_grads["col.weight"], ref.get_parameter("col.weight").grad, 0)

    # pipeline: stage 0 holds col + kv, stage 1 row + norm; the norm is summed over pp
    state = ParallelState(Layout.of(tp=2, pp=2))
    ref, par = _clip_models(state)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    mine = ("col", "kv") if state.coord("pp") == 0 else ("row", "norm")
    params = [p for k in mine for p in par[k].parameters()]
    out["tp2 pp2 norm"] = ("close", clip_grad_norm(params, None, state, specs=par), ref_norm, 1e-5)
    # a tied copy on another stage is clipped but not counted
    extra = nn.Parameter(torch.zeros(3))
    extra.grad = torch.full((3,), 100.0)
    norm = clip_grad_norm([*params, extra], 1.0, state, specs=par, not_counted=[extra])
    out["not_counted tied copy"] = ("close", norm, ref_norm, 1e-5)
    out["not_counted copy clipped"] = ("close", extra.grad, torch.full((3,), 100.0) / (ref_norm + 1e-6), 1e-4)


def _tp_dp_api_checks(model_dir: str, out: dict) -> None:
    """Full SFT of a tiny Llama with tp=2 x dp=2 through the API (meta init from per-rank slices
    of a checkpoint; ZeRO-1 on and off; clipping active) against one process on the whole batch."""
    # eps=1e-4: with Adam's default 1e-8 an element whose gradient is ~0 turns a 1e-7 difference in
    # TP summation order into an O(lr) difference in its update (seen: 3e-5 on one of 20k elements)
    ids, labels = _llama_batches(3)
    ref = load_pretrained(model_dir)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    ref_norms = []
    for s in range(3):
        n = (labels[s][:, 1:] != -100).sum()
        (causal_lm_loss(ref(ids[s]), labels[s], reduction="sum") / n).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    for zero1 in (True, False):
        config = neuronx_distributed_config(
            tensor_parallel_size=2,
            optimizer_config={"zero_one_enabled": zero1, "max_grad_norm": 0.5, "grad_reduction": "sum"},
            model_init_config={"meta_device_init": True, "checkpoint": model_dir})
        state = config.state
        model = initialize_parallel_model(config, build_model, DecoderConfig.from_hf(model_dir))
        opt = initialize_parallel_optimizer(config, torch.optim.AdamW, model.parameters(), lr=1e-2, eps=1e-4)
        rows = slice(2 * state.coord("dp"), 2 * state.coord("dp") + 2)
        for s in range(3):
            n = allreduce_scalar_sum((labels[s][rows, 1:] != -100).sum(), state.group("dp"))
            logits = model(ids[s][rows])
            loss = vocab_parallel_cross_entropy(logits[:, :-1], labels[s][rows, 1:], state.group("tp")).sum() / n
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out[f"tp2 dp2 zero1={zero1} grad norm step {s}"] = ("close", opt.grad_norm, ref_norms[s], 1e-5)
        specs = {n: s for n, _, _, s in iter_placements(model)}
        for name, p in model.named_parameters():
            full = gather_full(p, specs[name], state) if name in specs else p.detach()
            out[f"tp2 dp2 zero1={zero1} {name}"] = ("close", full, ref.get_parameter(name).detach(), 2e-6)
    out["tp2 clipping was active"] = ("equal", bool(min(ref_norms) > 0.5), True, 0)


def _world4_worker(model_dir: str) -> dict:
    init_distributed()
    torch.set_num_threads(1)
    out: dict = {}
    _clip_checks(out)
    _tp_dp_api_checks(model_dir, out)
    dist.destroy_process_group()
    return out


def test_clipping_and_tp_dp_zero1_match_unsharded_world4(tmp_path):
    torch.manual_seed(1)
    model = build_model(TINY, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    save_pretrained(TINY, model.state_dict().items(), tmp_path / "tiny")
    results = launch(_world4_worker, 4, str(tmp_path / "tiny"), start_method="fork")
    assert assert_checks(results) == 4 * 70


# ----------------------------------------------------------------------------- single process


def test_single_process_paths_need_no_process_group():
    assert not dist.is_initialized()
    assert init_distributed().world_size == 1
    state = ParallelState(Layout.of())
    ref, model = _mlp(), _mlp()
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    torch_clip = lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
    _train(ref, ref_opt, 3, slice(None), clip=torch_clip)
    opt = Zero1Optimizer(_groups(model), torch.optim.AdamW, None, lr=1e-2)
    _train(model, opt, 3, slice(None), clip=lambda m: opt.clip_grad_norm(0.1, state))
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=0)
    model = _mlp()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    _train(model, opt, 3, slice(None), clip=lambda m: clip_grad_norm(m, 0.1, state))
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=0)
    with pytest.raises(NxdError, match="no trainable parameters"):
        Zero1Optimizer(_mlp()[3].parameters(), torch.optim.AdamW, None)

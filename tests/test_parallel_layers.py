"""Tensor/sequence-parallel layers against unsharded references, on real gloo groups (CPU).

Workers are forked (``torch.multiprocessing`` "fork": ~0.1 s per process) and run many checks
each; a worker returns ``{check: (kind, got, expected)}`` through a file and the parent asserts,
so a failure names the rank and the check. ``kind`` is "close" (must match to 1e-5) or "differ"
(must differ by 5% of the expected magnitude: proves a check has teeth, e.g. gradients before
the replicated-gradient sync).
Sharded tensors are gathered with ``gather_full`` before comparing, so every rank's shard is
checked. The whole-model checks load per-rank slices from a ``transformers`` checkpoint and
compare with our unsharded model and with the ``transformers`` logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gloo_world import assert_checks, run_world
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from nxd_finetune.errors import ModelLoadError, NxdError
from nxd_finetune.loss import vocab_parallel_cross_entropy
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained, materialize
from nxd_finetune.parallel import (
    ColumnParallelLinear,
    Layout,
    ParallelState,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_replicated_grads,
    apply_tp_plan,
    check_tp_config,
    gather_full,
    iter_placements,
    make_slice_reader,
    shard_slice,
    tp_plan_for,
)
from nxd_finetune.parallel.mappings import (
    SEQ_DIM,
    all_gather,
    all_reduce_sum,
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_from_tp_,
    reduce_scatter_to_sequence,
    scatter_to_tp,
)

# ----------------------------------------------------------------------------- harness


pytestmark = pytest.mark.usefixtures("workers_tmpdir")  # spawned workers write under tmp_path


class ScatterToSequence(torch.autograd.Function):
    """Forward keep this rank's chunk of the sequence dim; backward all-gather on it (the package's
    ``all_gather``). No layer scatters onto the sequence dim; the checks use it as the pair of
    ``gather_from_sequence``."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.chunk(group_size(group), dim=SEQ_DIM)[group_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, SEQ_DIM, ctx.group), None


def scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group_size(group) == 1 else ScatterToSequence.apply(x, group)


# ----------------------------------------------------------------------------- workers


def _mapping_checks(state: ParallelState, out: dict) -> None:
    """Each collective's forward and backward on rank-dependent values."""
    g, r, tp = state.group("tp"), state.coord("tp"), state.size("tp")
    tot = sum(range(1, tp + 1))
    x = torch.ones(2, 3, requires_grad=True)
    (copy_to_tp(x, g) * (r + 1)).sum().backward()
    out["copy_to_tp bwd all-reduce"] = ("close", x.grad, torch.full((2, 3), float(tot)))
    x = torch.full((2, 3), float(r + 1), requires_grad=True)
    y = reduce_from_tp(x, g)
    (y * (r + 1)).sum().backward()
    out["reduce_from_tp fwd"] = ("close", y.detach(), torch.full((2, 3), float(tot)))
    out["reduce_from_tp bwd identity"] = ("close", x.grad, torch.full((2, 3), float(r + 1)))
    leaf = torch.full((2, 3), float(r + 1), requires_grad=True)
    fresh = leaf * 1.0  # a new non-leaf tensor nothing saved: reduce_from_tp_ sums into it
    y = reduce_from_tp_(fresh, g)
    (y * (r + 1)).sum().backward()
    out["reduce_from_tp_ fwd"] = ("close", y.detach(), torch.full((2, 3), float(tot)))
    same = float(y.data_ptr() == fresh.data_ptr())
    out["reduce_from_tp_ in place"] = ("close", torch.tensor(same), torch.tensor(1.0))
    out["reduce_from_tp_ bwd identity"] = ("close", leaf.grad, torch.full((2, 3), float(r + 1)))
    view = leaf.detach().clone()[:, :2]  # a view: summed into a copy, the viewed tensor untouched
    y = reduce_from_tp_(view, g)
    out["reduce_from_tp_ view copied"] = ("close", view, torch.full((2, 2), float(r + 1)))
    out["reduce_from_tp_ view fwd"] = ("close", y, torch.full((2, 2), float(tot)))
    saved = leaf.exp()  # exp keeps its output for backward: summing into it must not pass silently
    try:
        reduce_from_tp_(saved, g).sum().backward()
        raised = 0.0
    except RuntimeError:
        raised = 1.0
    out["reduce_from_tp_ saved input raises"] = ("close", torch.tensor(raised), torch.tensor(1.0))
    full = torch.arange(2 * 3 * 4 * tp, dtype=torch.float32).view(2, 3, 4 * tp)
    x = full.clone().requires_grad_()
    y = scatter_to_tp(x, g)
    (y * (r + 1)).sum().backward()
    grad_tp = torch.cat([torch.full((2, 3, 4), float(k + 1)) for k in range(tp)], dim=-1)
    out["scatter_to_tp fwd"] = ("close", y.detach(), full[..., 4 * r : 4 * (r + 1)])
    out["scatter_to_tp bwd all-gather"] = ("close", x.grad, grad_tp)
    x = full[..., 4 * r : 4 * (r + 1)].clone().requires_grad_()
    y = gather_from_tp(x, g)
    (y * grad_tp).sum().backward()
    out["gather_from_tp fwd"] = ("close", y.detach(), full)
    out["gather_from_tp bwd split"] = ("close", x.grad, torch.full_like(x, float(r + 1)))
    seq = torch.arange(2 * 2 * tp * 3, dtype=torch.float32).view(2, 2 * tp, 3)
    x = seq[:, 2 * r : 2 * (r + 1)].clone().requires_grad_()
    y = gather_from_sequence(x, g)
    (y * (r + 1)).sum().backward()
    out["gather_from_sequence fwd"] = ("close", y.detach(), seq)
    out["gather_from_sequence bwd reduce-scatter"] = ("close", x.grad, torch.full_like(x, float(tot)))
    x = (seq * (r + 1)).requires_grad_()
    y = reduce_scatter_to_sequence(x, g)
    (y * (r + 1)).sum().backward()
    out["reduce_scatter_to_sequence fwd"] = ("close", y.detach(), tot * seq[:, 2 * r : 2 * (r + 1)])
    grad = torch.cat([torch.full((2, 2, 3), float(k + 1)) for k in range(tp)], dim=1)
    out["reduce_scatter_to_sequence bwd all-gather"] = ("close", x.grad, grad)
    x = seq.clone().requires_grad_()
    y = scatter_to_sequence(x, g)
    (y * (r + 1)).sum().backward()
    out["scatter_to_sequence fwd"] = ("close", y.detach(), seq[:, 2 * r : 2 * (r + 1)])
    out["scatter_to_sequence bwd all-gather"] = ("close", x.grad, grad)


def _grads_vs(ref: nn.Module, par: nn.Module, state: ParallelState, tag: str, out: dict) -> None:
    specs = {name: spec for name, _, _, spec in iter_placements(par)}
    for name, p in par.named_parameters():
        spec = specs.get(name)
        got = gather_full(p.grad, spec, state) if spec else p.grad
        out[f"{tag} grad {name}"] = ("close", got, ref.get_parameter(name).grad)


def _linear_checks(state: ParallelState, out: dict) -> None:
    g, r, tp = state.group("tp"), state.coord("tp"), state.size("tp")
    B, T, H, Dout = 2, 2 * tp, 8, 4 * tp
    for kind, sp, bias, opt in [
        ("column", False, True, False),
        ("column", False, False, True),
        ("column", True, True, False),
        ("column", True, True, True),
        ("row", False, True, True),
        ("row", False, True, False),
        ("row", True, True, True),
    ]:
        tag = f"{kind} sp={sp} bias={bias} {'gather_output' if kind == 'column' else 'input_is_parallel'}={opt}"
        torch.manual_seed(1)
        ref = nn.Linear(H, Dout, bias=bias)
        x, dy = torch.randn(B, T, H), torch.randn(B, T, Dout)
        xr = x.clone().requires_grad_()
        (ref(xr) * dy).sum().backward()
        seq = slice(T // tp * r, T // tp * (r + 1)) if sp else slice(None)
        if kind == "column":
            par = ColumnParallelLinear.from_linear(ref, g, gather_output=opt, sequence_parallel=sp)
            xin = x[:, seq].clone().requires_grad_()
            y = par(xin)
            dy_local = dy if opt else dy[..., Dout // tp * r : Dout // tp * (r + 1)]
            full_y = y if opt else all_gather(y, -1, g)
        else:
            par = RowParallelLinear.from_linear(ref, g, input_is_parallel=opt, sequence_parallel=sp)
            xin = (x[..., H // tp * r : H // tp * (r + 1)] if opt else x).clone().requires_grad_()
            y = par(xin)
            dy_local = dy[:, seq]
            full_y = all_gather(y, 1, g) if sp else y
        (y * dy_local).sum().backward()
        allreduce_replicated_grads(par, state)
        out[f"{tag} output"] = ("close", full_y.detach(), ref(x).detach())
        if kind == "column":
            grad_in = all_gather(xin.grad, 1, g) if sp else xin.grad
        else:
            grad_in = all_gather(xin.grad, -1, g) if opt else xin.grad
        out[f"{tag} input grad"] = ("close", grad_in, xr.grad)
        _grads_vs(ref, par, state, tag, out)

    # KV-style replication: every rank holds the same chunk and back-propagates its own dy
    torch.manual_seed(2)
    ref = nn.Linear(H, 4, bias=True)
    x, dys = torch.randn(B, T, H), torch.randn(tp, B, T, 4)
    xr = x.clone().requires_grad_()
    (ref(xr) * dys.sum(0)).sum().backward()
    par = ColumnParallelLinear.from_linear(ref, g, replicas=tp)
    xin = x.clone().requires_grad_()
    y = par(xin)
    (y * dys[r]).sum().backward()
    out["kv-replicated weight grad before sync"] = ("differ", par.weight.grad.clone(), ref.weight.grad)
    allreduce_replicated_grads(par, state)
    out["kv-replicated output"] = ("close", y.detach(), ref(x).detach())
    out["kv-replicated input grad"] = ("close", xin.grad, xr.grad)
    _grads_vs(ref, par, state, "kv-replicated", out)


def _embedding_and_ce_checks(state: ParallelState, out: dict) -> None:
    g, r, tp = state.group("tp"), state.coord("tp"), state.size("tp")
    B, T, V, H = 2, 2 * tp, 8 * tp, 6
    torch.manual_seed(3)
    ids = torch.randint(0, V, (B, T))
    for sp in (False, True):
        ref = nn.Embedding(V, H)
        dy = torch.randn(B, T, H)
        (ref(ids) * dy).sum().backward()
        par = VocabParallelEmbedding.from_embedding(ref, g, sequence_parallel=sp)
        y = par(ids)
        seq = slice(T // tp * r, T // tp * (r + 1)) if sp else slice(None)
        (y * dy[:, seq]).sum().backward()
        out[f"embedding sp={sp} output"] = ("close", y.detach(), ref(ids)[:, seq].detach())
        _grads_vs(ref, par, state, f"embedding sp={sp}", out)

    for scale, shift in ((1.0, 0.0), (30.0, 1000.0)):  # the second needs the max shift
        logits = torch.randn(B, T, V) * scale + shift
        targets = torch.randint(0, V, (B, T))
        targets[0, :2] = -100
        weights = torch.randn(B, T)
        lr = logits.clone().requires_grad_()
        ref_loss = F.cross_entropy(lr.view(-1, V), targets.view(-1), reduction="none").view(B, T)
        (ref_loss * weights).sum().backward()
        shard = logits[..., V // tp * r : V // tp * (r + 1)].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, targets, g)
        (loss * weights).sum().backward()
        out[f"vocab CE x{scale}+{shift} loss"] = ("close", loss.detach(), ref_loss.detach())
        out[f"vocab CE x{scale}+{shift} grad"] = ("close", all_gather(shard.grad, -1, g), lr.grad)


def _plan_error_checks(state: ParallelState) -> None:
    """apply_tp_plan refuses what it cannot shard, with one-line messages (raised before any collective)."""
    cfg = DecoderConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
    )
    model = build_model(cfg)
    model.model.extra = nn.Linear(2, 2, device="meta")
    with pytest.raises(NxdError, match="no entry covers module 'model.extra'"):
        apply_tp_plan(model, tp_plan_for(cfg), state)
    model = build_model(cfg)
    attn = model.model.layers["0"].self_attn
    attn.q_proj = nn.Sequential(attn.q_proj)
    with pytest.raises(NxdError, match=r"q_proj is Sequential, expected Linear \(apply the TP plan before LoRA"):
        apply_tp_plan(model, tp_plan_for(cfg), state)
    odd = DecoderConfig(hidden_size=24, intermediate_size=32, num_attention_heads=3, vocab_size=32)
    with pytest.raises(NxdError, match=f"num_attention_heads=3 is not divisible by tp={state.size('tp')}"):
        apply_tp_plan(build_model(odd), tp_plan_for(odd), state)


def _layers_worker(rank: int, world: int) -> dict:
    state = ParallelState(Layout.of(tp=world))
    out: dict = {}
    _plan_error_checks(state)
    _mapping_checks(state, out)
    _linear_checks(state, out)
    _embedding_and_ce_checks(state, out)
    return out


def _state_worker(rank: int, world: int) -> dict:
    """Rank layout and group membership: all-reduce the global rank over each group."""
    out: dict = {}

    def members_sum(group) -> torch.Tensor:
        return all_reduce_sum(torch.tensor([float(rank)]), group)

    for dims in (Layout.of(tp=2, dp=2), Layout.of(tp=2, pp=2), Layout.of(tp=4), Layout.of(dp=4)):
        s = ParallelState(dims)
        tag = f"tp={dims.degree('tp')} pp={dims.degree('pp')} dp={dims.degree('dp')}"
        assert dims.rank_of({axis: s.coord(axis) for axis in ("pp", "dp", "tp")}) == rank
        for axis in ("tp", "dp", "pp"):
            ranks = s.ranks(axis)
            assert rank in ranks and len(ranks) == dims.degree(axis) == s.size(axis)
            assert ranks.index(rank) == s.coord(axis)
            expect = torch.tensor([float(sum(ranks))])
            out[f"{tag} {axis} group"] = ("close", members_sum(s.group(axis)), expect)
        if dims.degree("tp") == 4:
            expect = torch.tensor([float(sum(range(rank // 2 * 2, rank // 2 * 2 + 2)))])
            out["tp=4 subgroup of 2"] = ("close", members_sum(s.subgroup("tp", 2)), expect)
    s = ParallelState(Layout.of(tp=2, dp=2))
    expected_layout = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1)}[rank]
    got = torch.tensor([s.coord(axis) for axis in ("pp", "dp", "tp")])
    out["layout tp fastest"] = ("close", got, torch.tensor(expected_layout))
    return out


def _llama_worker(rank: int, world: int, tp: int, variants: list[tuple[str, str, tuple[bool, ...]]]) -> dict:
    """Tiny decoders with the TP plan (``variants``: label, HF dir, sequence-parallel settings),
    slices loaded from the HF checkpoint, against the unsharded model loaded whole: logits,
    loss, every weight and every gradient (gathered from the shards)."""
    state = ParallelState(Layout.for_world(world, tp=tp))
    g = state.group("tp")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[:, :3] = -100
    pos = torch.arange(8).expand(2, 8)
    n_valid = (labels[:, 1:] != -100).sum()
    out: dict = {"ids": ("close", ids, ids)}
    for label, model_dir, sp_settings in variants:
        config = DecoderConfig.from_hf(model_dir)
        ref = load_pretrained(model_dir)
        logits_ref = ref(ids, position_ids=pos)
        loss_ref = F.cross_entropy(logits_ref[:, :-1].reshape(-1, config.vocab_size), labels[:, 1:].reshape(-1))
        loss_ref.backward()
        for sp in sp_settings:
            model = apply_tp_plan(build_model(config), tp_plan_for(config), state, sequence_parallel=sp)
            materialize(model, model_dir, reader=make_slice_reader(model))
            k_rows = config.head_dim * max(1, config.num_key_value_heads // tp)
            assert model.model.layers["0"].self_attn.k_proj.weight.shape[0] == k_rows
            logits = model(ids, position_ids=pos)
            loss = vocab_parallel_cross_entropy(logits[:, :-1], labels[:, 1:], g).sum() / n_valid
            loss.backward()
            tag = f"{label} tp={tp} sp={sp}"
            out[f"{tag} logits"] = ("close", all_gather(logits.detach(), -1, g), logits_ref.detach())
            out[f"{tag} loss"] = ("close", loss.detach(), loss_ref.detach())
            if sp:
                norm_grad = model.model.norm.weight.grad.clone()
                out[f"{tag} norm grad before sync"] = ("differ", norm_grad, ref.model.norm.weight.grad)
            if tp > config.num_key_value_heads:
                k_proj = model.model.layers["1"].self_attn.k_proj
                ref_chunk = k_proj.placements["weight"].take(ref.model.layers["1"].self_attn.k_proj.weight.grad)
                out[f"{tag} replicated k_proj grad before sync"] = ("differ", k_proj.weight.grad.clone(), ref_chunk)
            allreduce_replicated_grads(model, state)
            specs = {name: spec for name, _, _, spec in iter_placements(model)}
            for name, p in model.named_parameters():
                spec = specs.get(name)
                for what, t in (("weight", p), ("grad", p.grad)):
                    full = gather_full(t, spec, state) if spec else t.detach()
                    ref_t = ref.get_parameter(name) if what == "weight" else ref.get_parameter(name).grad
                    out[f"{tag} {what} {name}"] = ("close", full, ref_t.detach())
    return out


# ----------------------------------------------------------------------------- tests


def test_layers_match_unsharded_reference_tp2(tmp_path):
    results = run_world(_layers_worker, 2, tmp_path)
    assert assert_checks(results) == 2 * 59


def test_rank_layout_and_groups_world4(tmp_path):
    results = run_world(_state_worker, 4, tmp_path)
    assert assert_checks(results) == 4 * 14


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4-kv-replicated"])
def test_decoder_tp_plan_matches_unsharded_and_hf(tp, tmp_path, make_tiny_hf):
    # 4 heads, 2 KV heads: tp=2 splits the KV heads, tp=4 replicates each over 2 ranks
    if tp == 2:
        models = {"llama": make_tiny_hf("llama"), "llama-tied": make_tiny_hf("llama", tie_word_embeddings=True)}
        variants = [
            ("llama", str(models["llama"][1]), (False, True)),
            ("llama-tied", str(models["llama-tied"][1]), (True,)),
        ]
    else:  # qwen2: q/k/v biases, so the replicated KV biases are checked too
        models = {"qwen2": make_tiny_hf("qwen2")}
        variants = [("qwen2", str(models["qwen2"][1]), (False, True))]
    results = run_world(_llama_worker, tp, tmp_path, tp, variants)
    n_checks = sum(len(sps) * (2 * len(list(models[label][0].parameters())) + 2) for label, _, sps in variants)
    n_differ = sum(sp for _, _, sps in variants for sp in sps) + (2 if tp == 4 else 0)
    assert assert_checks(results) == tp * (1 + n_checks + n_differ)
    ids = results[0]["ids"][1]
    for label, _, sps in variants:
        with torch.no_grad():
            hf_logits = models[label][0](ids).logits
        for sp in sps:
            got = results[0][f"{label} tp={tp} sp={sp} logits"][1]
            torch.testing.assert_close(got, hf_logits, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- single process


def test_single_process_state_and_layers_need_no_process_group():
    assert not dist.is_initialized()
    s = ParallelState(Layout.of())
    assert (s.size("tp"), s.size("dp"), s.size("pp"), s.group("tp"), s.rank) == (1, 1, 1, None, 0)
    torch.manual_seed(0)
    ref = nn.Linear(8, 6)
    x = torch.randn(3, 8)
    for par in (
        ColumnParallelLinear.from_linear(ref, None, gather_output=True),
        RowParallelLinear.from_linear(ref, None),
    ):
        torch.testing.assert_close(par(x), ref(x))
    logits, targets = torch.randn(5, 7), torch.tensor([1, -100, 3, 0, 6])
    torch.testing.assert_close(
        vocab_parallel_cross_entropy(logits, targets, None), F.cross_entropy(logits, targets, reduction="none")
    )


def test_apply_tp_plan_is_a_noop_at_tp1(make_tiny_hf):
    _, model_dir = make_tiny_hf("llama")
    model = build_model(DecoderConfig.from_hf(model_dir))
    assert apply_tp_plan(model, tp_plan_for(model.config), ParallelState(Layout.of())) is model
    assert type(model.lm_head) is nn.Linear


@pytest.mark.parametrize(
    "tp, overrides, message",
    [
        (3, {}, "num_attention_heads=4 is not divisible by tp=3"),
        (2, dict(num_attention_heads=6, num_key_value_heads=3), "num_key_value_heads=3 and tp=2: one must divide"),
        (2, dict(intermediate_size=97), "intermediate_size=97 is not divisible by tp=2"),
        (2, dict(vocab_size=129), "vocab_size=129 is not divisible by tp=2"),
        (2, dict(seq_len=7), "sequence length 7 is not divisible by tp=2"),
    ],
)
def test_check_tp_config_errors_name_the_numbers(tp, overrides, message):
    overrides = dict(overrides)
    seq_len = overrides.pop("seq_len", None)
    cfg = DecoderConfig(
        **{
            "hidden_size": 96,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "vocab_size": 128,
            **overrides,
        }
    )
    with pytest.raises(NxdError, match=message):
        check_tp_config(cfg, tp, sequence_parallel=True, seq_len=seq_len)
    check_tp_config(cfg, 1, sequence_parallel=True, seq_len=seq_len)


def test_dims_validation_and_layout():
    with pytest.raises(NxdError, match="world size 6 is not divisible by tp\\*pp = 4\\*1 = 4"):
        Layout.for_world(6, tp=4)
    with pytest.raises(NxdError, match="parallel.tp must be a positive integer, got 0"):
        Layout.of(tp=0)
    with pytest.raises(NxdError, match="tp\\*pp\\*dp = 2\\*1\\*1 = 2 ranks, but the world has 1"):
        ParallelState(Layout.of(tp=2))
    d = Layout.of(tp=2, pp=2, dp=2)
    coords = [tuple(d.coords(r)[a] for a in ("pp", "dp", "tp")) for r in (0, 1, 2, 5, 7)]
    assert coords == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert (d.group_ranks("tp", 4), d.group_ranks("dp", 1), d.group_ranks("pp", 3)) == ([4, 5], [1, 3], [3, 7])
    assert d.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]] and d.blocks("tp", 1) == [[r] for r in range(8)]


def test_slice_reader_checks_the_full_shape(tmp_path):
    model = nn.Module()
    model.proj = ColumnParallelLinear(8, 6, group=None, device="meta")
    reader = make_slice_reader(model)
    save_file({"good": torch.arange(48.0).view(6, 8), "bad": torch.zeros(5, 8)}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        torch.testing.assert_close(
            reader("good", f.get_slice("good"), model.proj.weight), torch.arange(48.0).view(6, 8)
        )
        with pytest.raises(
            ModelLoadError, match=r"tensor 'bad' has shape \(5, 8\) in the checkpoint, the model expects \(6, 8\)"
        ):
            reader("bad", f.get_slice("bad"), model.proj.weight)


def test_shard_slice():
    assert shard_slice((8, 6), 0, 1, 2) == (slice(4, 8), slice(None))
    assert shard_slice((8, 6), 1, 2, 3) == (slice(None), slice(4, 6))
    with pytest.raises(NxdError, match="dim 1 of a \\(8, 6\\) tensor \\(6\\) is not divisible by 4"):
        shard_slice((8, 6), 1, 0, 4)

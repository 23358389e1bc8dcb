"""Placements: a parameter sharded over an axis no reader names is reduced, partitioned, clipped,
checkpointed, resharded and exported right (real gloo, 4 processes).

The layout has a test-only data axis ``xp`` beside ``dp`` (as an expert axis will be): a toy
module holds a dense linear (replicated: its gradient is summed over dp and xp) and an "experts"
tensor sharded on dim 0 over xp (its gradient summed over dp only). Each rank's gradients are its
share of the single-process gradients as data parallel would leave them, so the reduced, clipped
update, the ZeRO-1 update, the norm, the checkpoint loaded at another layout (xp=4) and the export
must equal the single-process numbers. ``optimizer.py``, ``data_parallel.py``, ``zero1.py``,
``clip.py``, ``checkpoint/`` and ``export.py`` name no such axis.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gloo_world import assert_checks, run_world
from torch import nn

from nxd_finetune.checkpoint import CheckpointManager
from nxd_finetune.errors import NxdError
from nxd_finetune.export import gather_to_writer
from nxd_finetune.parallel import Layout, ParallelState, Partial, Placement, Replicate, Shard, gather_full
from nxd_finetune.parallel.optimizer import ParallelOptimizer
from nxd_finetune.parallel.parallelize import RankModel

EXPERTS = 4
MAX_NORM = 0.5
DENSE_SHARE = (0.1, 0.2, 0.3, 0.4)  # of the dense gradient, by global rank (sums to 1 over dp x xp)
EXPERT_SHARE = (0.25, 0.75)  # of an expert's gradient, by dp coordinate (sums to 1 over dp)


def layout(dp: int, xp: int) -> Layout:
    return Layout((("pp", 1), ("dp", dp), ("xp", xp), ("tp", 1)), extra=(("xp", "data"),))


class Toy(nn.Module):
    """A dense linear and ``experts [E, 3, 2]``; with ``state`` this rank's experts only."""

    def __init__(self, state: ParallelState | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 3)
        full = torch.randn(EXPERTS, 3, 2)
        if state is None:
            self.experts = nn.Parameter(full)
            return
        placement = Placement(tuple(full.shape), (("xp", Shard(0, state.size("xp"), state.coord("xp"))),))
        self.placements = {"experts": placement}
        self.experts = nn.Parameter(placement.take(full).clone())


def full_grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    ref = Toy()
    return {n: torch.randn(p.shape, generator=g) for n, p in ref.named_parameters()}


def set_grads(model: Toy, state: ParallelState, step: int) -> None:
    """This rank's gradients: its share of the dense gradient, and of its experts' gradient."""
    grads = full_grads(step)
    model.dense.weight.grad = grads["dense.weight"] * DENSE_SHARE[state.rank]
    model.dense.bias.grad = grads["dense.bias"] * DENSE_SHARE[state.rank]
    model.experts.grad = model.placements["experts"].take(grads["experts"]) * EXPERT_SHARE[state.coord("dp")]


def reference(steps: int) -> tuple[Toy, list[torch.Tensor]]:
    """The single process: ``steps`` clipped SGD-with-momentum steps; the norms before clipping."""
    ref = Toy()
    opt = torch.optim.SGD(ref.parameters(), lr=1.0, momentum=0.9)
    norms = []
    for step in range(steps):
        for n, g in full_grads(step).items():
            ref.get_parameter(n).grad = g
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        opt.step()
    return ref, norms


def full_params(model: Toy, state: ParallelState) -> dict[str, torch.Tensor]:
    placements = model.placements
    return {n: gather_full(p, placements.get(n), state).clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, root: str) -> dict:
    out: dict = {}
    state = ParallelState(layout(2, 2))
    ref1, norms = reference(1)
    ref2, norms2 = reference(2)
    for zero1 in (False, True):
        model = Toy(state)
        opt = ParallelOptimizer(torch.optim.SGD, model.parameters(), state=state, model=model, zero1=zero1,
                                grad_reduction="sum", max_grad_norm=MAX_NORM, lr=1.0, momentum=0.9)
        set_grads(model, state, 0)
        opt.step()
        assert opt.grad_norm is not None
        out[f"zero1={zero1} norm"] = ("close", opt.grad_norm, norms[0])
        for n, t in full_params(model, state).items():
            out[f"zero1={zero1} step {n}"] = ("close", t, ref1.get_parameter(n).detach())
        out[f"zero1={zero1} step moved"] = ("differ", full_params(model, state)["experts"], Toy().experts.detach())
    # the ZeRO-1 run's step 1 saved at dp=2 x xp=2 ...
    manager = CheckpointManager(root, state=state)
    manager.save(1, model, opt)
    exported = gather_to_writer(RankModel([model], state), None)
    if rank == 0:
        assert exported is not None
        for n, t in exported.items():
            out[f"export {n}"] = ("close", t, ref1.get_parameter(n).detach())
    else:
        assert exported is None
    # ... loads at dp=1 x xp=4 (one expert per rank) and takes step 2 there
    other = ParallelState(layout(1, 4))
    model = Toy(other)
    opt = ParallelOptimizer(torch.optim.SGD, model.parameters(), state=other, model=model, zero1=False,
                            grad_reduction="sum", max_grad_norm=MAX_NORM, lr=1.0, momentum=0.9)
    ref = CheckpointManager(root, state=other).resolve("latest")
    assert ref is not None
    CheckpointManager(root, state=other).load(ref, model, opt)
    for n, t in full_params(model, other).items():
        out[f"resharded {n}"] = ("close", t, ref1.get_parameter(n).detach())
    model.dense.weight.grad = full_grads(1)["dense.weight"] / 4
    model.dense.bias.grad = full_grads(1)["dense.bias"] / 4
    model.experts.grad = model.placements["experts"].take(full_grads(1)["experts"])
    opt.step()
    assert opt.grad_norm is not None
    out["resharded step 2 norm"] = ("close", opt.grad_norm, norms2[1])
    for n, t in full_params(model, other).items():
        out[f"resharded step 2 {n}"] = ("close", t, ref2.get_parameter(n).detach())
    dist.barrier()
    return out


@pytest.mark.slow  # a 4-process gloo world
def test_a_parameter_sharded_over_an_extra_data_axis_matches_one_process(tmp_path):
    results = run_world(_worker, 4, tmp_path, str(tmp_path / "ckpt"))
    assert assert_checks(results) == 4 * (2 * 5 + 3 + 4) + 3


def test_layout_takes_extra_axes_with_their_kind_only():
    lay = layout(2, 2)
    assert lay.data_axes == ("dp", "xp")
    assert lay.of_kind("data") == ("xp", "dp")
    assert lay.groups_over(("dp", "xp")) == [[0, 1, 2, 3]]
    assert lay.groups_over(("dp",)) == [[0, 2], [1, 3]]
    with pytest.raises(NxdError, match="unknown parallel axis 'xp'"):
        Layout((("dp", 2), ("xp", 2)))


def test_placement_reports_its_sums_and_slices():
    lay = layout(2, 2)
    expert = Placement((4, 6), (("xp", Shard(0, 2, 1)),))
    dense = Placement((4, 6))
    assert expert.summed_over(lay) == ("dp",)
    assert dense.summed_over(lay) == ("dp", "xp")
    assert isinstance(dense.along("xp"), Replicate)
    tp = Layout.of(tp=4)
    kv = Placement((8, 2), (("tp", Shard(0, 2, 1, replicas=2)),))
    norm = Placement((8,), (("tp", Partial()),))
    assert kv.partial_sums(tp) == [("tp", 2)] and norm.partial_sums(tp) == [("tp", 4)]
    both = Placement((4, 6), (("xp", Shard(0, 2, 1)), ("tp", Shard(1, 3, 2))))
    assert both.pieces() == [(slice(2, 4), slice(4, 6))] and both.local_shape == (2, 2)
    fused = Placement((6, 2), (("tp", Shard(0, 2, 1, parts=(4, 2))),))
    assert fused.pieces() == [(slice(2, 4), slice(0, 2)), (slice(5, 6), slice(0, 2))]

"""Collectives on CPU tensors and objects under the ``xla`` process-group backend, in worker
processes started as ``nxd-finetune run`` starts them (torch's elastic agent, ``xla://``).

- The xla backend takes XLA tensors only; the gloo host groups (``ParallelState.host_group``) that the
  trainer, checkpoints and export use for CPU tensors and objects work beside it. A world of one
  process skips the collectives (torch_xla returns at once), so the workers set
  ``XLA_ALWAYS_ALLREDUCE=1`` to make the default group try them.
- torch_xla's CPU device (``PJRT_DEVICE=CPU``) cannot form a multi-process world: every process
  joins as rank 0 of a world of 1. That is why no dp=2 run is tested here (docs/trainium.md); the
  routing of every call site through the host groups is tested on gloo in tests/test_xla_env.py.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed (make test-xla builds .venv-xla)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nxd_finetune.errors import NxdError  # noqa: E402
from nxd_finetune.parallel.launch import init_distributed, launch  # noqa: E402
from nxd_finetune.parallel.state import Layout, ParallelState  # noqa: E402

CALLS = {
    "all_reduce": lambda g: dist.all_reduce(torch.ones(1), group=g),
    "all_gather": lambda g: dist.all_gather([torch.empty(1)], torch.ones(1), group=g),
    "broadcast": lambda g: dist.broadcast(torch.ones(1), src=0, group=g),
    "gather_object": lambda g: dist.gather_object({"rank": 0}, [None], dst=0, group=g),
}


def _cpu_collectives_worker() -> dict:
    os.environ["XLA_ALWAYS_ALLREDUCE"] = "1"
    backend = init_distributed("xla")
    state = ParallelState(Layout.for_world(backend.world_size))
    out: dict = {"default": dist.get_backend(),
                 "host": [dist.get_backend(state.host_group(a)) for a in (None, "tp", "pp", "dp")],
                 "on_xla": {}}
    for name, call in CALLS.items():
        try:
            call(None)
            out["on_xla"][name] = "ok"
        except RuntimeError as e:
            out["on_xla"][name] = str(e).strip().splitlines()[0]
        call(state.host_group())  # gloo: fine
    dist.destroy_process_group()
    return out


def _world_worker() -> str:
    try:
        init_distributed("xla")
    except NxdError as e:
        return str(e)
    dist.destroy_process_group()
    return "joined"


def test_cpu_tensors_fail_on_the_xla_group_and_pass_on_the_host_groups():
    (out,) = launch(_cpu_collectives_worker, 1)
    assert out["default"] == "xla" and out["host"] == ["gloo"] * 4
    assert out["on_xla"] == {
        "all_reduce": "Expected all tensors in the given list to be XLA tensors. Element at index 0 is not an "
                      "XLA tensor. Got: torch.FloatTensor",
        "all_gather": "Expected XLA tensor. Got: torch.FloatTensor",
        "broadcast": "Check failed: device.type() == at::kXLA (cpu vs. xla)cpu",
        "gather_object": "Expected XLA tensor. Got: torch.LongTensor",
    }, out["on_xla"]


def test_the_cpu_pjrt_device_splits_a_two_process_launch_into_two_worlds_of_one():
    """If this starts failing, torch_xla's CPU client has learnt multi-process worlds: add the dp=2
    LoRA run against the single-process loss curve. Each process finds itself in a world of 1 and
    ``init_distributed`` refuses that with one line, instead of two runs that each think they are
    the whole world."""
    assert launch(_world_worker, 2) == ["the xla process group has 1 process(es) but WORLD_SIZE=2: this device "
                                        "cannot form a 2-process world (torch_xla's CPU device runs 1 process)"] * 2

"""The device hooks of :mod:`nxd_finetune.runtime` on a real XLA device: one graph execution per step
however many values are read through step closures, batches prefetched onto the device, state
moved to CPU, the xla device backend."""

from __future__ import annotations

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed (make test-xla builds .venv-xla)")

import torch  # noqa: E402

from nxd_finetune.parallel.launch import device_backend, dist_backend_for, init_distributed  # noqa: E402
from nxd_finetune.runtime import XlaRuntime, make_runtime  # noqa: E402


@pytest.fixture(scope="module")
def rt() -> XlaRuntime:
    backend = device_backend("xla")
    assert (backend.name, backend.dist_backend, backend.device.type) == ("xla", "xla", "xla")
    runtime = make_runtime(backend.device)
    assert isinstance(runtime, XlaRuntime) and runtime.lazy
    return runtime


def test_xla_backend_single_process():
    assert dist_backend_for("xla") == "xla"
    single = init_distributed("xla")  # not launched: world size 1, no process group
    assert (single.name, single.world_size, single.device.type) == ("xla", 1, "xla")


def test_reading_values_in_step_closures_adds_no_graph(rt):
    w = torch.nn.Parameter(torch.ones(4, device=rt.device))
    opt = torch.optim.SGD([w], lr=0.1)
    seen: list[dict] = []

    def step(x: torch.Tensor) -> None:
        loss = ((w * x) ** 2).sum()
        loss.backward()
        norm = w.grad.norm()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rt.on_host(seen.append, {"loss": loss.detach(), "grad_norm": norm, "none": None})
        assert seen == [] or len(seen) == len(rt.compiles)  # nothing read before the step ran
        rt.end_step()

    for i in range(5):
        step(torch.full((4,), float(i + 1)).to(rt.device))  # data, as batches are (not traced scalars)
    launched = [b - a for a, b in zip(rt.launches, rt.launches[1:], strict=False)]
    assert launched == [1, 1, 1, 1], rt.launches  # one graph per step: the closures read no pending value
    assert rt.compiles[-1] == rt.compiles[1], rt.compiles  # no new graph after step 2
    # eager reference of the same updates
    w_ref = torch.ones(4)
    for i, rec in enumerate(seen):
        x = torch.full((4,), float(i + 1))
        assert rec["loss"] == pytest.approx(float(((w_ref * x) ** 2).sum()), rel=1e-6)
        grad = 2 * w_ref * x * x
        assert rec["grad_norm"] == pytest.approx(float(grad.norm()), rel=1e-6) and rec["none"] is None
        w_ref = w_ref - 0.1 * grad
    assert torch.allclose(rt.to_cpu({"w": w.detach()})["w"], w_ref, rtol=1e-6)


def test_batches_arrive_on_the_device_with_the_loaders_state(rt):
    class Source:
        drawn = 0

        def __iter__(self):
            for i in range(4):
                self.drawn += 1
                yield [{"input_ids": torch.full((2, 8), i)}], i

    src = Source()
    loader = rt.batches(src, snapshot=lambda: src.drawn)
    for i, (micro, n) in enumerate(loader):
        assert micro[0]["input_ids"].device.type == "xla" and n == i
        assert loader.state_dict() == i + 1
        assert int(micro[0]["input_ids"].sum().cpu()) == 16 * i
    loader.close()


def test_to_cpu_moves_a_nested_state(rt):
    state = {"model": {"a": torch.arange(3, device=rt.device) * 2}, "step": 7, "opt": [torch.ones(2, device=rt.device)]}
    out = rt.to_cpu(state)
    assert out["model"]["a"].device.type == "cpu" and out["model"]["a"].tolist() == [0, 2, 4]
    assert out["step"] == 7 and out["opt"][0].device.type == "cpu"


def test_a_host_read_in_the_loop_shows_as_a_second_graph():
    """The instrument the training test relies on: ``float(loss)`` before the step's sync forces
    an extra graph, and the launch count sees it."""
    rt = make_runtime(device_backend("xla").device)
    w = torch.nn.Parameter(torch.ones(4, device=rt.device))
    opt = torch.optim.SGD([w], lr=0.1)
    for i in range(4):
        loss = ((w * torch.full((4,), float(i + 1)).to(rt.device)) ** 2).sum()
        loss.backward()
        float(loss.detach())  # the anti-pattern
        opt.step()
        opt.zero_grad(set_to_none=True)
        rt.end_step()
    assert [b - a for a, b in zip(rt.launches, rt.launches[1:], strict=False)] == [2, 2, 2]


def test_a_new_step_graph_after_step_2_is_logged_once(caplog):
    rt = make_runtime(device_backend("xla").device)
    w = torch.nn.Parameter(torch.ones(4, device=rt.device))
    for step, rows in enumerate((2, 2, 2, 3, 5), 1):  # the batch shape changes at step 4
        if step == 3:  # an eval between steps compiles its own graph at its own sync: no warning
            with torch.no_grad():
                evaluated = (w * torch.ones(7, 4).to(rt.device)).sum()
            rt.sync()
            assert float(evaluated) == pytest.approx(28 * 0.6)  # w after two steps of -0.1 * 2
        (w * torch.ones(rows, 4).to(rt.device)).sum().backward()
        with torch.no_grad():
            w -= 0.1 * w.grad
        w.grad = None
        rt.end_step()
    assert rt.compiles[2] > rt.compiles[1]  # the eval's graph
    warnings = [r.getMessage() for r in caplog.records if "compiled a new graph" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("XLA compiled a new graph at step 4"), warnings


def test_prepare_asks_the_engine_for_full_logits_not_sequence_parallel(rt):
    from types import SimpleNamespace

    engine = SimpleNamespace(full_logits=False, sequence_parallel=False)
    rt.prepare(engine)
    assert engine.full_logits and not engine.sequence_parallel


def test_rng_state_restores_the_xla_dropout_masks(rt):
    """A checkpoint's RNG state holds the XLA device's seed: restored, the next dropout mask on the
    device is the one drawn after the save (and differs from the mask before it)."""
    from nxd_finetune.checkpoint.training import rng_state, set_rng_state

    device = rt.device
    x = torch.ones(64, 64, device=device)

    def mask() -> torch.Tensor:
        m = torch.nn.functional.dropout(x, p=0.5).cpu()  # .cpu() executes the graph
        return m

    first = mask()
    saved = rng_state(device=device)
    assert "xla" in saved and saved["xla"].shape == (1, 1)
    second = mask()
    assert not torch.equal(first, second)
    mask()  # move the seed on
    set_rng_state(saved, device=device)
    assert torch.equal(mask(), second)
    assert "xla" not in rng_state(device=torch.device("cpu"))

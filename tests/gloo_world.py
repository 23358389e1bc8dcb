"""Real gloo worlds for the multi-rank tests: ``run_world`` forks ``world`` processes (~0.1 s each),
each runs ``fn(rank, world, *args)`` in an initialised process group and returns ``{check: (kind,
got, expected)}`` through a file; ``assert_checks`` asserts them in the parent, naming the rank."""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        results = fn(rank, world, *args)
        dist.destroy_process_group()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def run_world(fn, world: int, tmp_path, *args, timeout: float = 120.0) -> list[dict]:
    """Run ``fn(rank, world, *args)`` in ``world`` forked gloo processes; per-rank results."""
    out_dir = tmp_path / f"results-{fn.__name__}-{world}"
    out_dir.mkdir()
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, str(out_dir), args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = sorted(out_dir.glob("*.err"))
    if errors:
        pytest.fail("\n".join(f"{e.stem}:\n{e.read_text()}" for e in errors))
    if hung:
        pytest.fail(f"ranks {hung} did not finish in {timeout}s")
    assert [p.exitcode for p in procs] == [0] * world
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def assert_checks(results: list[dict], atol: float = 1e-5) -> int:
    n = 0
    for rank, checks in enumerate(results):
        for name, (kind, got, expected) in checks.items():
            if kind == "close":
                torch.testing.assert_close(
                    got, expected, atol=atol, rtol=1e-5, msg=lambda m, r=rank, c=name: f"rank {r}, {c}: {m}"
                )
            else:
                diff, scale = (got - expected).abs().max(), expected.abs().max()
                assert diff > 0.05 * scale, f"rank {rank}, {name}: expected a difference, got {diff} (scale {scale})"
            n += 1
    return n

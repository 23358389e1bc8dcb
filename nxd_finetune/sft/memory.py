"""Each rank's measured peak memory, for ``summary.json``.

Host memory is the process's resident high-water mark (``VmHWM`` of ``/proc/self/status`` on
Linux: anonymous memory plus the pages of the memory-mapped checkpoint files it touched;
``ru_maxrss`` elsewhere). Device memory is the allocator's peak on CUDA (``None`` on CPU/XLA).
:func:`gather_peak_memory` is a collective over the run's host group: every rank calls it.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import TypedDict

import torch
import torch.distributed as dist

from nxd_finetune.device import peak_memory_mb

MiB = 2**20


_seen_peak_mb: dict[int, float] = {}  # by pid: a forked child has its own high-water mark


def host_peak_mb() -> float:
    """This process's peak resident memory so far, in MiB, never lower than an earlier answer.

    The kernel's ``VmHWM`` folds in per-thread RSS counters lazily, so two reads can go down by a
    fraction of a MiB; the high-water mark this returns is the running maximum of the reads.
    """
    pid = os.getpid()
    _seen_peak_mb[pid] = max(_seen_peak_mb.get(pid, 0.0), _read_host_peak_mb())
    return _seen_peak_mb[pid]


def _read_host_peak_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (MiB if sys.platform == "darwin" else 1024), 1)


def device_peak_mb(device: torch.device) -> float | None:
    """The device's peak allocated memory (the device module's statistics; None where it has none)."""
    return peak_memory_mb(device)


class RankMemory(TypedDict):
    """One rank's memory record in the run summary (MiB; ``peak_device_mb`` None where the device
    module keeps no statistics: cpu, xla)."""

    rank: int
    peak_host_mb_training: float
    peak_host_mb: float
    peak_device_mb: float | None


def rank_memory(rank: int, device: torch.device, train_peak_mb: float) -> RankMemory:
    """This rank's record: the host peak up to the end of training and over the whole run."""
    return {"rank": rank, "peak_host_mb_training": train_peak_mb, "peak_host_mb": host_peak_mb(),
            "peak_device_mb": device_peak_mb(device)}


def gather_peak_memory(mine: RankMemory, group: dist.ProcessGroup | None) -> list[RankMemory]:
    """Every rank's record (collective over ``group``; just ``[mine]`` without a process group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [mine]
    out: list[RankMemory | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return sorted((r for r in out if r is not None), key=lambda r: r["rank"])  # every slot filled

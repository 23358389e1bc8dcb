"""Where a process's resident memory is at its peak: glibc heap in use / free, mapped chunks, file pages.

    PYTHONPATH=bench/memtrace NXD_TRACE_MEM=/tmp/trace nxd-finetune run RECIPE [--nproc N ...]

Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, so every process of the run (the
launcher and each worker rank) loads this file. With ``NXD_TRACE_MEM`` set, a daemon thread samples
``/proc/self/status`` every 20 ms and, whenever the resident total is the highest so far, glibc's
``mallinfo2()`` (main arena): ``heap_used`` (``uordblks``), ``heap_free`` (``fordblks``, freed but
kept resident), ``mapped`` (``hblkhd``: chunks glibc mapped on their own, 32 MiB and up once its
threshold has grown). At exit each process writes that sample as one JSON line to
``$NXD_TRACE_MEM.<pid>.<RANK>`` (MiB). Linux + glibc only; a sample can miss a peak shorter than
20 ms. Used for the tp=2 table in ``bench/README.md``.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import threading
import time

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def _status_mib() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                out[line.split(":")[0]] = int(line.split()[1]) // 1024
    return out


def _start(path: str) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    best: dict[str, float] = {"resident": 0}

    def loop() -> None:
        while True:
            s = _status_mib()
            total = sum(s.values())
            if total > best["resident"]:
                m = libc.mallinfo2()
                best.update(resident=total, **s, heap_used=m.uordblks >> 20, heap_free=m.fordblks >> 20,
                            mapped=m.hblkhd >> 20, time=time.time())
            time.sleep(0.02)

    def dump() -> None:
        with open(f"{path}.{os.getpid()}.{os.environ.get('RANK', '0')}", "w") as f:
            f.write(json.dumps(best) + "\n")

    threading.Thread(target=loop, daemon=True, name="nxd-memtrace").start()
    atexit.register(dump)


if os.environ.get("NXD_TRACE_MEM"):
    _start(os.environ["NXD_TRACE_MEM"])

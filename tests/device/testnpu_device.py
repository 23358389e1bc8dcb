"""The suite's test device ``testnpu``: a PrivateUse1 backend on CPU kernels, registered as a
third-party device registers itself (TorchNeuron's ``neuron`` is one: PrivateUse1 too).

:func:`register` (idempotent): renames PrivateUse1 to ``testnpu``, builds (once, cached under
``TESTNPU_BUILD`` or the user cache) and loads the C++ extension ``testnpu.cpp`` (allocator,
device guard, hooks, a CPU fallback for every operator), registers the device module
(``torch.testnpu``: device count, current device, synchronize, RNG state, memory statistics) and
the process-group backend ``testnpu_ccl`` that torch maps to the device (:class:`HostCollectives`:
gloo over host copies of the device tensors). ``TESTNPU_NO_CCL`` / ``TESTNPU_NO_MEMORY_STATS`` leave
the backend / the memory statistics out (a device that lacks them). :func:`autoload_dir` writes a directory that, on
``PYTHONPATH``, makes ``import torch`` load the device in every process (torch's
``torch.backends`` entry points, as installed device packages do), launched workers included.
"""

from __future__ import annotations

import datetime
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

NAME = "testnpu"
CCL = "testnpu_ccl"
HERE = Path(__file__).resolve().parent
_ext: types.ModuleType | None = None


def build_dir() -> Path:
    """Where the extension is built (kept between runs: built once)."""
    root = os.environ.get("TESTNPU_BUILD") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "nxd-finetune-tests", "testnpu")
    tag = torch.__version__.replace("+", "_")
    path = Path(root) / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def _load_extension() -> types.ModuleType:
    from torch.utils.cpp_extension import load

    return load(f"{NAME}_ext", [str(HERE / "testnpu.cpp")], build_directory=str(build_dir()),
                extra_cflags=["-O1"], verbose=False)


def _device_module(ext: types.ModuleType) -> types.ModuleType:
    mod = types.ModuleType(f"torch.{NAME}")

    def synchronize(device: object = None) -> None:
        """Kernels run on the host, at once."""

    mod.is_available = lambda: True  # type: ignore[attr-defined]
    mod.is_initialized = lambda: True  # type: ignore[attr-defined]
    mod._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    mod._lazy_init = lambda: None  # type: ignore[attr-defined]
    mod.device_count = ext.device_count  # type: ignore[attr-defined]
    mod.current_device = ext.current_device  # type: ignore[attr-defined]
    mod.set_device = lambda d: ext.set_device(torch.device(d).index or 0 if not isinstance(d, int) else d)  # type: ignore[attr-defined]
    mod.synchronize = synchronize  # type: ignore[attr-defined]
    # the device's random numbers are drawn by the CPU's generator (the hooks hand it out)
    mod.get_rng_state = lambda device=None: torch.get_rng_state()  # type: ignore[attr-defined]
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)  # type: ignore[attr-defined]
    # torch.manual_seed seeds the CPU generator, then calls these: nothing more to seed
    mod.manual_seed = lambda seed: None  # type: ignore[attr-defined]
    mod.manual_seed_all = lambda seed: None  # type: ignore[attr-defined]
    mod.get_amp_supported_dtype = lambda: [torch.bfloat16, torch.float16]  # type: ignore[attr-defined]
    if not os.environ.get("TESTNPU_NO_MEMORY_STATS"):  # set: a device that keeps none
        mod.memory_allocated = lambda device=None: ext.memory_allocated()  # type: ignore[attr-defined]
        mod.max_memory_allocated = lambda device=None: ext.max_memory_allocated()  # type: ignore[attr-defined]
        mod.reset_peak_memory_stats = lambda device=None: ext.reset_peak_memory_stats()  # type: ignore[attr-defined]
    return mod


class HostCollectives(dist.ProcessGroup):
    """The ``testnpu_ccl`` process group: every collective copies its device tensors to the host,
    runs gloo's collective over them and copies the results back (a device with its own
    collectives library registers that instead, e.g. TorchNeuron's)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._name = ""
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:  # noqa: N802  torch's name
        return CCL

    # a ProcessGroup of Python keeps its name itself (torch's C++ one asks its backends, it has none)
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _run(self, name: str, *args: object) -> dist.Work:
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

        def host(obj: object) -> object:
            if isinstance(obj, torch.Tensor):
                if obj.device.type != NAME:
                    return obj
                cpu = obj.detach().cpu()
                pairs.append((obj, cpu))
                return cpu
            if isinstance(obj, list):
                return [host(o) for o in obj]
            return obj

        work = getattr(self._gloo, name)(*[host(a) for a in args])
        work.wait()
        with torch.no_grad():
            for dev, cpu in pairs:
                dev.copy_(cpu)
        from torch._C._distributed_c10d import _create_work_from_future

        fut: torch.futures.Future[object] = torch.futures.Future()
        fut.set_result(None)
        return _create_work_from_future(fut)

    def _method(name: str, gloo_name: str) -> Callable[..., dist.Work]:  # type: ignore[misc]  # class-body helper
        def call(self: HostCollectives, *args: object) -> dist.Work:
            return self._run(gloo_name, *args)

        call.__name__ = name
        return call

    # this group's collectives -> gloo's of the same arguments
    for _n, _g in (*((n, n) for n in ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "_allgather_base",
                                      "allgather_coalesced", "reduce_scatter", "_reduce_scatter_base",
                                      "alltoall_base", "alltoall", "send", "recv", "reduce", "gather", "scatter")),
                   ("all_gather_single", "_allgather_base"), ("reduce_scatter_single", "_reduce_scatter_base"),
                   ("all_to_all_single", "alltoall_base")):
        locals()[_n] = _method(_n, _g)
    del _n, _g

    def barrier(self, opts: object = None) -> dist.Work:
        return self._gloo.barrier(dist.BarrierOptions())


def _create_ccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> HostCollectives:
    return HostCollectives(store, rank, size, timeout)


def register() -> None:
    """Register ``testnpu`` in this process (once)."""
    global _ext
    if _ext is not None:
        return
    torch.utils.rename_privateuse1_backend(NAME)
    _ext = _load_extension()
    torch._register_device_module(NAME, _device_module(_ext))
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    if not os.environ.get("TESTNPU_NO_CCL"):  # set: a device without a process-group backend
        dist.Backend.register_backend(CCL, _create_ccl, devices=[NAME])


def autoload_dir(root: Path) -> Path:
    """A directory that loads ``testnpu`` at ``import torch`` when on ``PYTHONPATH`` (a
    ``torch.backends`` entry point, as an installed device package declares)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "testnpu_autoload.py").write_text(
        f"import sys\nsys.path.insert(0, {str(HERE)!r})\n\n\ndef load():\n"
        "    import testnpu_device\n\n    testnpu_device.register()\n")
    info = root / "testnpu_autoload-0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: testnpu-autoload\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntestnpu = testnpu_autoload:load\n")
    return root


if __name__ == "__main__":  # build once (CI: before the suite)
    register()
    print(f"{NAME} registered: {torch.accelerator.current_accelerator()}, extension in {build_dir()}", file=sys.stderr)

"""THE device layer: which device a run computes on, and what torch offers there, through torch's
device-generic APIs only. No other module of the training path asks which device it is on.

A device is a torch device type: ``cpu``, ``cuda``, ``xla`` (torch-xla: Trainium on Neuron SDK
<= 2.28) or any backend registered with torch, e.g. a PrivateUse1 backend such as TorchNeuron's
``neuron`` (Neuron SDK 2.33+, Trn2 / Trn3) or the test suite's ``npu_test``. What the layer uses:

- :func:`resolve_device_name`: ``auto`` -> the current accelerator (``torch.accelerator``), else
  ``xla`` where ``torch_neuronx`` imports beside ``torch_xla`` (the SDK <= 2.28 stack), else ``cpu``.
- :func:`device_for`: ``torch.device(type, LOCAL_RANK)``, checked against the device module
  (``torch.get_device_module``: registered, available, enough devices); ``xla``: torch_xla's device.
- :func:`dist_backend_for`: the process-group backend torch maps to the device
  (``torch.distributed.get_default_backend_for_device``: gloo, nccl, a registered backend's name);
  ``xla``: torch_xla's ``xla`` backend.
- :func:`set_current`, :func:`synchronize`: ``torch.accelerator`` (or the device module).
- :func:`device_rng_state` / :func:`set_device_rng_state`: the device module's generator state.
- :func:`peak_memory_mb`: the device module's ``max_memory_allocated`` where it has one, else None.
- :func:`device_gaps`: what the device lacks for a recipe (a process-group backend for several
  processes, autocast for ``bf16-mixed``, the ``model.compile`` backend), one line each, for
  ``validate`` and the start of ``run``.

``torch_xla`` is imported only for an ``xla`` device (its lazy-tensor loop is in
:mod:`nxd_finetune.runtime`).
"""

from __future__ import annotations

import os
import shutil
import types

import torch
import torch.distributed as dist

from nxd_finetune import neuron  # looked up at call time (tests patch neuron_available)
from nxd_finetune.errors import NxdError

NAMES_HINT = "use auto, cpu, cuda or xla, or a device backend registered with torch (neuron with TorchNeuron)"


# ---------------------------------------------------------------- xla (torch-xla)


def require_torch_xla() -> None:
    """Raise NxdError (one line) when ``torch_xla`` does not import."""
    if not neuron.torch_xla_available():
        raise NxdError(
            f"device xla (Trainium) is not available here: torch_xla does not import with torch {torch.__version__}; "
            "on Trainium use the Neuron DLAMI or container (torch-neuronx); to test on CPU see `make test-xla`"
        )


def xla_device() -> torch.device:
    """This process's XLA device (on Neuron: the NeuronCore the runtime gave the process)."""
    require_torch_xla()
    import torch_xla

    return torch_xla.device()


# ---------------------------------------------------------------- names and modules


def accelerator_type() -> str | None:
    """The type of ``torch.accelerator``'s current accelerator when one is available (cuda, xpu,
    a PrivateUse1 backend ...), else None."""
    acc = torch.accelerator.current_accelerator(check_available=True)
    return None if acc is None else acc.type


def resolve_device_name(name: str = "auto") -> str:
    """``auto`` -> the current accelerator (``torch.accelerator``), else ``xla`` where
    ``torch_neuronx`` imports (the torch-xla stack of Neuron SDK <= 2.28), else ``cpu``; other names
    unchanged. A plain torch_xla install does not make ``auto`` pick xla: ask for ``xla`` there."""
    if name != "auto":
        return name
    acc = accelerator_type()
    if acc is not None:
        return acc
    return "xla" if neuron.neuron_available() else "cpu"


def device_module(name: str) -> types.ModuleType | None:
    """``torch.get_device_module(name)``, or None when torch has no module of that name."""
    if name == "xla":
        return None
    try:
        return torch.get_device_module(name)
    except (RuntimeError, ValueError, AttributeError):
        return None


def known_device(name: str) -> bool:
    """Whether ``name`` is a device type torch has here (xla: whether torch_xla imports)."""
    if name == "xla":
        return neuron.torch_xla_available()
    return device_module(name) is not None


def _unknown(name: str) -> NxdError:
    return NxdError(f"unknown device {name!r}; {NAMES_HINT}")


def device_count(name: str) -> int:
    """Devices of type ``name`` this process sees (``torch.accelerator`` for the current
    accelerator, else the device module's ``device_count``; 1 for cpu and xla)."""
    if name == accelerator_type():
        return torch.accelerator.device_count()
    count = getattr(device_module(name), "device_count", None)
    return 1 if count is None else int(count())


def device_for(name: str = "auto", local_rank: int = 0) -> torch.device:
    """The device of a process (``<type>:<local_rank>`` for an accelerator). Raises NxdError (one
    line) for a name torch does not know here, a device that is not available, or fewer devices
    than ``local_rank + 1``."""
    name = resolve_device_name(name)
    if name == "xla":
        return xla_device()
    if name == "cpu":
        return torch.device("cpu")
    module = device_module(name)
    if module is None:
        raise _unknown(name)
    available = getattr(module, "is_available", None)
    if available is not None and not available():
        raise NxdError(f"device {name} was asked for but no {name} device is visible")
    count = device_count(name)
    if local_rank >= count:
        raise NxdError(f"process {local_rank} of this node needs device {name}:{local_rank} but torch sees "
                       f"{count} {name} device(s); start at most {count} processes per node")
    return torch.device(name, local_rank)


def dist_backend_for(name: str = "auto") -> str:
    """The process-group backend torch maps to device ``name``
    (``torch.distributed.get_default_backend_for_device``: cpu -> gloo, cuda -> nccl, a registered
    backend's own); ``xla`` -> torch_xla's ``xla``. NxdError (one line) when there is none."""
    name = resolve_device_name(name)
    if name == "xla":
        return "xla"
    try:
        return dist.get_default_backend_for_device(name)
    except (ValueError, RuntimeError):
        pass
    if not known_device(name):
        raise _unknown(name)
    raise NxdError(f"device {name} has no process-group backend registered with torch.distributed "
                   f"(torch.distributed.Backend.register_backend(..., devices=[{name!r}])); a run of more than "
                   "one process needs one")


def device_of_backend(backend: str) -> str | None:
    """The device type torch maps to process-group ``backend`` (gloo -> cpu, nccl -> cuda, a
    registered backend -> its device; xla -> xla); None for a backend mapped to no device."""
    if backend == "xla":
        return "xla"
    return next((d for d, b in dist.Backend.default_device_backend_map.items() if b == backend), None)


def mesh_device_type(backend: str) -> str:
    """The device type of a ``DeviceMesh`` over a world on process-group ``backend``: the device
    torch maps to it where torch has a module for it (cuda, a registered backend's device), else
    cpu (gloo; xla, whose groups sit on a CPU mesh)."""
    name = device_of_backend(backend)
    return name if name is not None and device_module(name) is not None else "cpu"


# ---------------------------------------------------------------- state of the device


def set_current(device: torch.device) -> None:
    """Make ``device`` the process's current device (``torch.accelerator.set_device_index``, or the
    device module's ``set_device``); nothing for devices without a current one."""
    if device.index is None:
        return
    if device.type == accelerator_type():
        torch.accelerator.set_device_index(device.index)
        return
    setter = getattr(device_module(device.type), "set_device", None)
    if setter is not None:
        setter(device.index)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (``torch.accelerator.synchronize`` / the module's)."""
    if device.type == accelerator_type():
        torch.accelerator.synchronize(device)
        return
    sync = getattr(device_module(device.type), "synchronize", None)
    if sync is not None:
        sync(device)


def device_rng_state(device: torch.device) -> torch.Tensor | None:
    """The device generator's state: the device module's ``get_rng_state`` (xla: the seed as one
    int64); None on cpu (torch's CPU generator is saved on its own) and where the module has none."""
    if device.type == "cpu":
        return None
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        seed = xm.get_rng_state(str(device))  # an unsigned 64-bit int, stored as int64
        return torch.tensor([seed - (1 << 64) if seed >= 1 << 63 else seed])
    get = getattr(device_module(device.type), "get_rng_state", None)
    return None if get is None else get(device)


def set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    """Restore :func:`device_rng_state`."""
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(state[0]) % (1 << 64), str(device))
        return
    put = getattr(device_module(device.type), "set_rng_state", None)
    if put is not None:
        put(state.clone(), device)


def peak_memory_mb(device: torch.device) -> float | None:
    """The device module's ``max_memory_allocated`` in MiB; None where it has none (cpu, xla)."""
    if device.type == "cpu":
        return None
    peak = getattr(device_module(device.type), "max_memory_allocated", None)
    return None if peak is None else round(peak(device) / (1 << 20), 1)


# ---------------------------------------------------------------- what a device lacks


def compile_gap(name: str, backend: str) -> str | None:
    """Why ``torch.compile(backend=backend)`` cannot run on device ``name`` here (None: it can).
    xla compiles the whole step's graph itself; ``inductor`` needs a code generator for the device
    (torch's: cpu, cuda, xpu, mps; other backends register theirs); other backends must be
    registered with torch._dynamo (TorchNeuron registers ``neuron``)."""
    if name == "xla":
        return (f"model.compile={backend} does not apply to device xla (torch_xla compiles the step's graph "
                "itself); leave model.compile=false")
    from torch._dynamo import list_backends

    if backend not in list_backends(exclude_tags=()):
        return (f"model.compile={backend}: torch.compile has no backend {backend!r} here (it has "
                f"{', '.join(sorted(list_backends()))})")
    if backend == "inductor":
        from torch._inductor.codegen.common import get_scheduling_for_device, init_backend_registration

        init_backend_registration()
        if get_scheduling_for_device(name) is None:
            return (f"model.compile=inductor: inductor generates no code for device {name}; name the device's "
                    "own torch.compile backend (model.compile=neuron on TorchNeuron) or leave model.compile=false")
        if name == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "clang++") if c):
            return ("model.compile=inductor on cpu needs a C++ compiler (g++ or clang++, or $CXX) on PATH for "
                    "torch's inductor; install one or leave model.compile=false")
    return None


def device_gaps(name: str, *, processes: int = 1, precision: str = "fp32", compile_backend: str | None = None
                ) -> list[str]:
    """What device ``name`` (resolved) lacks for a run, one line each: a process-group backend
    when ``processes > 1``, autocast under ``bf16-mixed``, the ``model.compile`` backend."""
    name = resolve_device_name(name)
    gaps: list[str] = []
    if processes > 1:
        try:
            dist_backend_for(name)
        except NxdError as e:
            gaps.append(str(e))
    if precision == "bf16-mixed" and name != "xla" and not torch.amp.is_autocast_available(name):
        gaps.append(f"training.precision=bf16-mixed needs torch.autocast on device {name}, which torch does not "
                    "offer here; use training.precision=bf16 or fp32")
    if compile_backend is not None:
        gap = compile_gap(name, compile_backend)
        if gap is not None:
            gaps.append(gap)
    return gaps

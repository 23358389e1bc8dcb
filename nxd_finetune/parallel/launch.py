"""Starting workers and joining the process group; device backends.

- :func:`launch` starts ``nproc`` local workers through torch's elastic launcher
  (``torch.distributed.launcher.api.elastic_launch``: the agent behind ``torchrun``) with a
  standalone c10d rendezvous on 127.0.0.1 and a free port, and returns every rank's return
  value. ``max_restarts=K``: when a worker dies or raises, the agent stops the others and starts
  the whole group again, up to K times (torch elastic's restarts, as ``torchrun --max-restarts``);
  the training loop then resumes from its newest complete checkpoint by itself. A worker that
  raises or dies in the last attempt surfaces in the parent as one NxdError line naming the rank
  and the cause (the worker's traceback is in the launcher's log output; after a restart, a
  failure again is logged as one line, not another traceback).
- :func:`init_distributed` joins the process group when the environment describes one
  (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``: set by ``torchrun`` and by :func:`launch`), picking
  gloo on CPU, nccl on CUDA and xla on XLA devices; without them it is a single process (world
  size 1, no group).
- :class:`DeviceBackend`: ``cpu`` -> gloo, ``cuda`` -> nccl (device ``cuda:LOCAL_RANK``), ``xla``
  (Trainium / Neuron, or torch_xla on CPU for tests) -> the ``xla`` process-group backend on the
  process's XLA device (one NeuronCore per process on Trainium; torch_xla is imported only here,
  through :mod:`nxd_finetune.runtime`). :func:`dist_backend_for` maps a ``training.device`` to its backend.

Temporary files (the launcher's logs and error files) go under ``TMPDIR`` (``tempfile``), and the
launcher's log directory is removed after the run.
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, Generic, TypedDict, TypeVar

import torch
import torch.distributed as dist

from nxd_finetune import device
from nxd_finetune.errors import NxdError
from nxd_finetune.runtime import refuse_unformable_world

R = TypeVar("R")

ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")
# torch's backends that bind the default group to its device (``device_id``); a backend registered
# from Python (torch.distributed.Backend.register_backend) may not implement the split that implies
BOUND_BACKENDS = ("nccl", "xccl")


@dataclasses.dataclass(frozen=True)
class DeviceBackend:
    """Where a worker computes and how it communicates: ``name`` (the device type: cpu, cuda, xla,
    neuron, ...), ``dist_backend`` (the process-group backend torch maps to it: gloo, nccl, xla,
    a registered backend's name), ``device``; ``rank`` / ``world_size`` / ``local_rank``."""

    name: str
    dist_backend: str
    device: torch.device
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def resolve_device_name(name: str = "auto") -> str:
    """:func:`nxd_finetune.device.resolve_device_name` (``auto``: the current accelerator, else
    xla where ``torch_neuronx`` imports, else cpu)."""
    return device.resolve_device_name(name)


def dist_backend_for(name: str = "auto") -> str:
    """The process-group backend for ``training.device`` (:func:`nxd_finetune.device.dist_backend_for`)."""
    return device.dist_backend_for(name)


def device_backend(name: str = "auto", local_rank: int = 0, processes: int = 1) -> DeviceBackend:
    """The backend for device ``name`` (``auto``: see :func:`resolve_device_name`). Raises NxdError
    for a device that is unknown or not available here, and (``processes > 1``) one without a
    process-group backend."""
    name = resolve_device_name(name)
    dev = device.device_for(name, local_rank)
    return DeviceBackend(name, group_backend(name, processes), dev, local_rank=local_rank)


def group_backend(name: str, processes: int) -> str:
    """The process-group backend of a world of ``processes`` on device ``name``: the one torch maps
    to the device (NxdError when it has none and ``processes > 1``); gloo for one process on a
    device without one."""
    return device.dist_backend_for(name) if processes > 1 else _backend_or_gloo(name)


def _backend_or_gloo(name: str) -> str:
    """The device's process-group backend, gloo where it has none (a world of one process)."""
    try:
        return device.dist_backend_for(name)
    except NxdError:
        return "gloo"


def in_launched_env() -> bool:
    """Whether ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` are set (torchrun / :func:`launch`)."""
    return all(k in os.environ for k in ENV_KEYS)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DeviceBackend:
    """Join the default process group described by the environment; returns this worker's backend.

    ``backend``: a process-group backend torch maps to a device (gloo -> cpu, nccl -> cuda, xla,
    a registered backend -> its device: :func:`nxd_finetune.device.device_of_backend`); None picks
    the current accelerator's (``torch.accelerator``), else gloo (``dist_backend_for(training.device)``
    gives the one for a recipe). The device ``<type>:LOCAL_RANK`` becomes the current device (and
    the group's bound device under :data:`BOUND_BACKENDS`); with xla the group is joined through
    torch_xla's ``xla://`` init method, which reads the same torchrun variables. Already
    initialised: returns the current backend. Not launched (no ``RANK`` / ``WORLD_SIZE`` /
    ``MASTER_ADDR``): world size 1, no process group. Raises NxdError for an unknown backend, a
    device that is not available (nccl without CUDA, xla without torch_xla), and a group smaller
    than ``WORLD_SIZE`` (each process alone in a world of its own).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = _backend_or_gloo(device.accelerator_type() or "cpu")
    name = device.device_of_backend(backend)
    if name is None:
        raise NxdError(f"unknown process-group backend {backend!r}; use gloo, nccl or xla, or a backend "
                       "registered for a device (torch.distributed.Backend.register_backend)")
    dev = DeviceBackend(name, backend, device.device_for(name, local_rank), local_rank=local_rank)
    if dist.is_available() and dist.is_initialized():
        return dataclasses.replace(dev, rank=dist.get_rank(), world_size=dist.get_world_size())
    if not in_launched_env():
        return dev
    device.set_current(dev.device)
    extra: dict[str, Any] = {}
    if backend in BOUND_BACKENDS:
        extra["device_id"] = dev.device  # the group's device: eager init, new groups split from it
    if dev.name == "xla":
        import torch_xla.distributed.xla_backend  # noqa: F401  registers the "xla" backend

        refuse_unformable_world(int(os.environ["WORLD_SIZE"]))  # before torch_xla's rendezvous makes a store
        extra["init_method"] = "xla://"
    else:
        store = _attempt_store(timeout_s)
        if store is not None:
            extra.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **extra)
    expected, got = int(os.environ["WORLD_SIZE"]), dist.get_world_size()
    if got != expected:  # torch_xla's CPU device makes every process rank 0 of its own world
        dist.destroy_process_group()
        raise NxdError(f"the {backend} process group has {got} process(es) but WORLD_SIZE={expected}: this "
                       f"device cannot form a {expected}-process world (torch_xla's CPU device runs 1 process)")
    return dataclasses.replace(dev, rank=dist.get_rank(), world_size=got)


SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _attempt_store(timeout_s: float) -> dist.Store | None:
    """The process group's store when the workers share the elastic agent's rendezvous store.

    torch elastic (``torchrun`` with the c10d rendezvous) by default hands its workers the
    agent's own TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``), the same one in every attempt:
    after a restart, a worker can read a peer's address from the attempt before and fail to
    connect (pytorch/pytorch#135712). With one agent (``GROUP_WORLD_SIZE=1``) the attempt number
    ``TORCHELASTIC_RESTART_COUNT`` is the same in every worker, so the group's keys go under
    ``nxd/attempt-<n>/``; with several agents it is not (each counts its own restarts), so a
    multi-node run with restarts must turn the sharing off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
    as the cluster specs of :mod:`nxd_finetune.cluster` set it): warned about here. None: let
    ``init_process_group`` make its store from ``MASTER_ADDR`` / ``MASTER_PORT`` as usual."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and os.environ.get("RANK") == "0":
            import warnings

            warnings.warn(f"restarts of a multi-node run need {SHARE_STORE_ENV}=1 in every node's environment "
                          "(the workers share the agent's store across attempts otherwise)", stacklevel=2)
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"nxd/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


class SmokeResult(TypedDict):
    """What :func:`smoke_test` returns from each worker."""

    rank: int
    world_size: int
    sum: float
    backend: str
    tmpdir: str


def smoke_test(x: float = 0.0) -> SmokeResult:
    """A worker function that checks the process group: joins it (:func:`init_distributed`),
    all-reduces ``rank + x`` and leaves. Returns ``rank``, ``world_size``, ``sum`` (``x * world
    + world * (world - 1) / 2``), ``backend`` and ``tmpdir`` (where this worker's temporary files
    go). Light to import, so ``launch(smoke_test, n)`` checks a machine's set-up in seconds."""
    backend = init_distributed()
    t = torch.tensor([backend.rank + float(x)], device=backend.device)
    if dist.is_initialized():
        dist.all_reduce(t)
    out: SmokeResult = {"rank": backend.rank, "world_size": backend.world_size, "sum": t.item(),
           "backend": backend.dist_backend, "tmpdir": tempfile.gettempdir()}
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _lost_peer(text: str) -> bool:
    """A collective that failed because a peer went away: a consequence, never the root cause
    while another rank's own failure is known."""
    return any(marker in text for marker in _LOST_PEER)


def _consequence(text: str) -> bool:
    """A failure another rank's failure caused: a lost peer, or the SIGTERM the agent sends the
    surviving ranks when one fails (torch elastic raises it as ``SignalException``)."""
    return _lost_peer(text) or text.startswith("SignalException:")


LOST_PEER_GRACE_S = 2.0


class _RootCauseFirst(Generic[R]):
    """A worker function that, when its collective lost a peer, waits :data:`LOST_PEER_GRACE_S`
    before raising: the agent then sees the peer's own failure (a kill, a crash) first and reports
    that, not the connection error it caused. Picklable for ``spawn``."""

    def __init__(self, fn: Callable[..., R]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)  # the agent names the entrypoint
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: object) -> R:
        try:
            return self.fn(*args)
        except Exception as e:
            if _lost_peer(str(e)):
                time.sleep(LOST_PEER_GRACE_S)
            raise


def _failure_line(err: Any, log_dir: str | None = None, max_restarts: int = 0) -> str:
    """One line for the root-cause (earliest) failure of a ``ChildFailedError``.

    Failures are ordered by their error file's modification time: the elastic timestamps count
    whole seconds, and a rank that raised and the peer whose collective then lost its connection
    often share one (the error file is written before the raising process exits, so before its
    peers fail). Error files under ``log_dir`` count too: a rank that raised but had not exited
    when the agent stopped the others is not among ``err.failures``; only the last attempt's
    files are read (earlier attempts failed and were restarted). A rank whose collective lost its
    peer's connection, or that the agent stopped with SIGTERM, comes after every other failure,
    whatever its time (:func:`_consequence`): a killed peer's time is the agent's whole-second
    stamp, which can come later than the survivor's error file."""
    found: dict[int, tuple[float, str]] = {}  # rank -> (when, text)
    for rank, failure in err.failures.items():
        path = failure.error_file
        when = os.path.getmtime(path) if path and os.path.isfile(path) else float(failure.timestamp)
        message = failure.message
        if isinstance(message, dict):  # written by @record: {"message": "Type: text", "extraInfo": {...}}
            message = message.get("message", "")
        text = str(message).strip().splitlines()[0] if str(message).strip() else ""
        if failure.exitcode < 0:
            text = f"killed by signal {failure.signal_name()}"
        elif not (path and os.path.isfile(path)) or not text:  # died without raising (os._exit, crash)
            text = f"exited with code {failure.exitcode}"
        found[rank] = (when, text)
    for path in _last_attempt_error_files(log_dir) if log_dir else []:
        rank = int(os.path.basename(os.path.dirname(path)))
        if rank in found:
            continue
        try:
            with open(path) as f:
                message = json.load(f).get("message", {})
        except (OSError, ValueError):
            continue
        message = message.get("message", "") if isinstance(message, dict) else str(message)
        if message.strip():
            found[rank] = (os.path.getmtime(path), message.strip().splitlines()[0])
    rank = min(found, key=lambda r: (_consequence(found[r][1]), found[r][0], r))
    more = len(found) - 1
    gave_up = f"; gave up after {max_restarts} restart(s)" if max_restarts else ""
    return (f"worker rank {rank} failed: {found[rank][1]}" + (f" ({more} other rank(s) failed too)" if more > 0 else "")
            + gave_up)


def _last_attempt_error_files(log_dir: str) -> list[str]:
    """The workers' error files of the highest ``attempt_<n>`` directory under ``log_dir``."""
    attempts = glob.glob(os.path.join(log_dir, "*", "attempt_*"))
    if not attempts:
        return []
    last = max(attempts, key=lambda p: int(p.rsplit("_", 1)[1]))
    return glob.glob(os.path.join(last, "*", "error.json"))


ELASTIC_PROCS_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _RepeatedFailuresOneLine(logging.Filter):
    """The elastic agent logs every failed attempt with a traceback (``logger.exception``: the
    worker's, or the agent's own for a killed worker). The first one is kept whole; the later
    ones (a restart failing again) become one line each: the message plus the exception's last
    line (``RuntimeError: ...``, ``process 1 terminated with signal SIGKILL``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            if self.seen:
                lines = [line.strip() for line in str(record.exc_info[1]).splitlines() if line.strip()]
                cause = lines[-1] if lines else type(record.exc_info[1]).__name__
                record.msg = f"{record.getMessage()}: {cause}"
                record.args, record.exc_info, record.exc_text = (), None, None
            self.seen = True
        return True


def launch(fn: Callable[..., R], nproc: int, *args: object, start_method: str = "spawn",
           rdzv_timeout_s: int = 120, max_restarts: int = 0) -> list[R]:
    """Run ``fn(*args)`` in ``nproc`` local workers; returns their return values in rank order.

    Workers find ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` (127.0.0.1) and
    ``MASTER_PORT`` in their environment and call :func:`init_distributed` themselves. ``fn``, its
    arguments and return values must pickle (``fn`` defined at module level) under the default
    ``spawn`` start method; ``fork`` starts faster but is unsafe once the parent has started
    threads or CUDA. ``max_restarts``: how many times the agent restarts the whole group after
    a worker failed (``TORCHELASTIC_RESTART_COUNT`` tells the workers which attempt they are in).
    Raises NxdError (one line, ``worker rank R failed: Type: message``, plus ``; gave up after K
    restart(s)`` with restarts) when a worker raises or dies in the last attempt, and for
    ``nproc < 1`` or a negative ``max_restarts``.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not isinstance(nproc, int) or nproc < 1:
        raise NxdError(f"nproc must be a positive integer, got {nproc!r}")
    if max_restarts < 0:
        raise NxdError(f"max_restarts must be 0 or more, got {max_restarts}")
    with tempfile.TemporaryDirectory(prefix="nxd-launch-") as log_dir:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=str(uuid.uuid4()),
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            rdzv_configs={"timeout": rdzv_timeout_s},
            max_restarts=max_restarts,
            monitor_interval=0.05,
            start_method=start_method,
            local_addr="127.0.0.1",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        shared = os.environ.get(SHARE_STORE_ENV)
        os.environ[SHARE_STORE_ENV] = "1"  # each attempt's rank 0 hosts a fresh store (see _attempt_store)
        one_line = _RepeatedFailuresOneLine()
        logging.getLogger(ELASTIC_PROCS_LOGGER).addFilter(one_line)
        try:
            results = elastic_launch(config, _RootCauseFirst(fn))(*args)
        except ChildFailedError as e:
            raise NxdError(_failure_line(e, log_dir, max_restarts)) from None
        finally:
            logging.getLogger(ELASTIC_PROCS_LOGGER).removeFilter(one_line)
            if shared is None:
                os.environ.pop(SHARE_STORE_ENV, None)
            else:
                os.environ[SHARE_STORE_ENV] = shared
    return [results[r] for r in range(nproc)]

"""The training loop's device runtime (:class:`StepRuntime`): eager devices (cpu, cuda, a
PrivateUse1 backend such as TorchNeuron's ``neuron``: :mod:`nxd_finetune.device`) and XLA
devices, i.e. Trainium through torch-neuronx or any torch_xla device (``PJRT_DEVICE=CPU`` gives a
real XLA device on CPU, used by ``make test-xla``).

``torch_xla`` is imported only when a run is on xla. Model code never imports this module; the
trainer calls the small hooks of :class:`StepRuntime`, so one loop serves eager and lazy devices:
:class:`StepRuntime` (eager devices: batches moved as they are used, values read at once) and
:class:`XlaRuntime` (lazy tensors: one ``torch_xla.sync()`` -- ``xm.mark_step`` -- per optimizer
step, host-to-device copies prefetched on a thread, values read in step closures after the step's
graph ran, state moved to CPU in one batched transfer before a checkpoint is written,
compiled / launched graph counts recorded per step). Neuron's environment is in
:mod:`nxd_finetune.neuron`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar, cast

import torch

from nxd_finetune.device import require_torch_xla, synchronize
from nxd_finetune.errors import NxdError

if TYPE_CHECKING:
    from nxd_finetune.sft.engine import Engine

log = logging.getLogger(__name__)

ItemT = TypeVar("ItemT")
StateT = TypeVar("StateT")
TreeT = TypeVar("TreeT")
# host values handed to ``on_host``'s function: 0-d tensors as floats, larger ones as lists
HostValues = dict[str, float | list[float] | None]


# ---------------------------------------------------------------- device


def refuse_unformable_world(world_size: int) -> None:
    """Before joining the ``xla`` process group (``xla://``): refuse a launch of ``world_size``
    processes that this XLA device cannot join into one world, with one NxdError line, before
    torch_xla's rendezvous creates any store. torch_xla's CPU device (``PJRT_DEVICE=CPU``) gives
    every process a PJRT client of its own (``process_count() == 1``): each would take rank 0 of a
    world of 1 and start the rendezvous store on ``MASTER_PORT``, and the second to do so dies
    with ``EADDRINUSE``. Only the CPU device is judged here (other devices' clients learn their
    processes in the rendezvous itself; :func:`~nxd_finetune.parallel.launch.init_distributed`
    compares the world size after joining)."""
    from torch_xla import runtime as xr

    processes = xr.process_count()
    if world_size > 1 and xr.device_type() == "CPU" and processes < world_size:
        raise NxdError(f"the xla process group has {processes} process(es) but WORLD_SIZE={world_size}: this "
                       f"device cannot form a {world_size}-process world (torch_xla's CPU device runs 1 process)")


# ---------------------------------------------------------------- device loader


def _move(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:  # any nesting of containers
    """``obj`` (tensors in dicts / lists / tuples, other values as they are) with ``fn`` applied to
    every tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _move(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, fn) for v in obj)
    return obj


_END = object()


class DeviceLoader(Generic[ItemT, StateT]):
    """Iterates ``source`` and yields each item with its tensors moved by ``transfer``.

    With ``prefetch > 0`` a background thread draws up to ``prefetch`` items ahead and copies them,
    so host-to-device copies overlap the running step (what ``MpDeviceLoader`` does for XLA). A
    resumable run must not save the prefetched position: ``snapshot`` (e.g. the data loader's
    ``state_dict``) is called right after each item is drawn, and :meth:`state_dict` returns the
    snapshot of the last item handed out; :meth:`load_state_dict` hands a saved one to ``restore``
    (the data loader's ``load_state_dict``) before the first item is drawn. So the object can stand
    where a checkpoint expects the resumable loader. ``source`` is iterated lazily (a generator
    over the data loader starts at the first item). An exception in ``source`` is raised in the
    consumer; :meth:`close` stops the thread (also at the end of a ``with`` block).
    """

    def __init__(self, source: Iterable[ItemT], transfer: Callable[[ItemT], ItemT], prefetch: int = 0,
                 snapshot: Callable[[], StateT] | None = None,
                 restore: Callable[[StateT], None] | None = None) -> None:
        self._source_iterable = source
        self._source: Iterator[ItemT] | None = None
        self._transfer, self._snapshot, self._restore = transfer, snapshot, restore
        self._state: StateT | None = None
        self._started = False
        self._prefetch = prefetch
        self._queue: queue.Queue[tuple[object, StateT | None, BaseException | None]] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _draw(self) -> tuple[ItemT, StateT | None]:
        if self._source is None:
            self._source = iter(self._source_iterable)
        item = next(self._source)
        return item, (self._snapshot() if self._snapshot is not None else None)

    def _worker(self) -> None:
        assert self._queue is not None
        while not self._stop.is_set():
            try:
                item, state = self._draw()
                entry: tuple[object, StateT | None, BaseException | None] = (self._transfer(item), state, None)
            except StopIteration:
                entry = (_END, None, None)
            except BaseException as e:  # handed to the consumer
                entry = (_END, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(entry, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if entry[0] is _END:
                return

    def __iter__(self) -> Iterator[ItemT]:
        return self

    def __next__(self) -> ItemT:
        self._started = True
        if self._prefetch <= 0:
            item, state = self._draw()
            self._state = state
            return self._transfer(item)
        if self._queue is None:
            self._queue = queue.Queue(maxsize=self._prefetch)
            self._thread = threading.Thread(target=self._worker, name="nxd-device-loader", daemon=True)
            self._thread.start()
        entry, state, error = self._queue.get()
        if error is not None:
            raise error
        if entry is _END:
            raise StopIteration
        self._state = state
        return cast(ItemT, entry)  # not _END: an item of ``source``, transferred

    def state_dict(self) -> StateT:
        """``snapshot()`` as of the last item handed out (before any: the current ``snapshot()``)."""
        if self._snapshot is None:
            raise NxdError("DeviceLoader.state_dict: no snapshot function was given")
        if not self._started:
            return self._snapshot()
        return cast(StateT, self._state)  # snapshot() taken with the last item handed out

    def load_state_dict(self, state: StateT) -> None:
        """Restore the source's position (``restore(state)``); only before the first item."""
        if self._started:
            raise NxdError("DeviceLoader.load_state_dict: items were already drawn")
        if self._restore is None:
            raise NxdError("DeviceLoader.load_state_dict: no restore function was given")
        self._restore(state)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> DeviceLoader[ItemT, StateT]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- step runtimes


def _floats(values: Mapping[str, torch.Tensor | float | None]) -> HostValues:
    """0-d tensors -> float, larger ones -> lists, None stays None."""
    def _one(v: torch.Tensor | float | None) -> float | list[float] | None:
        if v is None:
            return None
        return v.tolist() if isinstance(v, torch.Tensor) and v.numel() > 1 else float(v)

    return {k: _one(v) for k, v in values.items()}


class RuntimeReport(TypedDict, total=False):
    """Device facts for the run summary (:meth:`StepRuntime.report`; XLA: graphs compiled /
    launched since the run's start, after each optimizer step)."""

    xla_compiles: list[int]
    xla_graphs: list[int]


class StepRuntime:
    """Device hooks of the training loop for eager devices (every device but xla).

    - :meth:`batches`: the step iterator with its tensors moved to the device as they are used;
    - :meth:`end_step`: called once after every optimizer step (nothing to do eagerly);
    - :meth:`on_host`: ``fn(values)`` with some tensors' values on the host (0-d -> float, else a
      list; None stays None), at once;
    - :meth:`to_cpu`: a state dict (nested) with every tensor on the CPU, for writing;
    - :meth:`report`: device-specific facts for the run summary ({} here).
    """

    lazy = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def batches(self, source: Iterable[ItemT], snapshot: Callable[[], StateT] | None = None,
                restore: Callable[[StateT], None] | None = None) -> DeviceLoader[ItemT, StateT]:
        """``source``'s items on the device (see :class:`DeviceLoader` for ``snapshot``/``restore``)."""
        return DeviceLoader(source, lambda x: _move(x, lambda t: t.to(self.device, non_blocking=True)), 0,
                            snapshot, restore)

    def prepare(self, engine: Engine) -> None:
        """Adjust a freshly built engine to the device (nothing to do eagerly)."""

    def end_step(self) -> None:
        pass

    def sync(self) -> None:
        """A graph boundary outside the optimizer step (eval batches); nothing to do eagerly."""

    def on_host(self, fn: Callable[[HostValues], None], values: Mapping[str, torch.Tensor | float | None]) -> None:
        fn(_floats(values))

    def to_cpu(self, obj: TreeT) -> TreeT:
        return _move(obj, lambda t: t if t.is_cpu else t.detach().cpu())

    def wait(self) -> None:
        """Block until the device has finished the queued work (for timings)."""
        synchronize(self.device)

    def report(self) -> RuntimeReport:
        return {}


class XlaRuntime(StepRuntime):
    """Device hooks for lazy XLA tensors.

    One ``torch_xla.sync()`` (``xm.mark_step``) per optimizer step cuts the traced step into one
    graph; batches are sent to the device ``prefetch`` steps ahead on a thread; :meth:`on_host`
    defers ``fn`` to a step closure, which runs after that step's graph has executed, so reading
    the loss adds no graph execution. After each step the cumulative number of compiled and
    launched graphs is recorded;
    a compilation of the step's graph after ``warmup_steps`` (a shape or control flow changed) is
    logged once.

    Counts come from torch_xla's counters, read on the host: ``UncachedCompile`` (graphs compiled)
    and ``UncachedCompile + CachedCompile`` (graphs launched, counted when launched; the execution
    metrics lag behind because execution is asynchronous). A host read of a pending value in the
    loop (``.item()``, ``print(loss)``) shows as a second graph in a step.
    """

    lazy = True

    def __init__(self, device: torch.device, prefetch: int = 2, warmup_steps: int = 2) -> None:
        super().__init__(device)
        require_torch_xla()
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met

        self._torch_xla, self._xm, self._met = torch_xla, xm, met
        self.prefetch, self.warmup_steps = prefetch, warmup_steps
        self.compiles: list[int] = []
        self.launches: list[int] = []
        self._warned = False
        self._base = (self.compile_count(), self.launch_count())  # counters are per process

    def _counter(self, name: str) -> int:
        return int(self._met.counter_value(name) or 0)

    def compile_count(self) -> int:
        """Graphs compiled so far in this process (the in-memory cache's misses)."""
        return self._counter("UncachedCompile")

    def launch_count(self) -> int:
        """Graphs launched so far in this process (compiled or found in the cache)."""
        return self._counter("UncachedCompile") + self._counter("CachedCompile")

    def _sync(self) -> None:
        sync = getattr(self._torch_xla, "sync", None)
        sync() if sync is not None else self._xm.mark_step()

    def batches(self, source: Iterable[ItemT], snapshot: Callable[[], StateT] | None = None,
                restore: Callable[[StateT], None] | None = None) -> DeviceLoader[ItemT, StateT]:
        return DeviceLoader(source, lambda x: self._xm.send_cpu_data_to_device(x, self.device),
                            self.prefetch, snapshot, restore)

    def prepare(self, engine: Engine) -> None:
        """Logits at every position (``Engine.full_logits``): the engine's targets-only path
        gathers positions with a data-dependent count (``nonzero``), which on XLA forces a mid-step
        execution and a new graph for every count; the loss is the same."""
        engine.full_logits = True

    def sync(self) -> None:
        self._sync()

    def end_step(self) -> None:
        before = self.compile_count()
        self._sync()
        self.compiles.append(self.compile_count() - self._base[0])
        self.launches.append(self.launch_count() - self._base[1])
        step = len(self.compiles)
        # only the step's own graph counts here: eval and checkpoints compile theirs at other syncs
        if step > self.warmup_steps and self.compiles[-1] + self._base[0] > before and not self._warned:
            self._warned = True
            log.warning("XLA compiled a new graph at step %d (%d graphs so far): a shape or a "
                        "Python-side branch changed; every change costs a compilation (see docs/trainium.md)",
                        step, self.compiles[-1])

    def on_host(self, fn: Callable[[HostValues], None], values: Mapping[str, torch.Tensor | float | None]) -> None:
        names = list(values)
        tensors = [values[k] for k in names]

        def closure(*materialised: torch.Tensor | float | None) -> None:
            cpu = self._xm._maybe_convert_to_cpu(list(materialised))
            fn(_floats(dict(zip(names, cpu, strict=True))))

        self._xm.add_step_closure(closure, args=tuple(tensors))

    def to_cpu(self, obj: TreeT) -> TreeT:
        """Flush pending work, then copy every XLA tensor of ``obj`` to the CPU in one transfer."""
        self._sync()
        return self._xm._maybe_convert_to_cpu(obj)

    def wait(self) -> None:
        self._xm.wait_device_ops()

    def report(self) -> RuntimeReport:
        """``xla_compiles`` / ``xla_graphs``: graphs compiled / launched since this runtime was created
        (the run's start: eval before training included), after each optimizer step."""
        return {"xla_compiles": list(self.compiles), "xla_graphs": list(self.launches)}


def make_runtime(device: torch.device, prefetch: int = 2) -> StepRuntime:
    """:class:`XlaRuntime` for an XLA device, else :class:`StepRuntime`."""
    if device.type == "xla":
        return XlaRuntime(device, prefetch=prefetch)
    return StepRuntime(device)

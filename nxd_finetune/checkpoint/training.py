"""What the training loop calls to checkpoint, resume and stop cleanly (``sft/trainer.py``).

::

    ckpt = TrainingCheckpoints(recipe, engine, out_dir, loader)   # loader: the batch source the loop draws from
    resumed = ckpt.resume(state)          # before the metrics writer opens; None: a fresh start
    ...                                   # each step, after logging and eval: ckpt.after_step(state, history)
    ckpt.finish(state, history)           # the end-of-run checkpoint; waits for async saves
    ckpt.close()                          # in a finally: signal handlers back

A checkpoint's ``extra`` holds everything besides tensors of parameters and optimizer state: the
counters (:class:`TrainState` fields), the LR scheduler, the data sampler's position, the RNG
states (torch's CPU and CUDA generators of *every* rank, Python's ``random`` of rank 0), the
logged history (with the eval before training), the size of ``metrics.jsonl`` at the save, and the
recipe. Resuming restores all of them, truncates ``metrics.jsonl`` back to that size (so no step
is logged twice) and hides TensorBoard events after the step (``purge_step``), so a run killed at
any point and resumed logs and trains exactly as an uninterrupted one.

SIGTERM / SIGINT: the handler only sets a flag; after the current step every rank agrees on it
(one all-reduce per step in multi-process runs), a checkpoint is saved and :class:`TrainingStopped`
is raised with a one-line message saying how to resume. A second SIGINT stops at once.

Fault injection for tests: ``NXD_FINETUNE_FAILPOINT=<point>:<step>`` makes the process SIGKILL
itself at ``point`` (``after-step``: after the optimizer step, before any save of that step;
``before-manifest``: a save's files are written, its manifest is not) of step ``step``; a
comma-separated list of them, each optionally limited to one global rank (``:rank=R``) and one
attempt of an elastic run (``:attempt=N``), see :func:`~nxd_finetune.checkpoint.manager.failpoint`.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from nxd_finetune.checkpoint.format import CheckpointError
from nxd_finetune.checkpoint.manager import CheckpointManager
from nxd_finetune.checkpoint.run_state import RngState, RunState, TrainState
from nxd_finetune.checkpoint.stored import CheckpointRef, delete_checkpoint, list_checkpoints
from nxd_finetune.checkpoint.writer import failpoint
from nxd_finetune.device import device_rng_state, set_device_rng_state
from nxd_finetune.metrics import METRICS_FILE, purge_tensorboard, truncate_metrics
from nxd_finetune.recipe.resume import (
    OPTIMIZER_KEYS,
    SCHEDULE_KEYS,
    RecipeChange,
    changed_keys,
    check_resume,
    describe_changes,
)

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup

    from nxd_finetune.parallel.state import ParallelState
    from nxd_finetune.recipe import Recipe, TrainingSection


class Resumable(Protocol):
    """What the loop draws its steps from, whose state checkpoints carry as their ``data`` record
    (the run's batch source, ``sft.source``: by default the train loader's position)."""

    def state_dict(self) -> dict[str, object] | None: ...

    def load_state_dict(self, state: dict[str, object]) -> None: ...


class Trained(Protocol):
    """What checkpoints save and restore of a rank (the trainer's ``sft.engine.Engine``)."""

    @property
    def state(self) -> ParallelState: ...

    @property
    def modules(self) -> list[nn.Module]: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR: ...

    @property
    def device(self) -> torch.device: ...


class TrainingStopped(Exception):
    """A stop signal ended training after a checkpoint; ``str(e)`` is the one line to print and
    ``exit_code`` the conventional ``128 + signal number``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


def as_training_stopped(err: BaseException, recipe: Recipe) -> TrainingStopped | None:
    """``err`` as a :class:`TrainingStopped` when it reports a stop signal, else None: the loop's own
    exception, or the elastic launcher's ``SignalException`` (``parallel.nproc > 1``: the launcher
    got the signal and passed it to its workers, which finished their step and saved)."""
    if isinstance(err, TrainingStopped):
        return err
    sigval = getattr(err, "sigval", None)
    if type(err).__name__ != "SignalException" or sigval is None:
        return None
    where = recipe.checkpoint.dir or str(Path(recipe.output.dir) / "checkpoints")
    return TrainingStopped(f"stopped by {signal.Signals(sigval).name}; the workers saved a checkpoint to {where} "
                           "after their current step. Resume: run the same command again (same recipe and "
                           "output.dir)", int(sigval))


class StopSignals:
    """SIGTERM / SIGINT handlers that ask the loop to stop after the current step.

    Installed only in the main thread (Python delivers signals there); :meth:`restore` puts the
    previous handlers back. A second SIGINT raises KeyboardInterrupt at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def agreed(self, state: ParallelState | None, group: ProcessGroup | None = None) -> int | None:
        """The signal number if any rank got one (collective over ``group`` -- the whole world, on
        CPU tensors: gloo; None: the default group -- when the world has several ranks; every
        rank must call it once per step)."""
        if state is None or state.world_size == 1:
            return self.signum
        flag = torch.tensor([self.signum or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item()) or None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


# ----------------------------------------------------------------------------- RNG


def rng_state(state: ParallelState | None = None, group: ProcessGroup | None = None,
              device: torch.device | None = None) -> RngState:
    """RNG states to resume exactly: torch's CPU generator and ``device``'s own
    (:func:`nxd_finetune.device.device_rng_state`: the device module's, XLA's seed; dropout masks
    there come from it, not from the CPU generator) of every rank, stacked ``[world, n]``
    (all-gathered over ``group``, the whole world on CPU tensors: gloo; None: the default group;
    collective in multi-process worlds), and Python's ``random``."""
    cpu = torch.get_rng_state()
    version, internal, gauss = random.getstate()
    out: RngState = {"torch_cpu": _gather_rows(cpu, state, group),
                     "python": {"version": version, "state": list(internal), "gauss": gauss}}
    dev = None if device is None else device_rng_state(device)  # the device module's generator
    if dev is not None and device is not None:
        rows = _gather_rows(dev, state, group)
        if device.type == "xla":
            out["xla"] = rows  # the key XLA checkpoints have always had
        else:
            out["devices"] = {device.type: rows}
    return out


def _gather_rows(t: torch.Tensor, state: ParallelState | None, group: ProcessGroup | None) -> torch.Tensor:
    if state is None or state.world_size == 1:
        return t.unsqueeze(0).clone()
    rows = [torch.empty_like(t) for _ in range(state.world_size)]
    dist.all_gather(rows, t, group=group)
    return torch.stack(rows)


def set_rng_state(saved: RngState, state: ParallelState | None = None, device: torch.device | None = None) -> None:
    """Restore :func:`rng_state`: this rank's row when the world size is the one saved, else
    row 0 (a resharded resume reproduces the data order, not every dropout mask)."""
    rank = state.rank if state is not None else 0

    def row(t: torch.Tensor) -> torch.Tensor:
        return t[rank] if t.shape[0] > rank and (state is None or t.shape[0] == state.world_size) else t[0]

    torch.set_rng_state(row(saved["torch_cpu"]).clone())
    devices = dict(saved.get("devices") or {})
    if "torch_cuda" in saved:  # written before the device layer (a CUDA run's generator)
        devices.setdefault("cuda", saved["torch_cuda"])
    if "xla" in saved:
        devices.setdefault("xla", saved["xla"])
    if device is not None and device.type in devices:
        set_device_rng_state(device, row(devices[device.type]))
    py = saved["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))


# ----------------------------------------------------------------------------- the loop's hooks


@dataclasses.dataclass
class Resumed:
    """What a resume brings back besides the live objects: the checkpoint, the logged history and
    the eval before training (for the summary)."""

    ref: CheckpointRef
    history: list[dict[str, float]]
    eval_before: dict[str, float]


def apply_training_changes(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR,
                           training: TrainingSection, changes: list[RecipeChange]) -> None:
    """After a resume restored ``optimizer`` and ``scheduler`` from a checkpoint (which carries the
    old lr, betas, eps and weight decay), give them the recipe's new values where it changed them;
    the LR of the next step is then the new schedule's at the resumed step. The decay group is the
    first one (``sft.engine``'s parameter groups); the others keep no weight decay."""
    if not changed_keys(changes, OPTIMIZER_KEYS + SCHEDULE_KEYS):
        return  # nothing to do: the restored values are the run's (an exact resume stays exact)
    groups = optimizer.param_groups
    for i, group in enumerate(groups):
        group["betas"], group["eps"] = tuple(training.betas), training.eps
        group["initial_lr"] = training.lr
        if i == 0:
            group["weight_decay"] = training.weight_decay
    scheduler.base_lrs = [training.lr for _ in groups]
    step = scheduler.last_epoch
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(step)
    scheduler._last_lr = [g["lr"] for g in groups]  # what get_last_lr() (logging) reports


class TrainingCheckpoints:
    """Checkpoints of one run from its recipe's ``checkpoint`` section.

    ``engine``: has ``state`` (ParallelState), ``modules``, ``optimizer`` and ``scheduler``
    (``sft.engine.Engine``); ``loader``: what the steps are drawn from (``state_dict`` /
    ``load_state_dict``): the run's batch source (``sft.source``; the default reports the train
    loader's position of the batches handed out, not of those prefetched), or a resumable loader
    itself; ``out_dir``: the run's output
    directory (metrics files, default ``checkpoint.dir = <out_dir>/checkpoints``). ``group``: the
    world's group for collectives on CPU tensors (``Engine.host.world``: gloo; None: the default
    group, which must then be gloo). The eval before training travels in the history (its
    step-0 record). ``reference``: the identity of the run's reference log-probs (preference
    tuning, set by the trainer), saved with every checkpoint; a resumed run reads it back first
    (:meth:`started_reference`). Installs the stop-signal handlers.
    """

    def __init__(self, recipe: Recipe, engine: Trained, out_dir: Path, loader: Resumable,
                 group: dist.ProcessGroup | None = None) -> None:
        ck = recipe.checkpoint
        self.recipe, self.engine, self.out_dir, self.loader = recipe, engine, Path(out_dir), loader
        self.group = group
        self.uri = ck.dir or str(self.out_dir / "checkpoints")
        self.every = ck.every_n_steps
        self.manager = CheckpointManager(self.uri, keep_last=ck.keep_last, async_save=getattr(ck, "async_save", False),
                                         state=engine.state, group=group)
        self.last_saved: int | None = None
        self.reference: dict[str, object] | None = None
        self._point: list[CheckpointRef | None] = []  # resolved once: [the checkpoint resumed from]
        self.signals = StopSignals()

    @property
    def _rank0(self) -> bool:
        return self.engine.state.rank == 0

    def resume(self, train_state: TrainState) -> Resumed | None:
        """Load ``checkpoint.resume`` (``latest``: the newest complete one, if any) into the engine,
        the loader, ``train_state`` and the RNG, and cut the metrics files back to it. Call before
        the metrics writer opens. Checkpoints of ``checkpoint.dir`` that the run will not continue
        from are deleted, so they can neither be resumed later nor crowd out new ones under
        ``keep_last``: all of them on a fresh start, those after the resumed step otherwise.
        Collective."""
        ref = self.resume_point()
        if ref is None:
            if self._rank0:
                truncate_metrics(self.out_dir, None)
                self._remove_after(-1, "starting fresh")
            self._barrier()
            return None
        e = self.engine
        saved_recipe = self.manager.read_extra_json(ref).get("recipe")
        changes = check_resume(saved_recipe, self.recipe, ref.uri, ref.step) if isinstance(saved_recipe, str) else []
        extra = self.manager.load(ref, e.modules, e.optimizer)
        saved = RunState.from_extra(extra)
        e.scheduler.load_state_dict(saved.scheduler or {})
        apply_training_changes(e.optimizer, e.scheduler, self.recipe.training, changes)
        if saved.data is None:
            raise CheckpointError(f"{ref.uri}: the checkpoint holds no data position to resume from")
        self.loader.load_state_dict(saved.data)
        train_state.restore(saved.train_state)
        set_rng_state(saved.rng, e.state, e.device)
        if self._rank0:
            truncate_metrics(self.out_dir, saved.metrics_bytes)
            if self.recipe.logging.tensorboard:
                purge_tensorboard(self.out_dir, ref.step)
            self._remove_after(ref.step, f"resuming from step {ref.step}")
            print(f"resumed from {ref.uri} (step {ref.step})", flush=True)
            line = describe_changes(changes, ref.step)
            if line:
                print(line, flush=True)
        self._barrier()
        if ref.uri == f"{self.manager.uri}/step-{ref.step:08d}":
            self.last_saved = ref.step  # already in checkpoint.dir: the end of a finished run is not saved twice
        before = extra.get("eval_before")  # where checkpoints of earlier versions kept it
        return Resumed(ref, saved.history, saved.eval_before() or (before if isinstance(before, dict) else {}))

    def resume_point(self) -> CheckpointRef | None:
        """The checkpoint :meth:`resume` continues from (``checkpoint.resume`` resolved and verified
        once), None for a fresh start. Collective."""
        if not self._point:
            self._point.append(self.manager.resolve(self.recipe.checkpoint.resume))
        return self._point[0]

    def started_reference(self) -> dict[str, object] | None:
        """The reference identity the checkpoint to resume from records (:attr:`reference` of the
        run that saved it), read before any tensor; None on a fresh start or where it records none
        (no reference, or a checkpoint written before they were recorded). Collective."""
        ref = self.resume_point()
        if ref is None:
            return None
        reference = self.manager.read_extra_json(ref).get("reference")
        return dict(reference) if isinstance(reference, dict) else None

    def _remove_after(self, step: int, why: str) -> None:
        later = [s for s, _ in list_checkpoints(self.manager.storage) if s > step]
        if later:
            print(f"{why}: removing checkpoint(s) {later} from {self.uri}", flush=True)
        for s in later:
            delete_checkpoint(self.manager.storage, s)

    def _barrier(self) -> None:
        if self.engine.state.world_size > 1:
            dist.barrier(group=self.group)

    def save(self, train_state: TrainState, history: list[dict[str, float]]) -> str:
        """Checkpoint the run at ``train_state.step`` (collective)."""
        e, step = self.engine, train_state.step
        metrics = self.out_dir / METRICS_FILE
        saved = RunState(train_state=train_state, rng=rng_state(e.state, self.group, e.device), history=history,
                         scheduler=e.scheduler.state_dict(), data=self.loader.state_dict(),
                         metrics_bytes=metrics.stat().st_size if metrics.exists() else 0, recipe=self.recipe.to_yaml(),
                         reference=self.reference)
        uri = self.manager.save(step, e.modules, e.optimizer, saved.to_extra())
        self.last_saved = step
        return uri

    def after_step(self, train_state: TrainState, history: list[dict[str, float]]) -> None:
        """After a step's logging and eval: save every ``checkpoint.every_n_steps``; on a stop
        signal save and raise :class:`TrainingStopped`. Collective."""
        step = train_state.step
        failpoint("after-step", step)
        signum = self.signals.agreed(self.engine.state, self.group)
        if signum or (self.every and step % self.every == 0):
            self.save(train_state, history)
        if signum:
            self.manager.wait()
            self.signals.restore()
            name = signal.Signals(signum).name
            raise TrainingStopped(
                f"stopped by {name} after step {step}; checkpoint saved to {self.uri}. Resume: run the same "
                f"command again (same recipe and output.dir), or add --resume {self.uri}/step-{step:08d}", signum)

    def finish(self, train_state: TrainState, history: list[dict[str, float]]) -> None:
        """The end-of-run checkpoint (unless this step is saved already); waits for async saves.
        Collective."""
        if self.last_saved != train_state.step:
            self.save(train_state, history)
        self.manager.wait()

    def close(self) -> None:
        """Restore the signal handlers; an in-flight async save finishes (call in a ``finally``)."""
        self.signals.restore()
        try:
            self.manager.wait()
        except CheckpointError as err:
            print(f"error: {err}", flush=True)

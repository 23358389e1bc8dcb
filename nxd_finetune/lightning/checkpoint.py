"""Lightning checkpoints in nxd-finetune's format, readable by ``nxd-finetune run`` and back.

What :class:`~nxd_finetune.lightning.strategy.NxdStrategy` writes for ``Trainer.save_checkpoint(path)``
or a ``ModelCheckpoint`` is exactly what ``run`` writes (:class:`~nxd_finetune.checkpoint.manager.CheckpointManager`:
the trainable parameters and optimizer state, layout-free, ZeRO-1 shards consolidated) with the
``extra`` keys ``run`` resumes from (train counters, LR scheduler, data position, RNG states of
every rank, logged history, recipe); Lightning's own trainer state (epoch, callbacks) rides along
under ``extra["lightning"]`` where it is storable. So a Lightning run resumes from a checkpoint of
``run`` (``Trainer.fit(ckpt_path=".../checkpoints/step-00000010")``) and ``run`` from one of a
Lightning run (``checkpoint.resume=<path>``), in any tp / dp / ZeRO-1 layout.

Where ``path`` puts it: a path whose name is a step directory (``step-00000010``, as
:class:`NxdModelCheckpoint` names them, and as ``run`` writes them) is that checkpoint, its parent
the checkpoint root; any other path is a checkpoint root under which ``step-<N>`` is written.
Loading takes either: a checkpoint, or a root (its newest complete checkpoint).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from nxd_finetune.checkpoint.format import MANIFEST, CheckpointError, encode_extra, parse_step_dir
from nxd_finetune.checkpoint.manager import CheckpointManager
from nxd_finetune.checkpoint.run_state import RunState
from nxd_finetune.checkpoint.training import rng_state, set_rng_state
from nxd_finetune.errors import NxdError
from nxd_finetune.parallel.state import ParallelState

if TYPE_CHECKING:
    from nxd_finetune.lightning.base import NxdModuleBase

KEEP_ALL = 1 << 30  # retention is Lightning's (ModelCheckpoint's save_top_k), not the manager's


class NxdModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` naming checkpoints as ``run`` does: ``<dirpath>/step-00000010`` (a
    directory, no ``.ckpt``), so ``nxd-finetune run`` with ``checkpoint.dir=<dirpath>`` and
    ``checkpoint.resume=latest`` continues from the newest. Defaults: keep every checkpoint
    (``save_top_k=-1``); pass ``every_n_train_steps`` as usual."""

    FILE_EXTENSION = ""

    def __init__(self, dirpath: str | os.PathLike, **kwargs: Any) -> None:
        kwargs.setdefault("save_top_k", -1)
        super().__init__(dirpath=Path(dirpath), filename="step-{step:08d}", auto_insert_metric_name=False, **kwargs)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any,
                           **kwargs: Any) -> None:
        """Lightning's, without its warning that under manual optimization (every nxd module) the
        checkpoint holds the state *after* the optimizer step, with sample code to save the state
        before it: after the step is what a checkpoint of step N is here, as ``run`` writes it."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization",
                                    category=UserWarning)
            super().on_train_batch_end(trainer, pl_module, *args, **kwargs)


def _root_and_step_name(filepath: str | os.PathLike) -> tuple[str, str | None]:
    text = os.fspath(filepath).rstrip("/")
    name = text.rsplit("/", 1)[-1]
    if parse_step_dir(name) is not None:
        return text[: -len(name)].rstrip("/") or ".", name
    return text, None


def _storable(value: Any) -> Any:
    """``value`` if ``extra`` can hold it (JSON-able and tensors), else None."""
    try:
        encode_extra({"v": value})
    except CheckpointError:
        return None
    return value


def save(module: NxdModuleBase, checkpoint: dict[str, Any], filepath: str | os.PathLike,
         state: ParallelState | None, group: dist.ProcessGroup | None) -> str:
    """Write the checkpoint of ``module``'s current step under ``filepath`` (see the module
    docstring); returns its URI. Collective."""
    step = module.train_state.step
    root, name = _root_and_step_name(filepath)
    if name is not None and parse_step_dir(name) != step:
        raise NxdError(f"checkpoint path {filepath} names step {parse_step_dir(name)}, the run is at step {step}")
    lightning_state = {k: _storable(checkpoint.get(k)) for k in ("epoch", "global_step", "callbacks")}
    saved = module.run_state(rng_state(module.parallel_state, group, module.trainer.strategy.root_device))
    saved.lightning = lightning_state
    manager = CheckpointManager(root, keep_last=KEEP_ALL, state=state, group=group)
    return manager.save(step, module.rank_modules, module.parallel_optimizer, saved.to_extra())


def load(module: NxdModuleBase, path: str | os.PathLike, state: ParallelState | None,
         group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Restore ``module`` (parameters, optimizer, data position, counters, history, RNG) and the
    trainer's step counter from the checkpoint at ``path`` (or the newest under a root); returns
    the Lightning checkpoint dict for what Lightning restores itself (LR scheduler, callbacks).
    Collective. CheckpointError when there is none or it is corrupt."""
    text = os.fspath(path).rstrip("/")
    local = "://" not in text
    is_root = local and Path(text).is_dir() and not (Path(text) / MANIFEST).exists()
    root = text if is_root else (_root_and_step_name(text)[0] if local else text.rsplit("/", 1)[0])
    manager = CheckpointManager(root, keep_last=KEEP_ALL, state=state, group=group)
    ref = manager.resolve("latest" if is_root else text)
    if ref is None:
        raise CheckpointError(f"no complete checkpoint under {text}")
    saved = RunState.from_extra(manager.load(ref, module.rank_modules, module.parallel_optimizer))
    module.restore_run_state(saved)
    set_rng_state(saved.rng, module.parallel_state, module.trainer.strategy.root_device)
    step = saved.train_state.step
    trainer = module.trainer
    loop = trainer.fit_loop.epoch_loop
    loop.manual_optimization.optim_step_progress.total.ready = step
    loop.manual_optimization.optim_step_progress.total.completed = step
    loop._batches_that_stepped = step
    lightning = saved.lightning or {}
    out: dict[str, Any] = {"pytorch-lightning_version": pl.__version__, "state_dict": {}, "optimizer_states": [],
                           "lr_schedulers": [saved.scheduler] if saved.scheduler else [],
                           "epoch": lightning.get("epoch") or 0,
                           "global_step": step}
    if lightning.get("callbacks"):
        out["callbacks"] = lightning["callbacks"]
    if module.is_logger:
        print(f"resumed from {ref.uri} (step {step})", flush=True)
    return out

"""``NxdStrategy``: nxd-finetune's parallel layouts under a Lightning ``Trainer``.

A ``DDPStrategy`` in how processes start and join (``Trainer(devices=N)`` on one machine, its
launchers: ``start_method="popen"`` re-runs the script, ``"fork"`` / ``"spawn"``; ``torchrun`` and
other external launchers are detected by Lightning as usual; gloo on CPU, nccl on CUDA). What it
changes:

- after the default group exists it builds the layout's groups (``ParallelState``: tp x pp x dp,
  with its host groups for CPU tensors); one process makes no
  process group at all, as ``nxd-finetune run`` at ``nproc=1``;
- the model is not wrapped in ``DistributedDataParallel``: the module's
  :class:`~nxd_finetune.parallel.optimizer.ParallelOptimizer` sums the TP-replicated gradients,
  sums the data-parallel gradients (or reduces them into the ZeRO-1 shards) and clips, as ``run``;
- checkpoints are nxd-finetune's reshardable format (:mod:`nxd_finetune.checkpoint`) written by
  Lightning's checkpoint hooks (:meth:`save_checkpoint` / :meth:`load_checkpoint`: ``Trainer.save_checkpoint``,
  ``ModelCheckpoint``, ``fit(ckpt_path=...)``), see :mod:`nxd_finetune.lightning.checkpoint`;
- precision is an :class:`~nxd_finetune.lightning.precision.NxdPrecision` (``Trainer(precision=...)``
  is converted).

Pipeline parallel is not supported under Lightning (NxdError): the pipeline schedule runs the
forward *and* backward of all micro-batches itself (:class:`~nxd_finetune.parallel.pipeline.PipelineRunner`),
so ``training_step`` could not hand the loss to ``manual_backward`` or the precision plugin;
``nxd-finetune run`` or the NxD-style API train pipeline layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import shutil
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from nxd_finetune.api import NxDConfig, neuronx_distributed_config
from nxd_finetune.errors import NxdError
from nxd_finetune.lightning import checkpoint as nxd_checkpoint
from nxd_finetune.lightning.base import NxdModuleBase
from nxd_finetune.lightning.precision import NxdPrecision
from nxd_finetune.parallel.state import Layout, ParallelState

if TYPE_CHECKING:
    import lightning.pytorch as pl

T = TypeVar("T")


class NxdStrategy(DDPStrategy):
    """Tensor parallel, data parallel and ZeRO-1 for an
    :class:`~nxd_finetune.lightning.module.NxdLightningModule` (NxD Training's ``NeuronXLAStrategy``).

    ``tensor_parallel_size`` / ``pipeline_parallel_size`` / ``zero1``, or ``nxd_config``: a dict of
    :func:`~nxd_finetune.api.neuronx_distributed_config`'s keyword arguments (or an
    :class:`~nxd_finetune.api.NxDConfig`), built into :attr:`nxd_config` once the processes are up
    (what :class:`~nxd_finetune.lightning.model_fn.NxdModelModule` builds on); the data-parallel size is
    ``devices * num_nodes / (tp * pp)``. ``start_method`` and the other keyword arguments are
    ``DDPStrategy``'s. NxdError for ``pipeline_parallel_size > 1`` (see the module docstring) and
    for non-positive sizes."""

    strategy_name = "nxd"

    def __init__(self, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, zero1: bool = False,
                 nxd_config: Mapping[str, object] | NxDConfig | None = None, sequence_parallel: bool | None = None,
                 **kwargs: Any) -> None:
        self._nxd_kwargs = _config_kwargs(nxd_config) if nxd_config is not None else None
        if self._nxd_kwargs is not None:
            tensor_parallel_size = int(self._nxd_kwargs.get("tensor_parallel_size", 1))
            pipeline_parallel_size = int(self._nxd_kwargs.get("pipeline_parallel_size", 1))
            zero1 = bool((self._nxd_kwargs.get("optimizer_config") or {}).get("zero_one_enabled", False))
            sequence_parallel = bool(self._nxd_kwargs.get("sequence_parallel", False))
        if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
            raise NxdError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got "
                           f"{tensor_parallel_size} and {pipeline_parallel_size}")
        if pipeline_parallel_size > 1:
            raise NxdError("pipeline_parallel_size > 1 is not supported under Lightning: the pipeline schedule runs "
                           "forward and backward itself; train pipeline layouts with `nxd-finetune run` "
                           "(parallel.pp) or the NxD-style API")
        super().__init__(**kwargs)
        self.tensor_parallel_size = tensor_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.zero1 = zero1
        self.sequence_parallel = sequence_parallel
        self.parallel_state: ParallelState | None = None
        self.nxd_config: NxDConfig | None = None  # built from nxd_config once the processes are up

    # ------------------------------------------------------------------ processes and groups

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    def _configure_launcher(self) -> None:
        """Lightning calls it once the devices are known, before any process starts."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if self.world_size % (tp * pp):
            raise NxdError(f"{self.world_size} process(es) are not divisible by tp*pp = {tp}*{pp}")
        if self.world_size == 1 and not self.cluster_environment.creates_processes_externally:  # type: ignore[union-attr]
            self._launcher = None  # one process: train here, as `run` at nproc=1
            return
        super()._configure_launcher()

    def setup_distributed(self) -> None:
        """The default group (none for one process), then the layout's groups (collective)."""
        if self.world_size > 1:
            super().setup_distributed()
        else:
            self.set_world_ranks()
        world, tp, pp = self.world_size, self.tensor_parallel_size, self.pipeline_parallel_size
        if self._nxd_kwargs is not None:
            self.nxd_config = neuronx_distributed_config(**self._nxd_kwargs)
            self.parallel_state = self.nxd_config.state
        else:
            self.parallel_state = ParallelState(Layout.for_world(world, tp=tp, pp=pp))

    @property
    def _host_world(self) -> torch.distributed.ProcessGroup | None:
        """The world's host group (None: the default group, or no process group at all)."""
        return self.parallel_state.host_group() if self.parallel_state is not None else None

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Plain ``DataLoader`` s are split over the data-parallel ranks (TP ranks see the same data)."""
        st = self.parallel_state
        return {"num_replicas": st.size("dp"), "rank": st.coord("dp")} if st else {"num_replicas": 1, "rank": 0}

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=self._host_world)

    def broadcast(self, obj: T, src: int = 0) -> T:
        if self.world_size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=self._host_world)
        return box[0]

    # ------------------------------------------------------------------ model and optimizer

    def setup(self, trainer: pl.Trainer) -> None:
        """No DDP wrapper: the optimizer does the gradient reductions (module docstring)."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        plugin = self.precision_plugin
        assert isinstance(plugin, NxdPrecision)
        plugin.device_type = self.root_device.type
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Nothing: the assembly builds on the meta device and loads this rank's slices itself."""
        yield

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else NxdPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        devices = getattr(self, "_parallel_devices", None)
        device_type = devices[0].type if devices else "cpu"
        self._precision_plugin = None if plugin is None else NxdPrecision.from_lightning(plugin, device_type)

    @property
    def nxd_precision(self) -> str:
        plugin = self.precision_plugin
        assert isinstance(plugin, NxdPrecision)
        return plugin.nxd_precision

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the optimizer (ZeRO-1 shards) must exist: the load restores it in place

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored it already

    def lightning_module_state_dict(self) -> dict[str, torch.Tensor]:
        return {}  # the weights are written from the live modules by save_checkpoint

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, object], strict: bool = True) -> None:
        pass  # done by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, object]) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike,
                        storage_options: object = None) -> None:
        """Write nxd-finetune's checkpoint (collective: every rank calls it, as Lightning does). See
        :func:`nxd_finetune.lightning.checkpoint.save` for where ``filepath`` puts it."""
        nxd_checkpoint.save(self._nxd_module(), checkpoint, filepath, self.parallel_state, self._host_world)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load nxd-finetune's checkpoint (one written by this strategy or by ``nxd-finetune run``,
        in any layout) into the live modules and optimizer; returns what Lightning restores next."""
        return nxd_checkpoint.load(self._nxd_module(), checkpoint_path, self.parallel_state, self._host_world)

    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        if self.is_global_zero and Path(filepath).exists():
            shutil.rmtree(filepath) if Path(filepath).is_dir() else os.remove(filepath)

    def _nxd_module(self) -> NxdModuleBase:
        module = self.lightning_module
        if not isinstance(module, NxdModuleBase):
            raise NxdError(f"NxdStrategy trains an NxdLightningModule or NxdModelModule, not a {type(module).__name__}")
        return module


def _config_kwargs(config: Mapping[str, object] | NxDConfig) -> dict[str, Any]:
    """``neuronx_distributed_config``'s keyword arguments from a dict of them or from an
    :class:`NxDConfig` built before the processes existed (its groups are rebuilt)."""
    if isinstance(config, NxDConfig):
        built = {"state", "device", "model"}
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in built}
    known = set(inspect.signature(neuronx_distributed_config).parameters)
    unknown = sorted(set(config) - known)
    if unknown:
        raise NxdError(f"nxd_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return dict(config)

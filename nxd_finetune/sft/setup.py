"""One rank's setup from a recipe, the same for ``run``, ``eval`` and the Lightning module.

:func:`setup_rank` builds, in order: the device and the process groups (or takes the caller's:
Lightning's strategy makes its own), the device runtime hooks (:mod:`nxd_finetune.runtime`), the
model directory and tokenizer, this data-parallel rank's loaders, the step count, and the
:class:`~nxd_finetune.sft.engine.Engine` (model, optimizer, schedule), and the run's objective
(handed to each step and eval call). It returns them as one :class:`RankRun`. Rank 0 fills the
caches (model, tokenized data) before the others read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nxd_finetune.checkpoint.training import TrainingCheckpoints
from nxd_finetune.data.datasets import DataSpec
from nxd_finetune.data.inputs import load_tokenizer, resolve_model_dir
from nxd_finetune.data.loader import DataLoaders, build_dataloaders
from nxd_finetune.device import device_for
from nxd_finetune.neuron import apply_neuron_env
from nxd_finetune.objective import SFT, Objective
from nxd_finetune.objectives import objective_of, objective_record
from nxd_finetune.parallel.launch import group_backend, in_launched_env, init_distributed
from nxd_finetune.parallel.state import Layout, ParallelState
from nxd_finetune.runtime import StepRuntime, make_runtime
from nxd_finetune.sft.engine import Engine, build_engine
from nxd_finetune.sft.source import BatchSource, LoaderSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.recipe import Recipe


@dataclasses.dataclass
class RankRun:
    """Everything one process of a run holds (see the module docstring)."""

    recipe: Recipe
    device: torch.device
    layout: ParallelState
    runtime: StepRuntime
    model_dir: Path
    tokenizer: PreTrainedTokenizerBase
    data: DataLoaders
    grad_accum: int
    total_steps: int
    engine: Engine
    objective: Objective = SFT
    """What the run's steps and evals compute (:func:`objective_of` the recipe), handed to each call."""
    source: BatchSource | None = None
    """Where the optimizer steps come from (:mod:`nxd_finetune.sft.source`; by default the train
    loader's micro-batches grouped into steps, on the device, lazy: nothing is drawn before a resume
    restores its state); with ``setup_rank(checkpoints=True)`` or a ``source`` factory."""
    checkpoints: TrainingCheckpoints | None = None
    """The run's checkpoints (save, resume, stop signals), over :attr:`source`'s state; with
    ``setup_rank(checkpoints=True)``."""

    @property
    def rank(self) -> int:
        return self.layout.rank


SourceFactory = Callable[[RankRun], BatchSource]
"""How a run gets a batch source other than the loader's: called once per rank after its setup."""


def loader_source(rr: RankRun) -> LoaderSource:
    """The default :class:`~nxd_finetune.sft.source.LoaderSource` of a rank: its train loader,
    ``grad_accum`` micro-batches per step, through its runtime."""
    return LoaderSource(rr.data.train, rr.grad_accum, rr.recipe.data.packing, rr.runtime)


def objective_source(recipe: Recipe) -> SourceFactory | None:
    """The batch source factory the recipe's objective names (its record's ``source``; GRPO's), or None."""
    path = objective_record(recipe.objective).source
    if path is None:
        return None
    module, _, name = path.partition(":")
    factory: SourceFactory = getattr(importlib.import_module(module), name)
    return factory


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """The device of ``training.device`` for this process (:func:`nxd_finetune.device.device_for`:
    ``auto`` -> the current accelerator, else xla where torch_neuronx imports, else cpu)."""
    return device_for(name, local_rank)


@contextlib.contextmanager
def rank0_first(rank: int, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Rank 0 runs the block first (filling caches), the others after it. ``group``: the world's
    host group (gloo; the xla backend's own barrier returns at once)."""
    initialised = dist.is_available() and dist.is_initialized()
    if initialised and rank != 0:
        dist.barrier(group=group)
    yield
    if initialised and rank == 0:
        dist.barrier(group=group)


def share_cores() -> None:
    """Split this machine's cores between the processes of the run on it (as ``torchrun`` does
    with ``OMP_NUM_THREADS``), unless the user set ``OMP_NUM_THREADS``: 2 ranks each running
    torch's default of every core oversubscribe the CPU (slower, and more malloc arenas)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local > 1 and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // local))


def total_steps_of(recipe: Recipe, batches_per_epoch: int) -> int:
    """``training.max_steps``, or the optimizer steps of ``training.epochs`` epochs."""
    t = recipe.training
    if t.max_steps:
        return t.max_steps
    return max(1, math.ceil((t.epochs or 1.0) * batches_per_epoch / recipe.grad_accum_steps))


def setup_rank(recipe: Recipe, *, device: torch.device | None = None, layout: ParallelState | None = None,
               objective: Objective | None = None,
               write_recipe: bool = True, checkpoints: bool = False,
               source: SourceFactory | None = None) -> RankRun:
    """This process's :class:`RankRun`. ``objective``: the recipe's (:func:`objective_of`) unless
    given. ``source``: makes the run's batch source (:func:`loader_source` when None), built with
    ``checkpoints=True`` or when given. Without ``device`` / ``layout`` the Neuron
    environment is applied, the device picked (``training.device``) and the process group
    initialised from the launcher's environment (world size 1 included). ``write_recipe``: rank 0
    writes ``<output.dir>/recipe.yaml``. Collective."""
    par = recipe.parallel
    if device is None:
        apply_neuron_env(recipe)  # Trainium only; before the first XLA tensor
        device = pick_device(recipe.training.device, int(os.environ.get("LOCAL_RANK", "0")))
    if layout is None:
        world = int(os.environ["WORLD_SIZE"]) if in_launched_env() else 1
        backend = init_distributed(group_backend(device.type, world))
        layout = ParallelState(Layout.for_world(backend.world_size, tp=par.tp, pp=par.pp, ep=par.ep))
    runtime = make_runtime(device)  # the loop's device hooks (nxd_finetune.runtime)
    if write_recipe and layout.rank == 0:
        out_dir = Path(recipe.output.dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "recipe.yaml").write_text(recipe.to_yaml())
    # Host work of every device (all of it on cpu): Adam's second moments and tiny gradients reach
    # subnormal floats, which x86 CPUs handle ~100x slower; flushing them to zero changes no result
    # at the loss's precision. The ranks on this machine share its cores.
    torch.set_flush_denormal(True)
    share_cores()
    tcfg = recipe.training
    with rank0_first(layout.rank, layout.host_group()):
        model_dir = resolve_model_dir(recipe.model.path)
        tokenizer = load_tokenizer(recipe, model_dir)
        data = build_dataloaders(DataSpec.from_recipe(recipe), tokenizer, micro_batch_size=tcfg.micro_batch_size,
                                 dp_rank=layout.coord("dp"), dp_world=par.dp, seed=tcfg.seed,
                                 fixed_shape=par.pp > 1 or par.sequence_parallel or runtime.lazy)
    total_steps = total_steps_of(recipe, data.train.batches_per_epoch)
    engine = build_engine(recipe, model_dir, device, total_steps, layout)
    runtime.prepare(engine)
    rr = RankRun(recipe, device, layout, runtime, model_dir, tokenizer, data, recipe.grad_accum_steps,
                   total_steps, engine, objective if objective is not None else objective_of(recipe))
    if checkpoints or source is not None:
        rr.source = (source or objective_source(recipe) or loader_source)(rr)
    if checkpoints:
        assert rr.source is not None
        # checkpoints record the source's state as of the steps handed out (not of those prefetched)
        rr.checkpoints = TrainingCheckpoints(recipe, engine, Path(recipe.output.dir), rr.source,
                                             group=layout.host_group())
    return rr

"""The NxD-style programmatic API: a config, a model initialiser and an optimizer wrapper.

Names and shapes follow NeuronX Distributed Training (``neuronx_distributed_config``,
``initialize_parallel_model``, ``initialize_parallel_optimizer``), so NxD scripts port with few
changes. Example (one script, run by ``torchrun --nproc-per-node 4`` or through
:func:`nxd_finetune.parallel.launch.launch`)::

    import torch
    from nxd_finetune.lora import LoraConfig
    from nxd_finetune.models import DecoderConfig, build_model
    from nxd_finetune.api import (
        initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config)
    from nxd_finetune.parallel.launch import init_distributed

    init_distributed()                       # the accelerator's backend (nccl on CUDA), else gloo; no-op in one process
    config = neuronx_distributed_config(
        tensor_parallel_size=2,
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        model_init_config={"meta_device_init": True, "checkpoint": "/models/llama3-8b"},
    )
    model = initialize_parallel_model(config, build_model, DecoderConfig.from_hf("/models/llama3-8b"))
    optimizer = initialize_parallel_optimizer(
        config, torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for batch in loader:                     # this dp rank's batches (config.state.coord("dp") / dp_size)
        loss = loss_fn(model(batch["input_ids"]), batch["labels"])
        loss.backward()
        optimizer.step()                     # tp grad sync, dp reduction, clipping, step
        optimizer.zero_grad(set_to_none=True)

With ``pipeline_parallel_size > 1`` the model is a :class:`PipelineModel` (NxD's ``NxDPPModel``):
this rank's stages, trained by ``loss = model.run_train(micro_batches)`` (forward and backward of
one optimizer step through the schedule; ``pipeline_config``: ``num_microbatches``, ``schedule``
``1f1b`` / ``interleaved_1f1b`` / ``gpipe``, ``virtual_stages``, ``cuts``, ``loss_fn``) in place of
the forward / backward above::

    config = neuronx_distributed_config(pipeline_parallel_size=2,
                                        pipeline_config={"num_microbatches": 4}, ...)
    model = initialize_parallel_model(config, build_model, decoder_config)
    loss = model.run_train([{"input_ids": ids, "labels": labels} for ids, labels in micro_batches])
    optimizer.step()

This module is a thin layer over the one assembly every ``nxd-finetune run`` uses
(:func:`nxd_finetune.parallel.parallelize.parallelize_model`) and the one parallel optimizer
(:class:`nxd_finetune.parallel.optimizer.ParallelOptimizer`); it adds NxD's names and dict options.

Differences from NxD, on purpose: without pipeline parallel the model is returned as the plain
module (no ``NxDModel`` wrapper);
``lora_config`` is :class:`nxd_finetune.lora.LoraConfig` (PEFT field names); with tp > 1 LoRA
needs the sharded LoRA layers (``lora`` package), else ``inject_lora`` raises AdapterError;
``optimizer_config["grad_reduction"]`` says whether data-parallel gradients are averaged
(``mean``, the default: per-rank mean losses, as DDP) or summed (``sum``: losses already
divided by the global token count, as the nxd-finetune trainer does).
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypedDict, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import ParamsT

from nxd_finetune.device import accelerator_type, device_of_backend
from nxd_finetune.errors import NxdError
from nxd_finetune.lora import LoraConfig, base_param_name, inject_lora
from nxd_finetune.lora.dora import init_dora_magnitudes
from nxd_finetune.parallel.optimizer import GradReduction, ParallelOptimizer
from nxd_finetune.parallel.parallelize import (
    CheckpointSpec,
    ModelHooks,
    ParallelizeSpec,
    RankModel,
    WeightSource,
    apply_activation_checkpointing,
    parallelize_model,
)
from nxd_finetune.parallel.pipeline import LossFn
from nxd_finetune.parallel.state import Layout, ParallelState
from nxd_finetune.parallel.zero1 import Hyperparameter

__all__ = [
    "NxDConfig",
    "ParallelOptimizer",
    "PipelineModel",
    "apply_activation_checkpointing",
    "initialize_parallel_model",
    "initialize_parallel_optimizer",
    "neuronx_distributed_config",
]

OPTIMIZER_DEFAULTS: dict[str, Any] = {
    "zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0, "grad_reduction": "mean",
}
PIPELINE_DEFAULTS: dict[str, Any] = {
    "num_microbatches": None,  # micro-batches per optimizer step (gradient accumulation); None: pp
    "schedule": "1f1b",  # 1f1b | interleaved_1f1b | gpipe
    "virtual_stages": 1,  # stage modules per rank (interleaved_1f1b: >= 2)
    "cuts": None,  # first layer index of every stage after the first; None: even split
    "loss_fn": None,  # fn(logits, labels, n_targets); None: token-summed CE / n_targets (vocab-parallel at tp > 1)
}
MODEL_INIT_DEFAULTS: dict[str, Any] = {
    "sequential_move_factor": 11,  # accepted for NxD compatibility; unused on CPU / CUDA
    "meta_device_init": False,  # call model_fn under torch.device("meta")
    "param_init_fn": None,  # fn(module) initialising a module's freshly allocated parameters
    "checkpoint": None,  # HF checkpoint dir: each rank reads only its slices (meta init)
    "dtype": torch.float32,  # dtype of parameters materialised from "checkpoint"
    "tp_plan": None,  # module pattern -> style; None: the plan of model.config.architecture
}


class OptimizerConfig(TypedDict, total=False):
    """``optimizer_config`` (NxD's keys; absent keys take :data:`OPTIMIZER_DEFAULTS`)."""

    zero_one_enabled: bool
    grad_clipping: bool
    max_grad_norm: float
    grad_reduction: GradReduction


class PipelineConfig(TypedDict, total=False):
    """``pipeline_config`` (absent keys take :data:`PIPELINE_DEFAULTS`, which says what each is)."""

    num_microbatches: int | None
    schedule: str
    virtual_stages: int
    cuts: Sequence[int] | None
    loss_fn: LossFn | None


class ModelInitConfig(TypedDict, total=False):
    """``model_init_config`` (absent keys take :data:`MODEL_INIT_DEFAULTS`, which says what each is)."""

    sequential_move_factor: int
    meta_device_init: bool
    param_init_fn: Callable[[nn.Module], None] | None
    checkpoint: str | Path | None
    dtype: torch.dtype
    tp_plan: dict[str, str] | None


def _merge(what: str, given: Mapping[str, object] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    for key in given or {}:
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(defaults)})"
            raise NxdError(f"unknown {what} key {key!r}{hint}")
    return {**defaults, **(given or {})}


@dataclasses.dataclass
class NxDConfig:
    """What :func:`neuronx_distributed_config` returns; also readable as a dict (``cfg["..."]``).

    ``state`` is this rank's :class:`ParallelState`; ``device`` where the model is put; ``model``
    is set by :func:`initialize_parallel_model` (the optimizer wrapper reads its sharding metadata).
    """

    tensor_parallel_size: int
    pipeline_parallel_size: int
    pipeline_config: PipelineConfig
    optimizer_config: OptimizerConfig
    activation_checkpoint_config: CheckpointSpec
    sequence_parallel: bool
    model_init_config: ModelInitConfig
    lora_config: LoraConfig | None
    state: ParallelState
    device: torch.device
    model: nn.Module | None = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


def neuronx_distributed_config(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    pipeline_config: PipelineConfig | None = None,
    optimizer_config: OptimizerConfig | None = None,
    activation_checkpoint_config: CheckpointSpec = None,
    pad_model: bool = False,
    sequence_parallel: bool = False,
    model_init_config: ModelInitConfig | None = None,
    lora_config: LoraConfig | None = None,
) -> NxDConfig:
    """Validate the options and build the process groups (``dp = world / (tp * pp)``).

    Collective when a process group is initialised (every rank calls it, with the same values).
    Raises NxdError for unknown ``optimizer_config`` / ``model_init_config`` / ``pipeline_config``
    keys (naming the closest known one), a world size that tp*pp does not divide, ``pad_model``
    (not supported), a ``grad_reduction`` other than mean / sum.
    """
    if pad_model:
        raise NxdError("pad_model=True is not supported: choose tp dividing the attention heads")
    opt = cast(OptimizerConfig, _merge("optimizer_config", optimizer_config, OPTIMIZER_DEFAULTS))
    if opt["grad_reduction"] not in ("mean", "sum"):
        raise NxdError(f"optimizer_config grad_reduction must be 'mean' or 'sum', got {opt['grad_reduction']!r}")
    init = cast(ModelInitConfig, _merge("model_init_config", model_init_config, MODEL_INIT_DEFAULTS))
    pipeline = cast(PipelineConfig, _merge("pipeline_config", pipeline_config, PIPELINE_DEFAULTS))
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    state = ParallelState(Layout.for_world(world, tp=tensor_parallel_size, pp=pipeline_parallel_size))
    # the device of the world's backend (gloo: cpu; nccl: cuda; a registered backend: its device)
    name = device_of_backend(dist.get_backend()) if initialised else None
    device = torch.device("cpu")
    if name is not None and name == accelerator_type():
        device = torch.device(name, torch.accelerator.current_device_index())
    return NxDConfig(tensor_parallel_size, pipeline_parallel_size, pipeline, opt, activation_checkpoint_config,
                     sequence_parallel, init, lora_config, state, device)


class PipelineModel(nn.Module):
    """This rank's pipeline stages and their schedule, as :func:`initialize_parallel_model`
    returns them at ``pipeline_parallel_size > 1`` (NxD's ``NxDPPModel``).

    ``run_train(micro_batches, n_targets=None)``: forward and backward of one optimizer step
    (``micro_batches``: ``pipeline_config["num_microbatches"]`` dicts of ``input_ids`` and
    ``labels`` ``[B, T]``, the same on every rank of the pipeline); gradients accumulate into the
    stages' ``.grad``; returns the step loss on every rank of the pipeline. ``run_eval(batch)``:
    ``[loss sum, correct, targets]`` of a batch. ``stages``: the stage modules (parameters,
    ``state_dict``); calling the model directly is an error.
    """

    def __init__(self, rank_model: RankModel) -> None:
        super().__init__()
        assert rank_model.runner is not None
        self.stages = nn.ModuleList(rank_model.modules)
        self.runner = rank_model.runner

    def run_train(self, micro_batches: list[dict[str, torch.Tensor]],
                  n_targets: torch.Tensor | int | None = None) -> torch.Tensor:
        return self.runner.step(micro_batches, n_targets)

    def run_eval(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.runner.eval_step(batch)

    def forward(self, *args: object, **kwargs: object) -> NoReturn:
        raise NxdError("a pipeline-parallel model is run with model.run_train(micro_batches) / run_eval(batch)")


def initialize_parallel_model(config: NxDConfig, model_fn: Callable[..., nn.Module], *args: object,
                              **kwargs: object) -> nn.Module:
    """Build ``model_fn(*args, **kwargs)`` (under the meta device with ``meta_device_init``) and
    hand it to the one assembly (:func:`~nxd_finetune.parallel.parallelize.parallelize_model`): TP
    plan (tp > 1), LoRA (``lora_config``), pipeline stages, this rank's checkpoint slices or
    ``param_init_fn``, activation checkpointing, ``config.device``. Records the model in
    ``config.model`` and returns it: the plain module, or a :class:`PipelineModel` at
    ``pipeline_parallel_size > 1` (build it under ``meta_device_init`` so that no rank allocates
    the layers of other stages).

    Collective (every rank calls it). Raises NxdError for a model without a TP plan, a meta model
    with no way to initialise it, a pipeline layout the model or schedule cannot take.
    """
    init, pc = config.model_init_config, config.pipeline_config
    if init["meta_device_init"]:
        with torch.device("meta"):
            model = model_fn(*args, **kwargs)
    else:
        model = model_fn(*args, **kwargs)
    lora = config.lora_config
    hooks = ModelHooks(inject=(lambda m: inject_lora(m, lora)) if lora is not None else None,
                       checkpoint_key=base_param_name, loaded=lambda _, modules: init_dora_magnitudes(*modules))
    spec = ParallelizeSpec(tp_plan=init["tp_plan"], sequence_parallel=config.sequence_parallel,
                           virtual_stages=pc["virtual_stages"], pp_cuts=pc["cuts"], pp_schedule=pc["schedule"],
                           n_microbatches=pc["num_microbatches"],
                           activation_checkpointing=config.activation_checkpoint_config)
    checkpoint = init["checkpoint"]
    weights = WeightSource(Path(checkpoint) if checkpoint is not None else None, init["dtype"], init["param_init_fn"])
    rank_model = parallelize_model(model, config.state, spec=spec, weights=weights, device=config.device,
                                   hooks=hooks, loss_fn=pc["loss_fn"])
    result: nn.Module = PipelineModel(rank_model) if rank_model.runner is not None else rank_model.modules[0]
    config.model = result
    return result


def initialize_parallel_optimizer(config: NxDConfig, optimizer_class: Callable[..., torch.optim.Optimizer],
                                  params: ParamsT, **defaults: Hyperparameter) -> ParallelOptimizer:
    """``optimizer_class(params, **defaults)`` wrapped in a :class:`ParallelOptimizer` (TP sync, dp
    reduction or ZeRO-1, clipping) as ``optimizer_config`` says. Call it after
    :func:`initialize_parallel_model` (it reads the model's sharding)."""
    opt, model = config.optimizer_config, config.model
    not_counted = model.runner.not_counted_parameters if isinstance(model, PipelineModel) else ()
    return ParallelOptimizer(optimizer_class, params, state=config.state, model=model,
                             zero1=bool(opt["zero_one_enabled"]), grad_reduction=opt["grad_reduction"],
                             max_grad_norm=opt["max_grad_norm"] if opt["grad_clipping"] else None,
                             not_counted=not_counted, **defaults)

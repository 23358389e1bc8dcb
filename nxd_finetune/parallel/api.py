"""The NxD-style programmatic API: a config, a model initialiser and an optimizer wrapper.

Names and shapes follow NeuronX Distributed Training (``neuronx_distributed_config``,
``initialize_parallel_model``, ``initialize_parallel_optimizer``), so NxD scripts port with few
changes. Example (one script, run by ``torchrun --nproc-per-node 4`` or through
:func:`nxd_finetune.parallel.launch.launch`)::

    import torch
    from nxd_finetune.lora import LoraConfig
    from nxd_finetune.models import DecoderConfig, build_model
    from nxd_finetune.parallel.api import (
        initialize_parallel_model, initialize_parallel_optimizer, neuronx_distributed_config)
    from nxd_finetune.parallel.launch import init_distributed

    init_distributed()                       # gloo on CPU, nccl on CUDA; no-op in one process
    config = neuronx_distributed_config(
        tensor_parallel_size=2,
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        model_init_config={"meta_device_init": True, "checkpoint": "/models/llama3-8b"},
    )
    model = initialize_parallel_model(config, build_model, DecoderConfig.from_hf("/models/llama3-8b"))
    optimizer = initialize_parallel_optimizer(
        config, torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for batch in loader:                     # this dp rank's batches (config.state.dp_rank / dp_size)
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.parallel.clip import clip_grad_norm, clip_grad_norm_zero1
from nxd_finetune.parallel.data_parallel import allreduce_gradients
from nxd_finetune.parallel.plan import allreduce_replicated_grads, apply_tp_plan, make_slice_reader, tp_plan_for
from nxd_finetune.parallel.state import ParallelDims, ParallelState
from nxd_finetune.parallel.zero1 import Zero1Optimizer

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


def _merge(what: str, given: dict[str, Any] | None, defaults: dict[str, Any]) -> dict[str, Any]:
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
    pipeline_config: dict[str, Any] | None
    optimizer_config: dict[str, Any]
    activation_checkpoint_config: Any
    sequence_parallel: bool
    model_init_config: dict[str, Any]
    lora_config: Any
    state: ParallelState
    device: torch.device
    model: nn.Module | None = None

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


def neuronx_distributed_config(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    pipeline_config: dict[str, Any] | None = None,
    optimizer_config: dict[str, Any] | None = None,
    activation_checkpoint_config: Any = None,
    pad_model: bool = False,
    sequence_parallel: bool = False,
    model_init_config: dict[str, Any] | None = None,
    lora_config: Any = None,
) -> NxDConfig:
    """Validate the options and build the process groups (``dp = world / (tp * pp)``).

    Collective when a process group is initialised (every rank calls it, with the same values).
    Raises NxdError for unknown ``optimizer_config`` / ``model_init_config`` keys (naming the
    closest known one, ``pipeline_config`` too), a world size that tp*pp does not divide, ``pad_model`` (not supported),
    a ``grad_reduction`` other than mean / sum.
    """
    if pad_model:
        raise NxdError("pad_model=True is not supported: choose tp dividing the attention heads")
    opt = _merge("optimizer_config", optimizer_config, OPTIMIZER_DEFAULTS)
    if opt["grad_reduction"] not in ("mean", "sum"):
        raise NxdError(f"optimizer_config grad_reduction must be 'mean' or 'sum', got {opt['grad_reduction']!r}")
    init = _merge("model_init_config", model_init_config, MODEL_INIT_DEFAULTS)
    pipeline = _merge("pipeline_config", pipeline_config, PIPELINE_DEFAULTS)
    initialised = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if initialised else 1
    state = ParallelState(ParallelDims.for_world(world, tp=tensor_parallel_size, pp=pipeline_parallel_size))
    on_cuda = initialised and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    return NxDConfig(tensor_parallel_size, pipeline_parallel_size, pipeline, opt, activation_checkpoint_config,
                     sequence_parallel, init, lora_config, state, device)


def apply_activation_checkpointing(model: nn.Module, spec: Any) -> int:
    """Recompute modules' activations in backward (``torch.utils.checkpoint``, non-reentrant).

    ``spec``: None (nothing), ``"full"`` (every decoder layer, ``model.model.layers``) or a module
    class / tuple of classes (every instance). Patches the instances' ``forward``, so module and
    parameter names do not change. Returns the number of modules. NxdError for anything else.
    """
    if spec is None:
        return 0
    if spec == "full":
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise NxdError("activation_checkpoint_config='full' needs a decoder with model.model.layers")
        targets = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    elif isinstance(spec, type) and issubclass(spec, nn.Module) or isinstance(spec, tuple):
        targets = [m for m in model.modules() if isinstance(m, spec)]
    else:
        raise NxdError(f"activation_checkpoint_config must be None, 'full' or a module class, got {spec!r}")

    def checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return run

    for module in targets:
        module.forward = checkpointed(module.forward)
    return len(targets)


def _on_meta(model: nn.Module) -> list[str]:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [name for name, t in tensors if t.device.type == "meta"]


def checkpoint_name_map(module: nn.Module) -> Callable[[str], str]:
    """Checkpoint key of each parameter of ``module`` (a model or a pipeline stage): LoRA's
    ``base_layer`` dropped; a last stage without the embedding reads a tied ``lm_head`` from
    ``model.embed_tokens.weight`` (tied checkpoints store only that)."""
    from nxd_finetune.lora import base_param_name

    config = getattr(module, "config", None)
    untied_head = (getattr(config, "tie_word_embeddings", False) and getattr(module, "lm_head", None) is not None
                   and getattr(getattr(module, "model", None), "embed_tokens", True) is None)

    def name_map(name: str) -> str:
        key = base_param_name(name)
        return "model.embed_tokens.weight" if untied_head and key == "lm_head.weight" else key

    return name_map


def _materialize(model: nn.Module, config: NxDConfig) -> None:
    """Give real storage to meta parameters: this rank's slices of the checkpoint, or
    ``param_init_fn`` on freshly allocated modules."""
    if not _on_meta(model):
        return
    init = config.model_init_config
    if init["checkpoint"] is not None:
        from nxd_finetune.models import materialize

        materialize(model, init["checkpoint"], dtype=init["dtype"], device=config.device,
                    reader=make_slice_reader(model), name_map=checkpoint_name_map(model))
    elif init["param_init_fn"] is not None:
        for module in model.modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if any(t.device.type == "meta" for t in own):
                module.to_empty(device=config.device, recurse=False)
                init["param_init_fn"](module)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    else:
        raise NxdError("the model is on the meta device: set model_init_config 'checkpoint' or 'param_init_fn'")
    left = _on_meta(model)
    if left:
        raise NxdError(f"{len(left)} tensor(s) still on the meta device after initialisation, e.g. {left[0]}")


def initialize_parallel_model(config: NxDConfig, model_fn: Callable[..., nn.Module], *args: Any,
                              **kwargs: Any) -> nn.Module:
    """Build ``model_fn(*args, **kwargs)`` (under the meta device with ``meta_device_init``),
    apply the TP plan (tp > 1), inject LoRA (``lora_config``), materialise meta tensors
    (``checkpoint`` slices or ``param_init_fn``), apply activation checkpointing, move to
    ``config.device``; records the model in ``config.model`` and returns it.

    With ``pipeline_parallel_size > 1``: cuts the model into this rank's stages after the TP plan
    and LoRA, before materialising (so a rank reads only its stages' slices) and returns a
    :class:`PipelineModel`; build the model under ``meta_device_init`` so that no rank allocates
    the layers of other stages.

    Collective (every rank calls it). Raises NxdError for a model without a TP plan, a meta model
    with no way to initialise it, a pipeline layout the model or schedule cannot take.
    """
    init = config.model_init_config
    if init["meta_device_init"]:
        with torch.device("meta"):
            model = model_fn(*args, **kwargs)
    else:
        model = model_fn(*args, **kwargs)
    if config.tensor_parallel_size > 1:
        plan = init["tp_plan"] or tp_plan_for(getattr(model, "config", None))
        apply_tp_plan(model, plan, config.state, sequence_parallel=config.sequence_parallel)
    if config.lora_config is not None:
        from nxd_finetune.lora import inject_lora

        inject_lora(model, config.lora_config)
    if config.pipeline_parallel_size > 1:
        model = _pipeline_model(model, config)
    else:
        _materialize(model, config)
        apply_activation_checkpointing(model, config.activation_checkpoint_config)
    model.to(config.device)
    config.model = model
    return model


class PipelineModel(nn.Module):
    """This rank's pipeline stages and their schedule (:class:`~.pipeline.PipelineRunner`), as
    :func:`initialize_parallel_model` returns them at ``pipeline_parallel_size > 1``.

    ``run_train(micro_batches, n_targets=None)``: forward and backward of one optimizer step
    (``micro_batches``: ``pipeline_config["num_microbatches"]`` dicts of ``input_ids`` and
    ``labels`` ``[B, T]``, the same on every rank of the pipeline); gradients accumulate into the
    stages' ``.grad``; returns the step loss on every rank of the pipeline. ``run_eval(batch)``:
    ``[loss sum, correct, targets]`` of a batch. ``stages``: the stage modules (parameters,
    ``state_dict``); calling the model directly is an error.
    """

    def __init__(self, stages: list[nn.Module], runner: Any) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.runner = runner

    def run_train(self, micro_batches: list[dict[str, torch.Tensor]], n_targets: Any = None) -> torch.Tensor:
        return self.runner.step(micro_batches, n_targets)

    def run_eval(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.runner.eval_step(batch)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NxdError("a pipeline-parallel model is run with model.run_train(micro_batches) / run_eval(batch)")


def _pipeline_model(model: nn.Module, config: NxDConfig) -> PipelineModel:
    from nxd_finetune.parallel.layers import vocab_parallel_cross_entropy
    from nxd_finetune.parallel.pipeline import PipelineRunner, build_stages, step_normalised_loss
    from nxd_finetune.sft.loss import shift_labels

    pc, state = config.pipeline_config, config.state
    if getattr(model, "config", None) is None:
        raise NxdError("pipeline parallel needs a decoder with .config (num_hidden_layers) to cut into stages")
    stages = build_stages(model, state, pc["virtual_stages"], pc["cuts"])
    for stage in stages:
        _materialize(stage, config)
        apply_activation_checkpointing(stage, config.activation_checkpoint_config)
        stage.to(config.device)
    loss_fn = pc["loss_fn"]
    if loss_fn is None and state.tp_size > 1:
        def loss_fn(logits: torch.Tensor, labels: torch.Tensor, n_targets: Any) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits, shift_labels(labels), state.tp_group).sum() / n_targets
    runner = PipelineRunner(stages, state, pc["schedule"], n_microbatches=pc["num_microbatches"] or state.pp_size,
                            loss_fn=loss_fn or step_normalised_loss)
    if config.model_init_config["checkpoint"] is None:
        runner.sync_tied_weights()  # param_init_fn drew the tied copies independently
    return PipelineModel(stages, runner)


class ParallelOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step`` does the parallel work before the wrapped step:

    1. sums the TP-partial gradients of replicated parameters (``allreduce_replicated_grads``);
    2. reduces gradients over dp: bucketed all-reduce, or with ZeRO-1 a reduce-scatter into the
       :class:`Zero1Optimizer` shards (``grad_reduction``: mean or sum);
    3. with ``grad_clipping``: clips to ``max_grad_norm`` over tp / pp (/ dp shards); the norm
       before clipping is kept in ``grad_norm`` (a tensor). ``not_counted``: parameters clipped
       but left out of the norm (the last pipeline stage's tied ``lm_head`` copy);
    4. the wrapped optimizer's step.

    ``param_groups``, ``state``, ``state_dict`` ... are the wrapped optimizer's (the
    :class:`Zero1Optimizer` with ZeRO-1), so LR schedulers work unchanged.
    """

    def __init__(self, config: NxDConfig, optimizer_class: type[torch.optim.Optimizer], params: Any,
                 **defaults: Any) -> None:
        # no Optimizer.__init__: everything is delegated to the wrapped optimizer
        self.config = config
        opt = config.optimizer_config
        self.zero1 = bool(opt["zero_one_enabled"])
        self.average = opt["grad_reduction"] == "mean"
        self.max_norm = opt["max_grad_norm"] if opt["grad_clipping"] else None
        if self.zero1:
            self.optimizer: torch.optim.Optimizer = Zero1Optimizer(
                params, optimizer_class, config.state.dp_group, average=self.average, **defaults)
        else:
            self.optimizer = optimizer_class(params, **defaults)
        self.grad_norm: torch.Tensor | None = None
        self.not_counted: list[torch.Tensor] = []

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.zero1:
            raise NxdError("add_param_group is not supported with ZeRO-1: pass every group at construction")
        self.optimizer.add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's contract
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state, model = self.config.state, self.config.model
        if isinstance(model, PipelineModel) and not self.not_counted:
            self.not_counted = model.runner.not_counted_parameters()  # the tied lm_head copy
        if model is not None:
            allreduce_replicated_grads(model, state)
        elif state.tp_size > 1:
            raise NxdError("tensor parallel needs the model: call initialize_parallel_model before stepping")
        if self.zero1:
            self.optimizer.reduce_gradients()
            if self.max_norm is not None:
                self.grad_norm = clip_grad_norm_zero1(self.optimizer, self.max_norm, state, specs=model,
                                                      not_counted=self.not_counted)
        else:
            params = [p for g in self.param_groups for p in g["params"]]
            allreduce_gradients(params, state.dp_group, average=self.average)
            if self.max_norm is not None:
                self.grad_norm = clip_grad_norm(params, self.max_norm, state, specs=model,
                                                not_counted=self.not_counted)
        self.optimizer.step()
        return loss


def initialize_parallel_optimizer(config: NxDConfig, optimizer_class: type[torch.optim.Optimizer], params: Any,
                                  **defaults: Any) -> ParallelOptimizer:
    """``optimizer_class(params, **defaults)`` wrapped in a :class:`ParallelOptimizer`, its states
    sharded over dp (:class:`Zero1Optimizer`) when ``optimizer_config["zero_one_enabled"]``."""
    return ParallelOptimizer(config, optimizer_class, params, **defaults)

"""The one place a rank's model is put together, for every layout (world size 1 included).

:func:`parallelize_model` takes a model (built on the meta device, or real) and turns it into this
rank's share, in this order:

1. the tensor-parallel plan (``tp > 1``): modules swapped for column / row / vocab-parallel ones;
   then expert parallel (``ep > 1``): each experts module keeps this rank's experts
   (:func:`~.experts.apply_expert_parallel`);
2. ``hooks.inject(model)``: where LoRA goes in (after the TP plan, so the sharded LoRA layers
   follow their sharded bases; before the stage cut, so every stage keeps its adapters);
3. the pipeline stage cut (``pp > 1``): this rank's stage shells; the layers it does not hold are
   never materialised;
4. weights: each module's meta tensors from this rank's slices of an HF checkpoint (parameter names
   mapped to checkpoint keys by ``hooks.checkpoint_key``), or ``param_init_fn`` on freshly
   allocated modules;
5. ``hooks.loaded(model, modules)``: after the weights (the adapter's master dtype, ``init_from``);
6. activation checkpointing, then the device;
7. at ``pp > 1`` the :class:`~.pipeline.PipelineRunner` over the stages, its loss and eval
   statistics from :mod:`nxd_finetune.loss` (vocab-parallel at ``tp > 1``) unless given.

It imports ``models``-agnostic pieces of ``parallel/`` and :mod:`nxd_finetune.loss` only: LoRA
and the recipe reach it through :class:`ModelHooks`. Callers: ``sft.engine.build_engine`` (every
``nxd-finetune run``) and the NxD-style API (:mod:`nxd_finetune.api`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.models.loading import materialize
from nxd_finetune.parallel.experts import apply_expert_parallel
from nxd_finetune.parallel.pipeline import LossFn, PipelineRunner, build_stages
from nxd_finetune.parallel.plan import apply_tp_plan, make_slice_reader, tp_plan_for
from nxd_finetune.parallel.recompute import checkpointed
from nxd_finetune.parallel.state import Layout, ParallelState

CheckpointSpec = None | Literal["full"] | type[nn.Module] | tuple[type[nn.Module], ...]
StatsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _same(name: str) -> str:
    return name


@dataclasses.dataclass(frozen=True)
class ModelHooks:
    """What a caller adds to the assembly without ``parallel/`` knowing it (LoRA, init_from).

    ``inject(model)``: after the TP plan, before the stage cut. ``checkpoint_key(name)``: a
    parameter name -> its key in the HF checkpoint (LoRA's ``base_layer`` dropped).
    ``loaded(model, modules)``: after the weights are read (``model``: the whole, partly
    unmaterialised model; ``modules``: this rank's modules, sharing submodules with it).
    ``tensor_loaded(module, attr)``: right after each checkpoint tensor is read into ``module``
    (a quantized base quantizes the linear there)."""

    inject: Callable[[nn.Module], object] | None = None
    checkpoint_key: Callable[[str], str] = _same
    loaded: Callable[[nn.Module, list[nn.Module]], None] | None = None
    tensor_loaded: Callable[[nn.Module, str], None] | None = None


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """Where meta tensors get their values: ``checkpoint`` (an HF directory; each rank reads only
    its slices, in ``dtype``) or ``param_init_fn(module)`` on each freshly allocated module."""

    checkpoint: Path | str | None = None
    dtype: torch.dtype = torch.float32
    param_init_fn: Callable[[nn.Module], None] | None = None
    mapped: bool = True
    """False: the checkpoint read without a memory map (``materialize``'s ``mapped``)."""


@dataclasses.dataclass(frozen=True)
class ParallelizeSpec:
    """The layout choices of a rank's model. ``tp_plan``: module pattern -> style (None: the plan of
    ``model.config.architecture``). Pipeline (``state.size("pp") > 1``): ``virtual_stages``,
    ``pp_cuts`` (first layer of every stage after the first; None: even), ``pp_schedule``,
    ``n_microbatches`` (None: pp). ``activation_checkpointing``: None, ``"full"`` (every decoder
    layer) or module classes."""

    tp_plan: dict[str, str] | None = None
    sequence_parallel: bool = False
    virtual_stages: int = 1
    pp_cuts: Sequence[int] | None = None
    pp_schedule: str = "1f1b"
    n_microbatches: int | None = None
    activation_checkpointing: CheckpointSpec = None
    loss_chunk_rows: int | None = None
    """At ``pp > 1`` without sequence parallel: the last stage returns its final hidden states and
    the objective's scores run the output layer this many target positions at a time
    (:class:`loss.ChunkedScores`), so no ``[tokens, vocab]`` logits are held; None: the last stage
    returns logits."""


@dataclasses.dataclass
class RankModel:
    """This rank's share of the model: ``modules`` (the whole model, or its pipeline stages in
    local order) and, at ``pp > 1``, the ``runner`` that trains them; ``state`` the layout."""

    modules: list[nn.Module]
    state: ParallelState
    runner: PipelineRunner | None = None

    @classmethod
    def single(cls, model: nn.Module) -> RankModel:
        """A whole model in a one-process layout (no process group needed)."""
        return cls([model], ParallelState(Layout.for_world(1, tp=1, pp=1)))

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, de-duplicated, in module order."""
        return list(dict.fromkeys(p for m in self.modules for p in m.parameters()))

    def not_counted(self) -> list[nn.Parameter]:
        """Parameters left out of the global gradient norm (the last stage's tied head copy)."""
        return self.runner.not_counted_parameters() if self.runner is not None else []


def apply_activation_checkpointing(model: nn.Module, spec: CheckpointSpec) -> int:
    """Recompute modules' activations in backward (:func:`~.recompute.checkpointed`).

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
    for module in targets:
        module.forward = checkpointed(module, module.forward)
    return len(targets)


def checkpoint_name_map(module: nn.Module, checkpoint_key: Callable[[str], str] = _same) -> Callable[[str], str]:
    """Checkpoint key of each parameter of ``module`` (a model or a pipeline stage):
    ``checkpoint_key`` first; a last stage without the embedding reads a tied ``lm_head`` from
    ``model.embed_tokens.weight`` (tied checkpoints store only that)."""
    config = getattr(module, "config", None)
    untied_head = (getattr(config, "tie_word_embeddings", False) and getattr(module, "lm_head", None) is not None
                   and getattr(getattr(module, "model", None), "embed_tokens", True) is None)

    def name_map(name: str) -> str:
        key = checkpoint_key(name)
        return "model.embed_tokens.weight" if untied_head and key == "lm_head.weight" else key

    return name_map


def _on_meta(model: nn.Module) -> list[str]:
    return [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]


def materialize_module(module: nn.Module, weights: WeightSource, checkpoint_key: Callable[[str], str] = _same,
                       on_loaded: Callable[[nn.Module, str], None] | None = None) -> None:
    """Give real (CPU) storage to ``module``'s meta tensors: its slices of ``weights.checkpoint``
    (``on_loaded(module, attr)`` after each), or ``weights.param_init_fn`` on freshly allocated
    submodules. NxdError when neither is given or a tensor stays on the meta device."""
    if not _on_meta(module):
        return
    if weights.checkpoint is not None:
        materialize(module, weights.checkpoint, dtype=weights.dtype, device="cpu", reader=make_slice_reader(module),
                    name_map=checkpoint_name_map(module, checkpoint_key), on_loaded=on_loaded,
                    mapped=weights.mapped)
    elif weights.param_init_fn is not None:
        for sub in module.modules():
            own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
            if any(t.device.type == "meta" for t in own):
                sub.to_empty(device="cpu", recurse=False)
                weights.param_init_fn(sub)
        tie = getattr(module, "tie_weights", None)
        if callable(tie):
            tie()
    else:
        raise NxdError("the model is on the meta device: set model_init_config 'checkpoint' or 'param_init_fn'")
    left = _on_meta(module)
    if left:
        raise NxdError(f"{len(left)} tensor(s) still on the meta device after initialisation, e.g. {left[0]}")


def parallelize_model(
    model: nn.Module,
    state: ParallelState,
    *,
    spec: ParallelizeSpec,
    weights: WeightSource,
    device: torch.device,
    hooks: ModelHooks | None = None,
    loss_fn: LossFn | None = None,
    stats_fn: StatsFn | None = None,
) -> RankModel:
    """This rank's :class:`RankModel` built from ``model`` (see the module docstring).

    Collective when a process group is initialised (every rank calls it; the pipeline runner makes
    the tied-embedding groups). ``loss_fn(logits, labels, n_targets)`` / ``stats_fn(logits,
    targets)``: a custom pipeline last-stage loss and eval statistics in place of the
    objective each pipeline call is handed (over this rank's vocabulary shard). Raises NxdError for a model
    without a TP plan, a meta model with no weight source, a pipeline layout the model or schedule
    cannot take."""
    hooks = hooks or ModelHooks()
    if state.size("tp") > 1:
        plan = spec.tp_plan or tp_plan_for(getattr(model, "config", None))
        apply_tp_plan(model, plan, state, sequence_parallel=spec.sequence_parallel)
    apply_expert_parallel(model, state)
    if hooks.inject is not None:
        hooks.inject(model)
    if state.size("pp") > 1:
        if getattr(model, "config", None) is None:
            raise NxdError("pipeline parallel needs a decoder with .config (num_hidden_layers) to cut into stages")
        modules = build_stages(model, state, spec.virtual_stages, spec.pp_cuts)
    else:
        modules = [model]
    for m in modules:
        materialize_module(m, weights, hooks.checkpoint_key, hooks.tensor_loaded)
    if hooks.loaded is not None:
        hooks.loaded(model, modules)
    for m in modules:
        apply_activation_checkpointing(m, spec.activation_checkpointing)
        m.to(device)
    if state.size("pp") == 1:
        return RankModel(modules, state)
    chunk_rows = None if spec.sequence_parallel else spec.loss_chunk_rows
    runner = PipelineRunner(modules, state, spec.pp_schedule, n_microbatches=spec.n_microbatches or state.size("pp"),
                            loss_fn=loss_fn, stats_fn=stats_fn, loss_chunk_rows=chunk_rows)
    if weights.checkpoint is None:
        runner.sync_tied_weights()  # param_init_fn drew the tied copies independently
    return RankModel(modules, state, runner)

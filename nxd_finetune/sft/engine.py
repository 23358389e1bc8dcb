"""What one training process holds and does, for every parallel layout (world size 1 included).

:func:`build_engine` turns a recipe into this rank's share of the run:

1. ``ParallelState`` from the world (``parallel.tp`` / ``pp``; ``dp = world / (tp * pp)``);
2. the model built on the meta device -> the TP plan (``tp > 1``) -> LoRA injected (factors are
   real CPU tensors, initialised from the global RNG exactly as at tp=1, so every layout starts
   from the same adapter) -> pipeline stages cut (``pp > 1``; the layers this rank does not hold are
   never materialised) -> this rank's slices of the HF safetensors read tensor by tensor
   -> ``lora.init_from`` -> activation checkpointing -> the device;
3. AdamW over the trainable parameters (no decay on 1-D tensors) inside a
   :class:`~nxd_finetune.parallel.api.ParallelOptimizer`: TP-replicated gradient sums, the
   data-parallel *sum* (losses are already divided by the global target count), ZeRO-1 when
   ``parallel.zero1``, clipping over tp/pp/dp, then the step; warmup + decay LambdaLR.

The :class:`Engine` then runs one optimizer step's forward/backward (:meth:`Engine.forward_backward`:
plain micro-batch loop, or the pipeline schedule), the optimizer step (:meth:`Engine.step`) and
eval statistics (:meth:`Engine.eval_stats`). Losses: each micro-batch contributes its summed
token cross entropy divided by ``n_targets``, the loss-bearing tokens of the whole optimizer step
over all dp ranks; with TP the cross entropy is the vocab-parallel one on ``[*, V/tp]`` logits.
Outside pipeline parallel, logits are computed only at target positions (``logits_index``),
which SFT's masked prompts make a large saving, unless :attr:`Engine.full_logits` asks for every
position (sequence parallel; fixed shapes on XLA).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.models import DecoderConfig, build_model, materialize, resolve_dtype
from nxd_finetune.parallel.api import (
    MODEL_INIT_DEFAULTS,
    NxDConfig,
    ParallelOptimizer,
    apply_activation_checkpointing,
    checkpoint_name_map,
)
from nxd_finetune.parallel.layers import vocab_parallel_cross_entropy
from nxd_finetune.parallel.mappings import all_gather
from nxd_finetune.parallel.plan import apply_tp_plan, make_slice_reader, tp_plan_for
from nxd_finetune.parallel.state import ParallelDims, ParallelState
from nxd_finetune.sft.loss import IGNORE_INDEX, shift_labels, target_index
from nxd_finetune.sft.schedule import lr_factor

Batch = dict[str, torch.Tensor]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``bf16`` / ``bf16-mixed``; nothing for fp32."""
    if precision in ("bf16", "bf16-mixed"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class HostGroups:
    """Process groups for collectives on CPU tensors and pickled objects (parameter counts, the
    stop-signal flag, RNG states, checkpoint ids and barriers, the pipeline stages' adapter parts):
    ``world`` (None: the default group) and this rank's ``tp`` / ``pp`` / ``dp`` groups, over the
    same ranks as :class:`ParallelState`'s. Single process: all None (no collective is made).

    Under gloo they are the main groups. The ``xla`` backend takes XLA tensors only (a CPU tensor
    raises ``Expected XLA tensor``) and its barrier returns at once, nccl takes CUDA tensors only:
    under those backends :meth:`for_state` creates gloo groups over the same ranks beside the main
    ones (as Megatron-LM's ``*_GLOO`` groups).
    """

    world: dist.ProcessGroup | None = None
    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None

    @classmethod
    def for_state(cls, state: ParallelState, separate: bool | None = None) -> HostGroups:
        """The host groups of ``state``'s layout. ``separate``: gloo groups of their own (True),
        ``state``'s groups (False), or True unless the default backend is gloo (None). Collective
        when a default group is initialised: every rank calls it, in the same order relative to
        other group creation."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        if not (dist.get_backend() != "gloo" if separate is None else separate):
            return cls(None, state.tp_group, state.pp_group, state.dp_group)
        d = state.dims

        def mine(blocks: list[list[int]]) -> dist.ProcessGroup:
            groups = [(ranks, dist.new_group(ranks, backend="gloo")) for ranks in blocks]
            return next(g for ranks, g in groups if state.rank in ranks)

        world = dist.new_group(backend="gloo")
        return cls(world, mine([d.tp_ranks(p, q) for p in range(d.pp) for q in range(d.dp)]),
                   mine([d.pp_ranks(q, t) for q in range(d.dp) for t in range(d.tp)]),
                   mine([d.dp_ranks(p, t) for p in range(d.pp) for t in range(d.tp)]))


@dataclasses.dataclass
class Engine:
    """This rank's model (``modules``: the whole model, or its pipeline stages in local order),
    optimizer, schedule and the layout they run in. Build with :func:`build_engine`.

    ``full_logits``: the loss takes the logits of every position (``[B, T, V(/tp)]`` against the
    shifted labels, -100 ignored) instead of gathering the target positions first. The two give
    the same loss; sequence parallel needs every position, and XLA needs shapes that do not depend
    on the data (``XlaRuntime.prepare`` sets it). ``host``: the process groups for collectives on
    CPU tensors and Python objects (:class:`HostGroups`)."""

    state: ParallelState
    device: torch.device
    precision: str
    modules: list[nn.Module]
    config: DecoderConfig
    optimizer: ParallelOptimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    lora_config: Any = None
    lora_targets: list[str] = dataclasses.field(default_factory=list)
    lineage: str | None = None
    sequence_parallel: bool = False
    full_logits: bool = False
    host: HostGroups = dataclasses.field(default_factory=HostGroups)
    runner: Any = None  # PipelineRunner when pp > 1

    # ------------------------------------------------------------------ layout facts

    @property
    def model(self) -> nn.Module:
        """The whole model (pp == 1); NxdError under pipeline parallel, where a rank holds stages."""
        if self.runner is not None:
            raise NxdError("under pipeline parallel a rank holds stage modules, not the whole model")
        return self.modules[0]

    @property
    def is_logger(self) -> bool:
        """Global rank 0: prints, writes metrics and the final artefacts."""
        return self.state.rank == 0

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, de-duplicated, in module order."""
        return list(dict.fromkeys(p for m in self.modules for p in m.parameters()))

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> None:
        for m in self.modules:
            m.train(mode)

    # ------------------------------------------------------------------ losses

    def _ce_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross entropy over ``targets != -100``; logits ``[*, V]`` or ``[*, V/tp]``."""
        if self.state.tp_size > 1:
            return vocab_parallel_cross_entropy(logits, targets, self.state.tp_group).sum()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")

    def _logits_and_targets(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, targets)`` of a micro-batch on the whole model: only at target positions
        (``[N, V(/tp)]``, ``[N]``), or at every position with :attr:`full_logits`."""
        model = self.modules[0]
        if self.full_logits:
            logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))
            return logits, shift_labels(batch["labels"])
        index, targets = target_index(batch["labels"])
        logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"), logits_index=index)
        return logits, targets

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor, n_targets: Any) -> torch.Tensor:
        return self._ce_sum(logits, shift_labels(labels)) / n_targets

    def _stats(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``[loss sum, correct next-token predictions, targets]`` (fp32) of one eval batch."""
        mask = targets != IGNORE_INDEX
        loss = self._ce_sum(logits, targets).detach().float()
        full = all_gather(logits, -1, self.state.tp_group) if self.state.tp_size > 1 else logits
        correct = ((full.argmax(-1) == targets) & mask).sum().float()
        return torch.stack([loss, correct, mask.sum().float()])

    # ------------------------------------------------------------------ steps

    def forward_backward(self, micro_batches: list[Batch], n_targets: torch.Tensor) -> torch.Tensor:
        """Forward + backward of one optimizer step's micro-batches (on the device); gradients
        accumulate. Returns this dp rank's share of the step loss (detached; the same on every
        TP and PP rank of it): summing it over dp gives the step's token-mean loss."""
        with autocast(self.device, self.precision):
            if self.runner is not None:
                return self.runner.step(micro_batches, n_targets)
            total = torch.zeros((), device=self.device)
            for batch in micro_batches:
                logits, targets = self._logits_and_targets(batch)
                loss = self._ce_sum(logits, targets) / n_targets
                loss.backward()
                total += loss.detach()
            return total

    def step(self) -> torch.Tensor | None:
        """Gradient reductions, clipping, optimizer and LR steps, zeroed grads; returns the global
        gradient norm before clipping (None when clipping is off)."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.optimizer.grad_norm

    @torch.no_grad()
    def eval_stats(self, batch: Batch) -> torch.Tensor:
        """``[loss sum, correct, targets]`` of one eval batch on this dp rank (sum over batches and
        dp ranks, then divide)."""
        with autocast(self.device, self.precision):
            if self.runner is not None:
                return self.runner.eval_step(batch)
            return self._stats(*self._logits_and_targets(batch))

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the data-parallel group (a new tensor; ``t`` itself at dp == 1)."""
        if self.state.dp_size == 1:
            return t
        out = t.detach().clone()
        dist.all_reduce(out, group=self.state.dp_group)
        return out


# ---------------------------------------------------------------------- building


def _checkpoint_spec(parallel: Any) -> Any:
    """``parallel.activation_checkpointing`` as :func:`apply_activation_checkpointing` takes it."""
    mode = parallel.activation_checkpointing
    if mode == "none":
        return None
    if mode == "full":
        return "full"
    from nxd_finetune.models import llama

    names = parallel.checkpoint_modules or ["DecoderLayer"]
    classes = []
    for name in names:
        cls = getattr(llama, name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise NxdError(f"parallel.checkpoint_modules: {name!r} is not a module type of the model "
                           "(use DecoderLayer, Attention, MLP or RMSNorm)")
        classes.append(cls)
    return tuple(classes)


def _param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def build_engine(recipe: Any, model_dir: Path, device: torch.device, total_steps: int,
                 state: ParallelState | None = None, host: HostGroups | None = None) -> Engine:
    """This rank's :class:`Engine` (see the module docstring). Collective when a process group is
    initialised: every rank calls it with the same recipe. ``state`` / ``host``: the layout's
    groups when the caller has made them already (the trainer needs them before the engine), else
    they are made here. The global RNG is seeded here with ``training.seed``. Raises NxdError (one
    line) for layouts the model or precision cannot take."""
    par, tcfg = recipe.parallel, recipe.training
    if state is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        state = ParallelState(ParallelDims.for_world(world, tp=par.tp, pp=par.pp))
    host = host if host is not None else HostGroups.for_state(state)
    config = DecoderConfig.from_hf(model_dir)
    precision = tcfg.precision
    dtype = torch.bfloat16 if precision == "bf16" else resolve_dtype(recipe.model.dtype)
    if recipe.lora is None and dtype != torch.float32 and precision != "bf16":
        raise NxdError(f"full SFT with model.dtype={recipe.model.dtype} needs training.precision=bf16 "
                       "(or model.dtype=fp32 with bf16-mixed for fp32 master weights)")
    torch.manual_seed(tcfg.seed)
    model = build_model(config)
    if state.tp_size > 1:
        apply_tp_plan(model, tp_plan_for(config), state, sequence_parallel=par.sequence_parallel)
    lora_cfg, targets = None, []
    if recipe.lora is not None:
        from nxd_finetune.lora import inject_lora
        from nxd_finetune.sft.build import lora_config_from_recipe

        lora_cfg = lora_config_from_recipe(recipe.lora)
        for p in model.parameters():
            p.requires_grad_(False)
        targets = inject_lora(model, lora_cfg)
    if state.pp_size > 1:
        from nxd_finetune.parallel.pipeline import build_stages

        modules = build_stages(model, state, par.virtual_stages, par.pp_cuts)
    else:
        modules = [model]
    for m in modules:
        materialize(m, model_dir, dtype=dtype, device="cpu", reader=make_slice_reader(m),
                    name_map=checkpoint_name_map(m))
    lineage = _finish_lora(recipe, model, modules, lora_cfg, config, precision)
    del model  # under pp, the layers no stage of this rank holds go with it
    spec = _checkpoint_spec(par)
    for m in modules:
        apply_activation_checkpointing(m, spec)
        m.to(device)
    engine = Engine(state, device, precision, modules, config, None, None, lora_cfg, targets, lineage,  # type: ignore[arg-type]
                    par.sequence_parallel, full_logits=par.sequence_parallel, host=host)
    _build_optimizer(engine, recipe, total_steps)
    if state.pp_size > 1:
        from nxd_finetune.parallel.pipeline import PipelineRunner

        engine.runner = PipelineRunner(modules, state, par.pp_schedule, n_microbatches=recipe.grad_accum_steps,
                                       loss_fn=engine._pipeline_loss, stats_fn=engine._stats)
        engine.optimizer.not_counted = engine.runner.not_counted_parameters()
    return engine


def _finish_lora(recipe: Any, model: nn.Module, modules: list[nn.Module], lora_cfg: Any, config: DecoderConfig,
                 precision: str) -> str | None:
    """Master dtype of the adapter (fp32 unless pure bf16) and ``lora.init_from``; returns lineage."""
    if lora_cfg is None:
        return None
    from nxd_finetune.lora import cast_adapter_params

    for m in modules:
        cast_adapter_params(m, torch.bfloat16 if precision == "bf16" else torch.float32)
    if not recipe.lora.init_from:
        return None
    from nxd_finetune.sft.init_from import init_lora_from

    # the whole (partly unmaterialised) model: the adapter file names every layer; this rank's
    # stages share their modules with it, so they receive their factors
    return init_lora_from(model, lora_cfg, recipe.lora.init_from, config=config, revision=recipe.model.revision)


def _build_optimizer(engine: Engine, recipe: Any, total_steps: int) -> None:
    t, par = recipe.training, recipe.parallel
    params = engine.trainable()
    if not params and engine.state.world_size == 1:
        raise NxdError("the model has no trainable parameters (check lora.target_modules / modules_to_save)")
    opt_cfg = {"zero_one_enabled": par.zero1, "grad_clipping": bool(t.grad_clip),
               "max_grad_norm": t.grad_clip or 0.0, "grad_reduction": "sum"}
    nxd = NxDConfig(par.tp, par.pp, None, opt_cfg, None, par.sequence_parallel, dict(MODEL_INIT_DEFAULTS),
                    engine.lora_config, engine.state, engine.device, model=nn.ModuleList(engine.modules))
    engine.optimizer = ParallelOptimizer(nxd, torch.optim.AdamW, _param_groups(params, t.weight_decay),
                                         lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    engine.scheduler = torch.optim.lr_scheduler.LambdaLR(
        engine.optimizer, lambda s: lr_factor(s, total_steps, t.warmup_steps, t.scheduler, t.min_lr_ratio))

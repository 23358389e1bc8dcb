"""What one training process holds and does, for every parallel layout (world size 1 included).

:func:`build_engine` turns a recipe into this rank's share of the run, complete:

1. the model built on the meta device (the global RNG seeded with ``training.seed``), handed to
   the one assembly, :func:`nxd_finetune.parallel.parallelize.parallelize_model` (TP plan -> LoRA
   injected through :class:`ModelHooks` -> pipeline stages -> this rank's checkpoint slices ->
   adapter master dtype and ``lora.init_from`` -> activation checkpointing -> device; the pipeline
   runner at ``pp > 1``). LoRA factors are real CPU tensors drawn from the global RNG exactly as
   at tp=1, so every layout starts from the same adapter;
2. AdamW over the trainable parameters (no decay on 1-D tensors) inside a
   :class:`~nxd_finetune.parallel.optimizer.ParallelOptimizer`: TP-replicated gradient sums, the
   data-parallel *sum* (losses are already divided by the global target count), ZeRO-1 when
   ``parallel.zero1``, clipping over tp/pp/dp; the warmup + decay LambdaLR.

The :class:`Engine` then runs one optimizer step's forward/backward (:meth:`Engine.forward_backward`:
plain micro-batch loop, or the pipeline schedule), the optimizer step (:meth:`Engine.step`) and
eval statistics (:meth:`Engine.eval_stats`); every loss comes from :mod:`nxd_finetune.loss`, and
the objective (:mod:`nxd_finetune.objective`) is handed to each call, not held.
Outside pipeline parallel, logits are computed only at target positions (``logits_index``),
which SFT's masked prompts make a large saving, unless :attr:`Engine.full_logits` asks for every
position (sequence parallel; fixed shapes on XLA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune.device import compile_gap
from nxd_finetune.errors import NxdError
from nxd_finetune.lora import LoraConfig, base_param_name, cast_adapter_params, inject_lora
from nxd_finetune.lora.dora import init_dora_magnitudes
from nxd_finetune.lora.quantized import (
    QuantSpec,
    quantize_base,
    quantize_on_load,
    require_bitsandbytes,
)
from nxd_finetune.lora.quantized_embedding import quantize_embeddings, quantize_embeddings_on_load
from nxd_finetune.loss import ChunkedScores, LogitScores, Scores, chunk_rows, shift_labels, target_index
from nxd_finetune.models import DecoderConfig, DecoderForCausalLM, build_model, llama, resolve_dtype
from nxd_finetune.models.moe import record_router_logits, router_aux_loss
from nxd_finetune.models.shared_prefix import can_share_prefix, shared_prefix_hidden
from nxd_finetune.objective import Objective, SideData, TokenBatch, maxed_entries
from nxd_finetune.parallel.data_parallel import dp_sum
from nxd_finetune.parallel.optimizer import ParallelOptimizer
from nxd_finetune.parallel.parallelize import (
    CheckpointSpec,
    ModelHooks,
    ParallelizeSpec,
    RankModel,
    WeightSource,
    parallelize_model,
)
from nxd_finetune.parallel.pipeline import PipelineRunner
from nxd_finetune.parallel.recompute import recording_graph
from nxd_finetune.parallel.state import Layout, ParallelState
from nxd_finetune.sft.init_from import StartAdapter, init_lora_from
from nxd_finetune.sft.schedule import lr_factor
from nxd_finetune.sft.step import backward_micro_batches

if TYPE_CHECKING:
    from nxd_finetune.recipe import ParallelSection, Recipe, TrainingSection

Batch = TokenBatch
Head = Callable[[torch.Tensor], torch.Tensor]  # the output layer as a loss runs it: DecoderForCausalLM.head


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """bf16 autocast for ``bf16`` / ``bf16-mixed``; nothing for fp32."""
    if precision in ("bf16", "bf16-mixed"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclasses.dataclass
class Engine:
    """This rank's model (``rank_model``: the whole model, or its pipeline stages and their
    runner), optimizer, schedule and the layout they run in. Build with :func:`build_engine`.

    ``full_logits``: the loss takes the logits of every position (``[B, T, V(/tp)]`` against the
    shifted labels, -100 ignored) instead of gathering the target positions first. The two give
    the same loss; sequence parallel needs every position, and XLA needs shapes that do not depend
    on the data (``XlaRuntime.prepare`` sets it).
    ``start_adapter``: what ``lora.init_from`` resolved to (its source, pinned registry REF and
    weights digest: :class:`~nxd_finetune.sft.init_from.StartAdapter`), None without one.
    ``loss_chunk_rows``: target positions whose logits the loss computes at once (None: all of a
    micro-batch's). ``aux_loss``: the router auxiliary loss of the micro-batches since the last
    :meth:`take_aux_loss`, each weighted by its share of its step's units (a mixture-of-experts
    model with ``output_router_logits``; detached)."""

    rank_model: RankModel
    device: torch.device
    precision: str
    config: DecoderConfig
    optimizer: ParallelOptimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    lora_config: LoraConfig | None = None
    lora_targets: list[str] = dataclasses.field(default_factory=list)
    start_adapter: StartAdapter | None = None
    sequence_parallel: bool = False
    full_logits: bool = False
    loss_chunk_rows: int | None = None
    aux_loss: torch.Tensor | None = None

    # ------------------------------------------------------------------ layout facts

    @property
    def state(self) -> ParallelState:
        return self.rank_model.state

    @property
    def modules(self) -> list[nn.Module]:
        return self.rank_model.modules

    @property
    def runner(self) -> PipelineRunner | None:
        return self.rank_model.runner

    @property
    def model(self) -> nn.Module:
        """The whole model (pp == 1); NxdError under pipeline parallel, where a rank holds stages."""
        if self.runner is not None:
            raise NxdError("under pipeline parallel a rank holds stage modules, not the whole model")
        return self.modules[0]

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The group the logits' vocabulary is sharded over (None without tensor parallel)."""
        return self.state.group("tp") if self.state.size("tp") > 1 else None

    @property
    def lineage(self) -> str | None:
        """The pinned registry REF ``lora.init_from`` pulled, None otherwise."""
        return self.start_adapter.lineage if self.start_adapter is not None else None

    @property
    def is_logger(self) -> bool:
        """Global rank 0: prints, writes metrics and the final artefacts."""
        return self.state.rank == 0

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, de-duplicated, in module order."""
        return self.rank_model.parameters()

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def train(self, mode: bool = True) -> None:
        for m in self.modules:
            m.train(mode)

    # ------------------------------------------------------------------ steps

    def logits_and_targets(self, batch: Batch, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, targets)`` of a micro-batch on the whole model against ``labels`` (default the
        batch's): only at target positions (``[N, V(/tp)]``, ``[N]``), or at every position with
        :attr:`full_logits`."""
        logits, targets, _ = self._logits_at(batch, batch["labels"] if labels is None else labels)
        return logits, targets

    def _logits_at(self, batch: Batch, labels: torch.Tensor,
                   every_position: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`logits_and_targets` and the targets' flat positions (None: every position, with
        :attr:`full_logits` or ``every_position``)."""
        model = self.modules[0]
        if self.full_logits or every_position:
            logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"))
            return logits, shift_labels(labels), None
        index, targets = target_index(labels)
        logits = model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"), logits_index=index)
        return logits, targets, index

    def scores(self, batch: Batch, labels: torch.Tensor, every_position: bool = False) -> Scores:
        """A micro-batch's model output on the whole model as the objective reads it, against the
        objective's ``labels`` (:meth:`Objective.labels`): logits at the target positions (or every
        position with :attr:`full_logits`), or with :attr:`loss_chunk_rows` the final hidden states
        there, the output layer running a chunk of positions at a time (:class:`loss.ChunkedScores`:
        no ``[targets, vocab]`` logits). ``every_position``: the model runs every position through
        its last layer (the router auxiliary loss needs each layer's router on every token).
        Rows that share a prompt (GRPO's micro-batches carry ``prompt_lengths``) run it once where
        :meth:`_shares_prefix` allows (:mod:`nxd_finetune.models.shared_prefix`)."""
        shared = not (self.full_logits or every_position) and self._shares_prefix(batch)
        if not shared and (self.full_logits or every_position or self.loss_chunk_rows is None):
            logits, targets, index = self._logits_at(batch, labels, every_position)
            return LogitScores(logits, targets, self.tp_group, index)
        hidden, head, targets, index = self._hidden_and_targets(batch, labels, shared)
        if self.loss_chunk_rows is None:
            return LogitScores(head(hidden), targets, self.tp_group, index)
        return ChunkedScores(hidden, head, targets, self.loss_chunk_rows, self.tp_group, index)

    def scores_and_side(self, batch: Batch, objective: Objective) -> tuple[Scores, SideData]:
        """The micro-batch's scores on the whole model and ``objective``'s side data (whose labels
        they are scored on)."""
        side = objective.side(batch)
        return self.scores(batch, objective.labels(side)), side

    def _shares_prefix(self, batch: Batch) -> bool:
        """Whether the micro-batch's rows that share a prompt (``prompt_lengths``, GRPO's) run it
        once (:mod:`nxd_finetune.models.shared_prefix`)."""
        return ("prompt_lengths" in batch and "n_tokens" in batch and self.runner is None
                and can_share_prefix(self.modules[0], batch["input_ids"].shape[1]))

    def _hidden_and_targets(self, batch: Batch, labels: torch.Tensor,
                            shared: bool = False) -> tuple[torch.Tensor, Head, torch.Tensor, torch.Tensor]:
        """Final hidden states at the target positions of ``labels`` ``[N, H]``, the output layer,
        the targets and their flat positions (:func:`loss.target_index`). ``shared``: each distinct
        prompt of the rows run once (:func:`shared_prefix_hidden`)."""
        model = self.modules[0]
        assert isinstance(model, DecoderForCausalLM) and model.lm_head is not None  # pp == 1: the whole decoder
        index, targets = target_index(labels)
        if shared:
            hidden = shared_prefix_hidden(model, batch["input_ids"], batch["prompt_lengths"], batch["n_tokens"], index)
        else:
            hidden = model.model(batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"), index)
        return hidden, model.head, targets, index  # lm_head and the final soft-cap (Gemma 2)

    def forward_backward(self, micro_batches: Sequence[Batch], n_targets: torch.Tensor, objective: Objective,
                         backward: Callable[[torch.Tensor], None] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward + backward of ``objective`` over one optimizer step's micro-batches (on the
        device); gradients accumulate. ``n_targets``: the objective's units of the whole step (all
        micro-batches and dp ranks). ``backward(loss)``: how a micro-batch loss is backpropagated
        (default ``loss.backward()``; Lightning's ``manual_backward``); the pipeline schedule runs
        its own. Returns this dp rank's share of the step loss (detached; the same on every TP and
        PP rank of it): summing it over dp gives the step's mean loss; and the objective's metric
        sums over the micro-batches (None when it has none)."""
        with autocast(self.device, self.precision):
            aux = self.config.num_experts > 0 and self.config.output_router_logits
            if self.runner is not None:  # the last stage adds the router auxiliary loss (pipeline_io)
                out = self.runner.train_step(micro_batches, n_targets, objective)
                self._add_aux_loss(self.runner.take_aux_loss())
                return out
            n_targets = n_targets.to(self.device)
            loss = (functools.partial(self._loss_with_aux, objective=objective, n_targets=n_targets) if aux
                    else lambda batch: objective.loss(*self.scores_and_side(batch, objective)))
            return backward_micro_batches(micro_batches, n_targets, loss, backward or torch.Tensor.backward,
                                          maxed_entries(objective))

    def _loss_with_aux(self, batch: Batch, objective: Objective,
                       n_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``objective``'s loss sum of a micro-batch plus ``router_aux_loss_coef`` x its router
        auxiliary loss x its units: divided by the step's ``n_targets`` it adds ``coef x aux``
        weighted by the micro-batch's share of the step, which is transformers' ``loss`` (token-mean
        cross entropy + ``coef x aux``) when the step is one micro-batch. The tokens of segment 0
        (packed rows' padding) are left out, as transformers' attention mask leaves padding out;
        unpacked rows carry no segment ids, and their right padding counts."""
        model = self.model
        # checkpointed layers record their graph here (non-reentrant recompute), so the router
        # logits they record carry it and the auxiliary loss reaches the router
        with record_router_logits(model) as logits, recording_graph():
            side = objective.side(batch)
            scores = self.scores(batch, objective.labels(side), every_position=True)
        loss_sum, stats = objective.loss(scores, side)
        segments = batch.get("segment_ids")
        aux = router_aux_loss(model, logits, None if segments is None else segments > 0).to(loss_sum.dtype)
        units = objective.count(batch).to(loss_sum.dtype)
        self._add_aux_loss((aux * units / n_targets).detach())
        return loss_sum + self.config.router_aux_loss_coef * aux * units, stats

    def _add_aux_loss(self, share: torch.Tensor | None) -> None:
        """Add a router auxiliary loss ``share`` (None: none) to :attr:`aux_loss`."""
        if share is not None:
            self.aux_loss = share if self.aux_loss is None else self.aux_loss + share

    def take_aux_loss(self) -> torch.Tensor | None:
        """:attr:`aux_loss` (None: none recorded), reset."""
        out, self.aux_loss = self.aux_loss, None
        return out

    def step(self) -> torch.Tensor | None:
        """Gradient reductions, clipping, optimizer and LR steps, zeroed grads; returns the global
        gradient norm before clipping (None when clipping is off)."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.optimizer.grad_norm

    @torch.no_grad()
    def eval_stats(self, batch: Batch, objective: Objective) -> torch.Tensor:
        """``objective``'s eval statistics of one batch on this dp rank (supervised: ``[loss sum,
        correct, targets]``; summed over batches and dp ranks, then :meth:`Objective.eval_record`)."""
        with autocast(self.device, self.precision):
            if self.runner is not None:
                return self.runner.eval_step(batch, objective)
            return objective.eval_stats(*self.scores_and_side(batch, objective))

    def dp_sum(self, t: torch.Tensor, maxed: int = 0) -> torch.Tensor:
        """``t`` summed over the data-parallel group (a new tensor; ``t`` itself at dp == 1; the
        last ``maxed`` entries: their maximum)."""
        return dp_sum(t, self.state, maxed)


# ---------------------------------------------------------------------- building


def checkpoint_spec(parallel: ParallelSection) -> CheckpointSpec:
    """``parallel.activation_checkpointing`` (+ ``checkpoint_modules``) as the assembly takes it."""
    mode = parallel.activation_checkpointing
    if mode == "none":
        return None
    if mode == "full":
        return "full"
    classes: list[type[nn.Module]] = []
    for name in parallel.checkpoint_modules or ["MLP"]:
        cls = getattr(llama, name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise NxdError(f"parallel.checkpoint_modules: {name!r} is not a module type of the model "
                           "(use DecoderLayer, Attention, MLP or RMSNorm)")
        classes.append(cls)
    return tuple(classes)


def _lora_hooks(recipe: Recipe, config: DecoderConfig, lora_cfg: LoraConfig, targets: list[str],
                started: list[StartAdapter | None], model_dir: Path, warn: bool, device: torch.device) -> ModelHooks:
    """Freeze the base and inject LoRA (its names -> ``targets``); after the weights: the adapter's
    master dtype (fp32 unless pure bf16), ``lora.init_from`` (what it resolved to -> ``started[0]``)
    and, with ``model.quantization``, the frozen linears quantized on ``device`` (this rank's shards),
    each as soon as its weight is read."""
    quant = recipe.model.quantization
    spec = None if quant is None else QuantSpec.from_section(quant)
    on_load: list[Callable[[nn.Module, str], None]] = []

    def inject(model: nn.Module) -> None:
        for p in model.parameters():
            p.requires_grad_(False)
        targets.extend(inject_lora(model, lora_cfg))
        if spec is not None:  # the embedding first (model.quantization.embeddings), then the linears
            on_load.extend([quantize_embeddings_on_load(model, spec, device), quantize_on_load(model, spec, device)])

    def tensor_loaded(module: nn.Module, attr: str) -> None:
        for hook in on_load:
            hook(module, attr)

    def loaded(model: nn.Module, modules: list[nn.Module]) -> None:
        for m in modules:
            cast_adapter_params(m, torch.bfloat16 if recipe.training.precision == "bf16" else torch.float32)
        assert recipe.lora is not None
        if recipe.lora.init_from:
            # the whole (partly unmaterialised) model: the adapter file names every layer; this
            # rank's stages share their modules with it, so they receive their factors
            started[0] = init_lora_from(model, lora_cfg, recipe.lora.init_from, config=config,
                                        model_dir=model_dir, revision=recipe.model.revision,
                                        allow_other_base=recipe.lora.allow_other_base, warn=warn)
        if spec is not None:  # what was not read from a checkpoint tensor by tensor
            for m in modules:
                quantize_base(m, spec, device)
                quantize_embeddings(m, spec, device)  # model.quantization.embeddings (tied: one weight)
        # lora.use_dora: m = ||W|| now that W is read (and quantized: the dequantized W's norm, as peft)
        init_dora_magnitudes(*modules)

    return ModelHooks(inject=inject, checkpoint_key=base_param_name, loaded=loaded, tensor_loaded=tensor_loaded)


def _param_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": no_decay, "weight_decay": 0.0}) if g["params"]]


def _optimizer(rank_model: RankModel, t: TrainingSection, zero1: bool,
               total_steps: int) -> tuple[ParallelOptimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in rank_model.parameters() if p.requires_grad]
    if not params and rank_model.state.world_size == 1:
        raise NxdError("the model has no trainable parameters (check lora.target_modules / modules_to_save)")
    optimizer = ParallelOptimizer(torch.optim.AdamW, _param_groups(params, t.weight_decay),
                                  state=rank_model.state, model=nn.ModuleList(rank_model.modules), zero1=zero1,
                                  grad_reduction="sum", max_grad_norm=t.grad_clip or None,
                                  not_counted=rank_model.not_counted(), lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total_steps, t.warmup_steps, t.scheduler, t.min_lr_ratio))
    return optimizer, scheduler


def _check_compile(device: torch.device, backend: str = "inductor") -> None:
    """NxdError (one line) where ``model.compile`` with ``backend`` cannot run on ``device``
    (:func:`nxd_finetune.device.compile_gap`: xla compiles the step's graph itself, a backend
    torch._dynamo does not have here, inductor without code generation for the device or, on the
    host, without the C++ compiler it builds kernels with)."""
    gap = compile_gap(device.type, backend)
    if gap is not None:
        raise NxdError(gap)


def build_engine(recipe: Recipe, model_dir: Path, device: torch.device, total_steps: int,
                 state: ParallelState | None = None) -> Engine:
    """This rank's :class:`Engine` (see the module docstring). Collective when a process group is
    initialised: every rank calls it with the same recipe. ``state``: the layout's
    groups (device and host) when the caller has made them already (the trainer needs them before the engine), else
    they are made here. Raises NxdError (one line) for layouts the model or precision cannot take."""
    par, tcfg = recipe.parallel, recipe.training
    if state is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        state = ParallelState(Layout.for_world(world, tp=par.tp, pp=par.pp, ep=par.ep))
    config = DecoderConfig.from_hf(model_dir)
    precision = tcfg.precision
    dtype = torch.bfloat16 if precision == "bf16" else resolve_dtype(recipe.model.dtype)
    if recipe.lora is None and dtype != torch.float32 and precision != "bf16":
        raise NxdError(f"full SFT with model.dtype={recipe.model.dtype} needs training.precision=bf16 "
                       "(or model.dtype=fp32 with bf16-mixed for fp32 master weights)")
    torch.manual_seed(tcfg.seed)
    lora_cfg: LoraConfig | None = None
    targets: list[str] = []
    started: list[StartAdapter | None] = [None]
    hooks = None
    if recipe.lora is not None:
        lora_cfg = LoraConfig.from_section(recipe.lora)
        if recipe.model.quantization is not None:
            require_bitsandbytes()
        hooks = _lora_hooks(recipe, config, lora_cfg, targets, started, model_dir, warn=state.rank == 0,
                            device=device)
    rows = chunk_rows(config.vocab_size // state.size("tp"), tcfg.loss_chunk_tokens)
    spec = ParallelizeSpec(sequence_parallel=par.sequence_parallel, virtual_stages=par.virtual_stages,
                           pp_cuts=par.pp_cuts, pp_schedule=par.pp_schedule, n_microbatches=recipe.grad_accum_steps,
                           activation_checkpointing=checkpoint_spec(par), loss_chunk_rows=rows)
    if recipe.model.attention == "flex" and device.type != "cuda":
        raise NxdError(f"model.attention=flex trains on CUDA only (training.device resolves to {device.type}): "
                       "torch's FlexAttention has no backward on CPU; use model.attention=auto or sdpa")
    backend = llama.compile_backend(recipe.model.compile)
    if backend is not None:
        _check_compile(device, backend)
    model = build_model(config)
    model.set_attention(recipe.model.attention)
    model.set_compile(recipe.model.compile)
    # a quantized base is read without the checkpoint's memory map: the pages each quantization reads
    # would stay resident until the file closes (the base in the file's dtype, beside its quantization)
    weights = WeightSource(model_dir, dtype, mapped=recipe.model.quantization is None)
    rank_model = parallelize_model(model, state, spec=spec, weights=weights,
                                   device=device, hooks=hooks)
    optimizer, scheduler = _optimizer(rank_model, tcfg, par.zero1, total_steps)
    return Engine(rank_model, device, precision, config, optimizer, scheduler, lora_cfg, targets,
                  started[0], par.sequence_parallel, full_logits=par.sequence_parallel, loss_chunk_rows=rows)

"""``NxdLightningModule``: a recipe's model, LoRA and data trained by a Lightning ``Trainer``.

The module is a thin layer over what every ``nxd-finetune run`` process builds (NxD Training's
``NeuronLTModule``): in ``configure_model`` (after :class:`~nxd_finetune.lightning.strategy.NxdStrategy`
has made the process groups) it builds the rank's :class:`~nxd_finetune.sft.engine.Engine` with
:func:`~nxd_finetune.sft.engine.build_engine` (the one assembly, ``parallelize_model``; the
:class:`~nxd_finetune.parallel.optimizer.ParallelOptimizer`, ZeRO-1 when the strategy says so; the
warmup + decay schedule) and the data of its data-parallel rank (``data.loader``), with the recipe's
``parallel`` section taking the strategy's sizes and ``training.precision`` the precision plugin's.

One ``training_step`` is one optimizer step, as in ``run`` (``sft/trainer.py``): the module's batch
source (:mod:`nxd_finetune.sft.source`; by default the recipe's train data) gives the step's
micro-batches (``training.grad_accum`` of them, or as ``global_batch_size`` says) inside the step,
while the train dataloader Lightning iterates only counts the steps; the target tokens of the step
are counted over every data-parallel rank; each micro-batch's token-summed cross-entropy
(:mod:`nxd_finetune.loss`, vocab-parallel at tp > 1) divided by that count goes through
``manual_backward``; the optimizer step (Lightning's, through the precision plugin) sums the
data-parallel gradients and clips; the LR scheduler steps. So the loss is the token mean over the
global batch whatever the split into micro-batches and ranks. Manual optimization because automatic
optimization would backward one loss per batch and could not see the step's global token count
(NxD's module is manual too).

Logged every step through ``self.log`` (progress bar, and any Lightning logger: ``CSVLogger``,
``TensorBoardLogger``): ``train_loss``, ``lr``, ``grad_norm``, ``tokens_per_s``, ``tokens``. At the
end of training the run's artefact is written with the recipe's ``checkpoint.save_mode`` to
``<output.dir>/final`` by the one exporter (:func:`nxd_finetune.export.export_model`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler

from nxd_finetune.checkpoint.run_state import RngState, RunState
from nxd_finetune.errors import NxdError
from nxd_finetune.export import export_model
from nxd_finetune.lightning.base import Batch, NxdModuleBase
from nxd_finetune.lightning.strategy import NxdStrategy
from nxd_finetune.metrics import METRICS_FILE
from nxd_finetune.parallel.optimizer import ParallelOptimizer
from nxd_finetune.parallel.state import ParallelState
from nxd_finetune.recipe import Recipe, load_recipe, recipe_from_dict
from nxd_finetune.sft.reference import attach_reference
from nxd_finetune.sft.setup import SourceFactory, loader_source, objective_source, setup_rank
from nxd_finetune.sft.source import source_metrics
from nxd_finetune.sft.trainer import export_spec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.data.loader import EvalLoader
    from nxd_finetune.sft.engine import Engine
    from nxd_finetune.sft.source import BatchSource


class StepTicks:
    """The train dataloader Lightning iterates: one item per optimizer step (its number, from 1),
    endless (the Trainer's ``max_steps`` ends training). The step's micro-batches come from the
    module's batch source inside ``training_step``, with the model as the previous step left it:
    Lightning fetches its dataloader a step ahead, which a source that generates with the model, or
    whose state a checkpoint saves after the step, must not be."""

    def __iter__(self) -> Iterator[int]:
        return itertools.count(1)


class NxdLightningModule(NxdModuleBase):
    """A recipe's run as a LightningModule. ``recipe``: a :class:`~nxd_finetune.recipe.Recipe` or
    a YAML path (with ``overrides``, ``key.path=value`` as on the command line). Train it with
    ``Trainer(strategy=NxdStrategy(...), devices=N, max_steps=...)`` (``max_steps`` -1: the
    recipe's ``training.max_steps``, or its epochs). The recipe's ``parallel.tp / pp / zero1 /
    nproc`` and ``training.precision`` are replaced by the strategy's and the precision plugin's;
    its ``checkpoint`` (but ``save_mode``) and ``logging`` sections and ``eval.every_n_steps`` are
    Lightning's business here (callbacks, loggers, ``val_check_interval``) and not read; the eval
    set is the validation dataloader (``eval.max_batches`` per rank); ``output.registry`` is an NxdError.
    ``source``: makes the rank's batch source (:mod:`nxd_finetune.sft.source`) from its
    :class:`~nxd_finetune.sft.setup.RankRun` (None: the recipe's train data), as ``run``'s.
    """

    def __init__(self, recipe: Recipe | str | os.PathLike, overrides: Sequence[str] = (),
                 source: SourceFactory | None = None) -> None:
        super().__init__()
        self.recipe: Recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe, list(overrides))
        self.engine: Engine | None = None
        self.layers: torch.nn.ModuleList | None = None  # the engine's modules, registered for Lightning
        self._make_source = source or objective_source(self.recipe) or loader_source
        self._source: BatchSource | None = None
        self._eval: EvalLoader | None = None  # the recipe's eval loader (None: no eval data)
        self._eval_stats: torch.Tensor | None = None
        self._model_dir: Path | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None

    # ------------------------------------------------------------------ building

    def _recipe_for(self, strategy: NxdStrategy, device: torch.device) -> Recipe:
        """The recipe with the strategy's layout, the plugin's precision, the trainer's max_steps."""
        data = self.recipe.to_dict()
        data["parallel"].update(nproc=strategy.world_size, tp=strategy.tensor_parallel_size,
                                pp=strategy.pipeline_parallel_size, zero1=strategy.zero1)
        if strategy.sequence_parallel is not None:
            data["parallel"]["sequence_parallel"] = strategy.sequence_parallel
        data["training"].update(precision=strategy.nxd_precision, device=device.type)
        if self.trainer.max_steps > 0:
            data["training"]["max_steps"] = self.trainer.max_steps
        return recipe_from_dict(data, "lightning")

    def configure_model(self) -> None:
        """Build this rank's engine and data (collective; once)."""
        if self.engine is not None:
            return
        strategy = self.trainer.strategy
        if not isinstance(strategy, NxdStrategy):
            raise NxdError(f"NxdLightningModule trains under Trainer(strategy=NxdStrategy(...)), "
                           f"not {type(strategy).__name__}")
        device = strategy.root_device
        if device.type not in ("cpu", "cuda"):
            raise NxdError(f"NxdLightningModule runs on cpu or cuda, not {device.type}: use `nxd-finetune run` on XLA")
        if self.recipe.parallel.ep > 1:
            raise NxdError(f"parallel.ep={self.recipe.parallel.ep} is not supported under Lightning (NxdStrategy "
                           "has no expert-parallel axis): train with `nxd-finetune run`, or set parallel.ep=1")
        if self.recipe.output.registry:
            raise NxdError("output.registry is not published under Lightning: push the exported adapter with "
                           "`nxd-finetune adapters push <output.dir>/final ...` after trainer.fit")
        recipe = self.recipe = self._recipe_for(strategy, device)
        layout = strategy.parallel_state
        assert layout is not None
        rr = setup_rank(recipe, device=device, layout=layout, source=self._make_source)
        self.objective = rr.objective
        attach_reference(recipe, rr.engine, rr.data, rr.model_dir)  # preference: reference log-probs, before training
        if self.trainer.max_steps < 0:
            self.trainer.fit_loop.epoch_loop.max_steps = rr.total_steps
        # the step stream is one endless epoch (max_steps ends it), whatever max_epochs Lightning derived:
        # -1 under Trainer(max_steps=N), whose bar read "Epoch 0/-2", or 1000 by default ("Epoch 0/999")
        self.trainer.fit_loop.max_epochs = 1
        self._model_dir, self._tokenizer = rr.model_dir, rr.tokenizer
        self.engine = rr.engine
        self.layers = torch.nn.ModuleList(self.engine.modules)
        self._source = rr.source
        self._eval = rr.data.eval

    def configure_optimizers(self) -> OptimizerLRScheduler:
        """The engine's :class:`ParallelOptimizer` and its LR schedule (stepped every step)."""
        assert self.engine is not None, "configure_model builds the engine first"
        return {"optimizer": self.engine.optimizer,
                "lr_scheduler": {"scheduler": self.engine.scheduler, "interval": "step"}}

    def step_metrics(self) -> dict[str, float]:
        assert self._source is not None
        return source_metrics(self._source)

    def train_dataloader(self) -> StepTicks:
        assert self._source is not None, "configure_model builds the data first"
        return StepTicks()

    # ------------------------------------------------------------------ training

    @property
    def rank_modules(self) -> list[torch.nn.Module]:
        assert self.engine is not None
        return self.engine.modules

    @property
    def parallel_optimizer(self) -> ParallelOptimizer:
        assert self.engine is not None
        return self.engine.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        assert self.engine is not None
        return self.engine.scheduler

    @property
    def parallel_state(self) -> ParallelState:
        assert self.engine is not None
        return self.engine.state

    def training_step(self, batch: int, batch_idx: int) -> torch.Tensor:
        """One optimizer step (module docstring): the batch source's next step, ``run``'s step on
        the engine; returns the step's token-mean loss over the global batch (detached; the same on
        every rank). ``batch``: the step's number (:class:`StepTicks`)."""
        assert self.engine is not None and self._source is not None
        micro_batches, n_input = self._source.next_step(self.engine, self.train_state.step + 1)
        micro_batches = [{k: v.to(self.engine.device) for k, v in b.items()} for b in micro_batches]
        loss = self.lightning_step(self.engine, micro_batches, n_input)
        aux = self.engine.take_aux_loss()  # an MoE model with output_router_logits: the step's aux loss
        if aux is not None:
            value = float(self.engine.dp_sum(aux))
            self.history[-1]["aux_loss"] = value
            self.log("aux_loss", value, on_step=True, batch_size=1)
        return loss

    # ------------------------------------------------------------------ eval (Trainer's val_check_interval)

    def val_dataloader(self) -> EvalLoader | list[Batch]:
        """The recipe's eval set, each rank its share (an empty list without ``data.eval``)."""
        return self._eval if self._eval is not None else []

    def on_validation_epoch_start(self) -> None:
        assert self.engine is not None
        self._eval_stats = torch.zeros(self.objective.eval_width, device=self.engine.device)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        """``[loss sum, correct, targets]`` of a batch, summed (``eval.max_batches`` per rank, as ``run``)."""
        limit = self.recipe.eval.max_batches
        if limit is not None and batch_idx >= limit:
            return
        assert self.engine is not None and self._eval_stats is not None
        self._eval_stats += self.engine.eval_stats(batch, self.objective)

    def on_validation_epoch_end(self) -> None:
        """``eval_loss``, ``eval_ppl``, ``eval_accuracy`` over every dp rank's share, as ``run``'s."""
        assert self.engine is not None and self._eval_stats is not None
        rec = self.objective.eval_record(self.engine.dp_sum(self._eval_stats).tolist())
        if not rec or self.trainer.sanity_checking:
            return
        self.history.append({"step": self.train_state.step, **rec})
        self.log_dict(rec, prog_bar=True, batch_size=1)

    def on_train_end(self) -> None:
        """The run's artefact (``<output.dir>/final``, the recipe's save mode) by the one exporter
        (collective)."""
        e = self.engine
        assert e is not None and self._model_dir is not None
        export_model(e.rank_model, Path(self.recipe.output.dir) / "final",
                     export_spec(self.recipe, self._model_dir, self._tokenizer), config=e.config,
                     lora=e.lora_config, lora_targets=e.lora_targets, pp_group=e.state.host_group("pp"))

    # ------------------------------------------------------------------ checkpoints (strategy's hooks)

    def run_state(self, rng: RngState) -> RunState:
        """A checkpoint's state with every field ``run`` resumes from."""
        assert self._source is not None
        saved = super().run_state(rng)
        metrics = Path(self.recipe.output.dir) / METRICS_FILE
        saved.data = self._source.state_dict()  # as of the last step trained
        saved.metrics_bytes = metrics.stat().st_size if metrics.exists() else 0
        saved.recipe = self.recipe.to_yaml()
        return saved

    def restore_run_state(self, saved: RunState) -> None:
        """Counters, history and the batch source's state of a checkpoint (before training)."""
        assert self._source is not None
        super().restore_run_state(saved)
        if saved.data is not None:  # None: a model-function module's checkpoint (its data was the user's)
            self._source.load_state_dict(saved.data)

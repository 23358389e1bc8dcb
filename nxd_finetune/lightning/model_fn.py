"""``NxdModelModule``: a model function and an NxD config under Lightning (NxD's ``NeuronLTModule``).

For training code that brings its own model function and data instead of a recipe::

    config = {"tensor_parallel_size": 2, "optimizer_config": {"zero_one_enabled": False, "max_grad_norm": 1.0},
              "model_init_config": {"meta_device_init": True, "checkpoint": model_dir},
              "lora_config": LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")}
    module = NxdModelModule(build_model, model_args=(DecoderConfig.from_hf(model_dir),),
                            opt_cls=torch.optim.AdamW, opt_kwargs={"lr": 2e-3},
                            scheduler_cls=torch.optim.lr_scheduler.LambdaLR, scheduler_kwargs={"lr_lambda": f})
    pl.Trainer(devices=2, strategy=NxdStrategy(nxd_config=config), max_steps=100).fit(module, loader)

The strategy builds the config with :func:`~nxd_finetune.api.neuronx_distributed_config` once the
processes are up; ``configure_model`` hands the model function to
:func:`~nxd_finetune.api.initialize_parallel_model` (the one assembly) and the trainable
parameters to :func:`~nxd_finetune.api.initialize_parallel_optimizer`. The data-parallel gradient
reduction is always a *sum*: ``training_step`` divides every micro-batch's token-summed loss by the
step's target tokens over all data-parallel ranks (``run``'s loss), whatever ``grad_reduction`` says.

A batch is one optimizer step: a list of micro-batch dicts (``input_ids``, ``labels`` with -100
where no loss; ``position_ids`` / ``segment_ids`` for packed rows), or one dict. The dataloader
gives each data-parallel rank its share (``DataLoader`` s get a ``DistributedSampler`` over the
dp ranks from the strategy). Override :meth:`NxdModelModule.forward_logits` for a model whose
``forward`` takes other arguments. Checkpoints hold the parameters, optimizer, scheduler, counters
and RNG (the dataloader's position is the user's).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import nn

from nxd_finetune.api import initialize_parallel_model, initialize_parallel_optimizer
from nxd_finetune.errors import NxdError
from nxd_finetune.lightning.base import Batch, NxdModuleBase
from nxd_finetune.lightning.strategy import NxdStrategy
from nxd_finetune.loss import LogitScores, shift_labels
from nxd_finetune.objective import Objective, TokenBatch, maxed_entries
from nxd_finetune.parallel.optimizer import ParallelOptimizer
from nxd_finetune.parallel.state import ParallelState
from nxd_finetune.parallel.zero1 import Hyperparameter
from nxd_finetune.sft.step import backward_micro_batches


class NxdModelModule(NxdModuleBase):
    """``model_fn(*model_args, **model_kwargs)`` trained with ``opt_cls(params, **opt_kwargs)``
    and, optionally, ``scheduler_cls(optimizer, *scheduler_args, **scheduler_kwargs)`` stepped
    every optimizer step, in the layout of ``Trainer(strategy=NxdStrategy(nxd_config=...))``.
    ``seed``: the global RNG is seeded with it before the model is built (LoRA factors)."""

    def __init__(self, model_fn: Callable[..., nn.Module], opt_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 scheduler_cls: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None, *,
                 model_args: Sequence[object] = (), model_kwargs: Mapping[str, object] | None = None,
                 opt_kwargs: Mapping[str, Hyperparameter] | None = None,
                 scheduler_args: Sequence[object] = (), scheduler_kwargs: Mapping[str, object] | None = None,
                 seed: int | None = None) -> None:
        super().__init__()
        self.model_fn, self.model_args, self.model_kwargs = model_fn, tuple(model_args), dict(model_kwargs or {})
        self.opt_cls, self.opt_kwargs = opt_cls, dict(opt_kwargs or {})
        self.scheduler_cls = scheduler_cls
        self.scheduler_args, self.scheduler_kwargs = tuple(scheduler_args), dict(scheduler_kwargs or {})
        self.seed = seed
        self.model: nn.Module | None = None
        self._optimizer: ParallelOptimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self._state: ParallelState | None = None

    # ------------------------------------------------------------------ building

    def configure_model(self) -> None:
        if self.model is not None:
            return
        strategy = self.trainer.strategy
        config = strategy.nxd_config if isinstance(strategy, NxdStrategy) else None
        if config is None:
            raise NxdError("NxdModelModule trains under Trainer(strategy=NxdStrategy(nxd_config=...))")
        config.optimizer_config = {**config.optimizer_config, "grad_reduction": "sum"}  # see the module docstring
        if self.seed is not None:
            torch.manual_seed(self.seed)
        self.model = initialize_parallel_model(config, self.model_fn, *self.model_args, **self.model_kwargs)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self._optimizer = initialize_parallel_optimizer(config, self.opt_cls, params, **self.opt_kwargs)
        if self.scheduler_cls is not None:
            self._scheduler = self.scheduler_cls(self._optimizer, *self.scheduler_args, **self.scheduler_kwargs)
        self._state = config.state
        self._tp_group = config.state.group("tp") if config.state.size("tp") > 1 else None

    def configure_optimizers(self) -> OptimizerLRScheduler:
        assert self._optimizer is not None, "configure_model builds the optimizer first"
        if self._scheduler is None:
            return self._optimizer
        return {"optimizer": self._optimizer, "lr_scheduler": {"scheduler": self._scheduler, "interval": "step"}}

    @property
    def rank_modules(self) -> list[nn.Module]:
        assert self.model is not None
        return [self.model]

    @property
    def parallel_optimizer(self) -> ParallelOptimizer:
        assert self._optimizer is not None
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        return self._scheduler

    @property
    def parallel_state(self) -> ParallelState:
        assert self._state is not None
        return self._state

    # ------------------------------------------------------------------ training

    def forward_logits(self, batch: TokenBatch) -> torch.Tensor:
        """Logits ``[B, T, V(/tp)]`` of a micro-batch: ``model(input_ids, position_ids=...,
        segment_ids=...)`` with the keys the batch has (nxd-finetune's decoders); override for
        other signatures (an output with ``.logits`` is unwrapped)."""
        assert self.model is not None
        kwargs = {k: batch[k] for k in ("position_ids", "segment_ids") if k in batch}
        out = self.model(batch["input_ids"], **kwargs)
        return out.logits if hasattr(out, "logits") else out

    def training_step(self, batch: Batch | list[Batch], batch_idx: int) -> torch.Tensor:
        """One optimizer step over the batch's micro-batches: ``run``'s step and token-weighted loss."""
        micro = [batch] if isinstance(batch, dict) else list(batch)
        n_input = sum(int((b["segment_ids"] > 0).sum()) if "segment_ids" in b else b["input_ids"].numel()
                      for b in micro)
        return self.lightning_step(self, micro, n_input)

    # ------------------------------------------------------------------ the step's Stepper (sft/step.py)

    def forward_backward(self, micro_batches: Sequence[TokenBatch], n_targets: torch.Tensor, objective: Objective,
                         backward: Callable[[torch.Tensor], None] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each micro-batch's objective loss (supervised cross entropy over this rank's vocabulary
        shard) / ``n_targets``, backpropagated with ``backward``; returns their detached sum and the
        objective's metric sums (None when it has none)."""
        return backward_micro_batches(micro_batches, n_targets, functools.partial(self._loss, objective),
                                      backward or self.manual_backward, maxed_entries(objective))

    def _loss(self, objective: Objective, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``objective``'s summed loss and metric sums of a micro-batch on this rank's logits."""
        side = objective.side(batch)
        scores = LogitScores(self.forward_logits(batch), shift_labels(objective.labels(side)), self._tp_group)
        return objective.loss(scores, side)

    def step(self) -> torch.Tensor | None:
        """Unused: the step's optimizer step is Lightning's (:meth:`NxdModuleBase.lightning_step`)."""
        raise NotImplementedError("NxdModelModule steps through Lightning's optimizer")

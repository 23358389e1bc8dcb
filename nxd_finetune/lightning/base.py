"""What both LightningModules share: the run's training step, its logging, the checkpoint state.

:class:`NxdModuleBase` is the contract between a module and
:class:`~nxd_finetune.lightning.strategy.NxdStrategy` / :mod:`nxd_finetune.lightning.checkpoint`:
the rank's modules, its :class:`~nxd_finetune.parallel.optimizer.ParallelOptimizer`, the LR
scheduler, the layout, the counters and history a checkpoint carries
(:class:`~nxd_finetune.checkpoint.run_state.RunState`, as ``run`` writes it).
:meth:`NxdModuleBase.lightning_step` is ``run``'s step (:func:`nxd_finetune.sft.step.train_step`)
with Lightning's ``manual_backward`` and its optimizer step (precision plugin, hooks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from nxd_finetune.checkpoint.run_state import RngState, RunState, TrainState
from nxd_finetune.objective import SFT, Objective, TokenBatch, maxed_entries
from nxd_finetune.parallel.data_parallel import dp_sum
from nxd_finetune.parallel.optimizer import ParallelOptimizer
from nxd_finetune.parallel.state import ParallelState
from nxd_finetune.sft.step import StepLog, Stepper, train_step

Batch = dict[str, torch.Tensor]
SHOWN = ("train_loss", "lr", "grad_norm", "tokens_per_s")  # on the progress bar


class NxdModuleBase(pl.LightningModule):
    """Manual optimization; subclasses build, in ``configure_model``, what the properties below
    return (``rank_modules``, ``parallel_optimizer``, ``scheduler``, ``parallel_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.train_state = TrainState()
        self.history: list[dict[str, Any]] = []
        self.step_log = StepLog(self.train_state, self.history)  # run's step bookkeeping
        self.objective: Objective = SFT  # what each step computes (the recipe module: its recipe's)

    # ------------------------------------------------------------------ what subclasses provide

    @property
    def rank_modules(self) -> list[nn.Module]:
        raise NotImplementedError

    @property
    def parallel_optimizer(self) -> ParallelOptimizer:
        raise NotImplementedError

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        return None

    @property
    def parallel_state(self) -> ParallelState:
        raise NotImplementedError

    @property
    def is_logger(self) -> bool:
        return self.parallel_state.rank == 0

    # ------------------------------------------------------------------ the step

    def dp_sum(self, t: torch.Tensor, maxed: int = 0) -> torch.Tensor:
        """``t`` summed over the data-parallel group (``t`` itself at dp == 1; the last ``maxed``
        entries: their maximum)."""
        return dp_sum(t, self.parallel_state, maxed)

    def on_train_start(self) -> None:
        for m in self.rank_modules:
            m.train(True)
        self.step_log.restart()

    def _optimizer_step(self) -> torch.Tensor | None:
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list), "configure_optimizers returns one optimizer"
        optimizer.step()  # ParallelOptimizer: tp sums, dp sum or ZeRO-1, clipping, then its optimizer
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()  # type: ignore[union-attr]
        optimizer.zero_grad(set_to_none=True)
        return self.parallel_optimizer.grad_norm

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the step's batch source logged with it (none here; the recipe module's GRPO
        source: rewards, completion lengths)."""
        return {}

    def lightning_step(self, stepper: Stepper, micro_batches: Sequence[TokenBatch], n_input: int) -> torch.Tensor:
        """One optimizer step of :attr:`objective` over this rank's ``micro_batches`` through
        ``run``'s step on ``stepper`` (the engine), with Lightning's backward and optimizer step.
        Returns the step's mean loss over the global batch (the same on every rank) after logging it."""
        result = train_step(stepper, micro_batches, n_input, objective=self.objective, backward=self.manual_backward,
                            optimizer_step=self._optimizer_step)
        step_loss = self.dp_sum(result.loss)
        # the objective's own step metrics (preference: rewards/...)
        extra = ({} if result.stats is None
                 else self.objective.train_record(self.dp_sum(result.stats, maxed_entries(self.objective)).tolist()))
        extra.update(self.step_metrics())
        self._record(step_loss, result.counts, result.grad_norm, float(self.parallel_optimizer.param_groups[0]["lr"]),
                     extra)
        return step_loss

    def _record(self, loss: torch.Tensor, counts: torch.Tensor, grad_norm: torch.Tensor | None, lr: float,
                extra: dict[str, float] | None = None) -> None:
        st = self.train_state
        st.step += 1
        self.step_log.count(counts.tolist())
        rec = self.step_log.record(st.step, float(loss), lr, None if grad_norm is None else float(grad_norm), extra)
        if extra:
            self.log_dict(extra, on_step=True, batch_size=1)
        self.log_dict({k: v for k, v in rec.items() if k in SHOWN}, prog_bar=True, on_step=True, batch_size=1)
        self.log("tokens", float(st.tokens), on_step=True, batch_size=1)

    # ------------------------------------------------------------------ checkpoint state

    def run_state(self, rng: RngState) -> RunState:
        """What a checkpoint of this module carries (subclasses add the data position, the recipe)."""
        scheduler = self.scheduler
        return RunState(train_state=self.train_state, rng=rng, history=self.history,
                        scheduler=scheduler.state_dict() if scheduler is not None else None)

    def restore_run_state(self, saved: RunState) -> None:
        """Counters and history of a checkpoint (before training)."""
        self.train_state.restore(saved.train_state)
        self.history[:] = saved.history  # the list the step log appends to

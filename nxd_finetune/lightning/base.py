"""What both LightningModules share: the run's optimizer step, its logging, the checkpoint state.

:class:`NxdModuleBase` is the contract between a module and
:class:`~nxd_finetune.lightning.strategy.NxdStrategy` / :mod:`nxd_finetune.lightning.checkpoint`:
the rank's modules, its :class:`~nxd_finetune.parallel.optimizer.ParallelOptimizer`, the LR
scheduler, the layout, the counters and history a checkpoint carries. :meth:`NxdModuleBase.optimizer_step_of`
is ``run``'s step (``sft/trainer.py``): the target tokens of the step counted over every
data-parallel rank, each micro-batch's token-summed loss divided by that count through
``manual_backward``, the optimizer's step through Lightning (precision plugin, hooks), the LR step.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune import loss as L
from nxd_finetune.parallel.optimizer import ParallelOptimizer
from nxd_finetune.parallel.state import ParallelState

Batch = dict[str, torch.Tensor]
MicroLoss = Callable[[Batch, torch.Tensor], torch.Tensor]
SHOWN = ("train_loss", "lr", "grad_norm", "tokens_per_s")  # on the progress bar


@dataclasses.dataclass
class Counters:
    """What a checkpoint carries to resume exactly (``sft.trainer.TrainState``'s fields)."""

    step: int = 0
    tokens: int = 0
    input_tokens: int = 0


class NxdModuleBase(pl.LightningModule):
    """Manual optimization; subclasses build, in ``configure_model``, what the properties below
    return (``rank_modules``, ``parallel_optimizer``, ``scheduler``, ``parallel_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.train_state = Counters()
        self.history: list[dict[str, Any]] = []
        self._tick = 0.0

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

    def dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the data-parallel group (``t`` itself at dp == 1)."""
        st = self.parallel_state
        if st.dp_size == 1:
            return t
        out = t.detach().clone()
        dist.all_reduce(out, group=st.dp_group)
        return out

    def on_train_start(self) -> None:
        for m in self.rank_modules:
            m.train(True)
        self._tick = time.perf_counter()

    def optimizer_step_of(self, micro_batches: Sequence[Batch], n_input: int, micro_loss: MicroLoss) -> torch.Tensor:
        """One optimizer step over this rank's ``micro_batches`` (``labels`` with -100 where no loss);
        ``micro_loss(batch, n_targets)``: the batch's token-summed loss / ``n_targets``. Returns the
        step's token-mean loss over the global batch (the same on every rank) after logging it."""
        device = micro_batches[0]["labels"].device
        n_local = sum((L.shift_labels(b["labels"]) != L.IGNORE_INDEX).sum() for b in micro_batches)
        counts = self.dp_sum(torch.stack([torch.as_tensor(n_local, device=device).to(torch.int64),
                                          torch.tensor(int(n_input), dtype=torch.int64, device=device)]))
        n_targets = counts[0].clamp(min=1).to(torch.float32)
        total = torch.zeros((), device=device)
        for b in micro_batches:
            loss = micro_loss(b, n_targets)
            self.manual_backward(loss)
            total += loss.detach()
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list), "configure_optimizers returns one optimizer"
        optimizer.step()  # ParallelOptimizer: tp sums, dp sum or ZeRO-1, clipping, then its optimizer
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()  # type: ignore[union-attr]
        optimizer.zero_grad(set_to_none=True)
        step_loss = self.dp_sum(total)
        self._record(step_loss, counts, self.parallel_optimizer.grad_norm,
                     float(self.parallel_optimizer.param_groups[0]["lr"]))
        return step_loss

    def _record(self, loss: torch.Tensor, counts: torch.Tensor, grad_norm: torch.Tensor | None, lr: float) -> None:
        n_targets, n_input = (int(c) for c in counts.tolist())
        st = self.train_state
        st.step += 1
        st.tokens += n_targets
        st.input_tokens += n_input
        now = time.perf_counter()
        rec: dict[str, Any] = {"train_loss": float(loss), "lr": lr,
                               "tokens_per_s": n_input / max(now - self._tick, 1e-9), "tokens": st.tokens}
        self._tick = now
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
        self.history.append({"step": st.step, **rec})
        self.log_dict({k: v for k, v in rec.items() if k in SHOWN}, prog_bar=True, on_step=True, batch_size=1)
        self.log("tokens", float(st.tokens), on_step=True, batch_size=1)

    # ------------------------------------------------------------------ checkpoint state

    def checkpoint_extra(self, rng: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's ``extra`` (the keys ``run`` reads that this module has)."""
        scheduler = self.scheduler
        return {"train_state": dataclasses.asdict(self.train_state), "rng": rng, "history": self.history,
                "scheduler": scheduler.state_dict() if scheduler is not None else None}

    def restore_extra(self, extra: dict[str, Any]) -> None:
        """Counters and history of a checkpoint's ``extra`` (before training)."""
        for key, value in extra["train_state"].items():
            setattr(self.train_state, key, value)
        self.history = list(extra.get("history") or [])

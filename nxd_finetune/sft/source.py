"""The batch source: what hands the training loop each optimizer step's micro-batches.

The loop (``run``'s :func:`~nxd_finetune.sft.trainer.train` and the Lightning recipe module) asks
its :class:`BatchSource` for step ``n``'s micro-batches right before running step ``n``, with the
engine as it stands after step ``n - 1``: a source may read a loader, generate with the model
(online RL: completions of the policy, scored, with per-token side data), or draw on its own state.
Its state (:meth:`BatchSource.state_dict`) is saved with every checkpoint, as the ``data`` record
of :class:`~nxd_finetune.checkpoint.run_state.RunState`, and handed back on resume before the
first step.

:class:`LoaderSource` is the default: the train loader's micro-batches grouped into optimizer
steps (:func:`~nxd_finetune.sft.step.step_batches`), on the device through the runtime's loader;
its state is the loader's position of the batches handed out, the record checkpoints always held.
A run takes another source from a factory called with the rank's
:class:`~nxd_finetune.sft.setup.RankRun` (``setup_rank(source=...)``, ``run(recipe, source=...)``,
``NxdLightningModule(recipe, source=...)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from nxd_finetune.errors import NxdError
from nxd_finetune.sft.step import StepItem, step_batches

if TYPE_CHECKING:
    from nxd_finetune.data.loader import TrainLoader
    from nxd_finetune.runtime import StepRuntime
    from nxd_finetune.sft.engine import Engine


class BatchSource(Protocol):
    """Where a run's optimizer steps come from (see the module docstring)."""

    def next_step(self, engine: Engine, step: int) -> StepItem:
        """Step ``step``'s micro-batches (1 for the first step of a run) and their non-padding input
        tokens; ``engine``: the rank's engine after step ``step - 1``. Collective where the source
        is (a generating source runs the model on every rank of its layout)."""
        ...

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint saves to resume the source where it stands (JSON values and tensors)."""
        ...

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Continue from a checkpoint's :meth:`state_dict` (before the first :meth:`next_step`)."""
        ...

    def close(self) -> None:
        """Release what the source holds (threads, workers); the end of the run calls it."""
        ...


def source_metrics(source: BatchSource) -> dict[str, float]:
    """A source's own metrics since the last call, logged with the step's record (a ``metrics()``
    method: GRPO's generation metrics, ``rl/source.py``); {} for a source without one."""
    take = getattr(source, "metrics", None)
    return dict(take()) if callable(take) else {}


class LoaderSource:
    """The default source: ``loader``'s micro-batches, ``grad_accum`` per step, through
    ``runtime.batches`` (on the device; prefetched on XLA). Its state is the loader's position as
    of the last step handed out, not of those prefetched."""

    def __init__(self, loader: TrainLoader, grad_accum: int, packing: bool, runtime: StepRuntime) -> None:
        self.loader = loader
        self.steps = runtime.batches(step_batches(loader, grad_accum, packing),
                                     snapshot=loader.state_dict, restore=loader.load_state_dict)

    def next_step(self, engine: Engine, step: int) -> StepItem:
        return next(self.steps)

    def state_dict(self) -> dict[str, object]:
        return dict(self.steps.state_dict())

    def load_state_dict(self, state: dict[str, object]) -> None:
        """The loader's position of a checkpoint; NxdError (one line) for a record another source
        saved (keys the loader's position does not have, or values that are not integers)."""
        position = {k: v for k, v in state.items() if isinstance(v, int)}
        if not position or len(position) != len(state) or not set(position) <= set(self.loader.state_dict()):
            raise NxdError(f"the checkpoint's data record {sorted(state)} is not a position of this run's train "
                           "data (was it saved by a run with another batch source?)")
        self.steps.load_state_dict(position)

    def close(self) -> None:
        self.steps.close()

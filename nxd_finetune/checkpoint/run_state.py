"""The training state a checkpoint carries besides tensors, as one typed object.

:class:`RunState` is written into a checkpoint's ``extra`` by :meth:`RunState.to_extra` and read
back by :meth:`RunState.from_extra`, for ``nxd-finetune run`` (``checkpoint/training.py``) and the
Lightning modules alike, so a checkpoint of either resumes the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    import torch


class PythonRng(TypedDict):
    """Python's ``random.getstate()`` as JSON (the state tuple as a list)."""

    version: int
    state: list[int]
    gauss: float | None


class _DeviceRng(TypedDict, total=False):
    devices: dict[str, torch.Tensor]  # device type -> its generator's states (nxd_finetune.device)
    torch_cuda: torch.Tensor  # read from checkpoints written before ``devices``
    xla: torch.Tensor  # idem


class RngState(_DeviceRng):
    """Every rank's RNG states (``checkpoint.training.rng_state``): generator states stacked
    ``[world, n]`` (the device's generator in ``devices`` where it has one) and Python's ``random``."""

    torch_cpu: torch.Tensor
    python: PythonRng


@dataclasses.dataclass
class TrainState:
    """Counters that a checkpoint must carry to resume exactly."""

    step: int = 0
    tokens: int = 0  # target (loss-bearing) tokens consumed, all dp ranks
    input_tokens: int = 0  # non-padding tokens consumed, all dp ranks

    def restore(self, other: TrainState) -> None:
        """Take ``other``'s counters (the loop holds this object; a resume updates it in place)."""
        self.step, self.tokens, self.input_tokens = other.step, other.tokens, other.input_tokens


@dataclasses.dataclass
class RunState:
    """``train_state``: the counters; ``scheduler``: the LR scheduler's state dict; ``data``: the
    train loader's position (None where the data is the user's); ``rng``: every rank's RNG
    states (``checkpoint.training.rng_state``); ``history``: the logged records, the eval before
    training included (its step-0 record); ``metrics_bytes``: the size of ``metrics.jsonl`` at the
    save; ``recipe``: the recipe's YAML (None for a model-function module); ``reference``: the
    identity of the reference log-probs the run started with (preference tuning: what their
    store's key hashes, ``sft.reference.reference_identity``; a resumed run keeps it); ``lightning``:
    Lightning's own state (epoch, callbacks) when Lightning saved it."""

    train_state: TrainState
    rng: RngState
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    scheduler: dict[str, Any] | None = None  # torch's LRScheduler.state_dict()
    data: dict[str, Any] | None = None
    metrics_bytes: int = 0
    recipe: str | None = None
    reference: dict[str, object] | None = None
    lightning: dict[str, Any] | None = None  # Lightning's own checkpoint keys

    def to_extra(self) -> dict[str, object]:
        """The checkpoint's ``extra`` (the keys every reader knows)."""
        extra = dataclasses.asdict(self)
        extra["train_state"] = dataclasses.asdict(self.train_state)
        if self.lightning is None:
            del extra["lightning"]
        return extra

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> RunState:
        """The state of a checkpoint's ``extra`` as read back from its files (unknown keys ignored;
        missing optional ones default)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"train_state"}
        return cls(train_state=TrainState(**extra["train_state"]),
                   **{k: v for k, v in extra.items() if k in names})

    def eval_before(self) -> dict[str, float]:
        """The eval record logged before training (step 0 of the history), or {}."""
        before = next((h for h in self.history if h.get("step") == 0 and "eval_loss" in h), None)
        return {k: v for k, v in before.items() if k != "step"} if before else {}

"""Reference log-probs for preference tuning, computed in one pass before training.

DPO compares the policy's log-probs with a frozen reference model's. No second model is held:
before the first step, every pair of the train and eval splits goes through the engine once in
eval mode with the reference weights (:func:`row_logps`; each data-parallel rank its share, then
gathered), and each sequence's summed completion log-prob is stored with the tokenized data (the
data layer's ``ref-<key>/``, keyed by :func:`reference_identity`: base weights, starting adapter,
dtypes), so a resumed run or a rerun reads them back instead of recomputing with trained weights.
Every later micro-batch carries its rows' ``ref_logps`` (the batch contract of
:mod:`nxd_finetune.preference`).

The reference weights (:func:`nxd_finetune.recipe.reference_of`): ``base`` is the model with the
LoRA adapter path off (or, for full fine-tuning, the initial model); ``init_from`` is the adapter
the run starts from (``lora.init_from``), that is the model as it stands before the first step.
The pass runs through :meth:`Engine.eval_stats`, so it is vocab-parallel, chunked and pipelined as
the layout is: the same call as an eval, handed the :class:`RowLogps` objective (each row's summed
per-token log-probs) instead of the run's; nothing is swapped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune.data.loader import DataLoaders
from nxd_finetune.data.pairs import assemble_ref_logps, ref_logps_key
from nxd_finetune.data.ref_store import RefStoreError
from nxd_finetune.errors import NxdError, NxdWarning, RecipeError
from nxd_finetune.lora import lora_modules
from nxd_finetune.lora.identity import weights_fingerprint
from nxd_finetune.loss import Scores
from nxd_finetune.objective import NoTrainStats, SideData, TokenBatch
from nxd_finetune.objectives import run_reference
from nxd_finetune.preference import real_pairs, sequence_logps
from nxd_finetune.sft.engine import Engine
from nxd_finetune.sft.init_from import StartAdapter, resolve_start

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe

Identity = dict[str, object]
"""A reference's identity (:func:`reference_identity`): JSON values."""


@contextlib.contextmanager
def adapter_off(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every LoRA layer of ``modules`` contributes nothing (its scaling set to 0) for the block:
    the base model's outputs, exactly, without a copy of any weight."""
    saved = [(m, m.scaling) for root in modules for _, m in lora_modules(root)]
    for m, _ in saved:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, scaling in saved:
            m.scaling = scaling


@dataclasses.dataclass
class RowLogps(NoTrainStats):
    """An objective whose eval statistics are the micro-batch's per-row summed completion
    log-probs (``[rows]``, from the per-token log-probs): what the reference pass reads through
    the engine's eval call on every layout."""

    rows: int
    name: str = "reference"

    @property
    def eval_width(self) -> int:
        return self.rows

    def side(self, batch: TokenBatch) -> SideData:
        return {"labels": batch["labels"]}  # the batch has no ref_logps yet

    def labels(self, side: SideData) -> torch.Tensor:
        return side["labels"]

    def count(self, batch: TokenBatch) -> torch.Tensor:
        return real_pairs(batch["labels"]).sum().to(torch.int64)

    def loss(self, scores: Scores, side: SideData) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise RuntimeError("the reference pass does not train")

    def eval_stats(self, scores: Scores, side: SideData) -> torch.Tensor:
        return sequence_logps(scores, side["labels"]).float()

    def eval_record(self, stats: Sequence[float]) -> dict[str, float]:
        return {}


@torch.no_grad()
def row_logps(engine: Engine, batches: Iterable[TokenBatch], reference: str) -> Iterator[torch.Tensor]:
    """Each batch's per-row summed completion log-prob (``[rows]`` float32, on the CPU) under the
    ``reference`` weights, in eval mode. Collective like :meth:`Engine.eval_stats` (every rank of
    a tp / pp group passes the same batches)."""
    was_training = engine.modules[0].training
    engine.train(False)
    off = adapter_off(engine.modules) if reference == "base" else contextlib.nullcontext()
    try:
        with off:
            for batch in batches:
                moved = {k: v.to(engine.device) for k, v in batch.items()}
                yield engine.eval_stats(moved, RowLogps(moved["input_ids"].shape[0])).cpu()
    finally:
        engine.train(was_training)


def reference_identity(recipe: Recipe, reference: str, model_dir: Path,
                       start: StartAdapter | None = None) -> Identity:
    """What decides the reference log-probs beyond the tokenized data (the data layer's cache key
    hashes it): the base weights, the dtypes, the reference kind and, for ``init_from``, the
    starting adapter as resolved (``start``: the registry version pulled, not the REF as written,
    and the digest of its weights)."""
    ident: Identity = {"reference": reference, "base": weights_fingerprint(model_dir),
                       "dtype": recipe.model.dtype, "precision": recipe.training.precision}
    if reference == "init_from":
        if start is None:
            raise NxdError("preference.reference=init_from needs lora.init_from (the adapter the run starts from)")
        ident["init_from"] = {"source": start.source, "sha256": start.sha256}
    return ident


def reference_label(ident: Identity | None) -> str:
    """How an adapter records its reference (``nxd_reference``): ``base``, ``init_from:<source>``
    (the resolved source) or ``none``."""
    if ident is None:
        return "none"
    start = ident.get("init_from")
    return f"init_from:{start['source']}" if isinstance(start, dict) else str(ident["reference"])


def attach_reference(recipe: Recipe, engine: Engine, data: DataLoaders, model_dir: Path,
                     run_recipe: Recipe | None = None, started: Identity | None = None) -> Identity | None:
    """Give every preference batch its ``ref_logps``: the ones stored with the tokenized data under
    this reference's key, checked against their integrity record, or one pass over every pair
    (each dp rank its share, gathered over dp) with the engine as it stands (before the first
    step), then stored. A store that fails its checks is named in one warning line and recomputed.
    ``run_recipe``: the training run's recipe when ``engine`` holds another adapter
    (``nxd-finetune eval`` of its result): its ``base`` reference is still computed (adapter off),
    its ``init_from`` one must be stored. ``started``: a resumed run's reference (the identity its
    checkpoint records): used whatever ``lora.init_from`` says now; recomputed only where the
    engine starts from the same adapter, else refused. Returns the identity of the reference used
    (None: the objective has none). Collective."""
    run = run_recipe or recipe
    if started is not None:
        ident = started
    else:
        reference = run_reference(run)
        if reference is None:
            return None
        ident = reference_identity(run, reference, model_dir, _start(run, reference, engine, run_recipe))
    key = ref_logps_key(ident)
    damaged: RefStoreError | None = None
    try:
        if data.load_ref_logps(key):
            return ident
    except RefStoreError as e:
        damaged = e
    where = damaged or f"the reference log-probs {_stored_at(data, key)}"
    if run_recipe is not None and ident["reference"] == "init_from":
        raise NxdError(f"{where}: they are the run's starting adapter's ({reference_label(ident)}), which this eval "
                       "does not load to recompute them; train with this recipe first (same data cache)")
    if started is not None:
        _check_recomputable(recipe, engine, model_dir, started, str(where))
    if damaged is not None and engine.is_logger:
        warnings.warn(f"{damaged}; recomputing them from the reference model", NxdWarning, stacklevel=2)
    values = _reference_pass(engine, data, str(ident["reference"]))
    data.save_ref_logps(key, values, ident if engine.is_logger else None, replace=damaged is not None)
    return ident


def _start(run: Recipe, reference: str, engine: Engine, run_recipe: Recipe | None) -> StartAdapter | None:
    """The starting adapter of an ``init_from`` reference: the one the engine loaded, or for an
    eval (``run_recipe``) the run's ``lora.init_from`` resolved now."""
    if reference != "init_from":
        return None
    if run_recipe is None:
        return engine.start_adapter
    return resolve_start(run.lora.init_from) if run.lora is not None and run.lora.init_from else None


def _stored_at(data: DataLoaders, key: str) -> str:
    if data.cache_entry is None:
        return "are not stored (data.cache is off)"
    return f"are not stored ({data.cache_entry / f'ref-{key}'} is missing)"


def _check_recomputable(recipe: Recipe, engine: Engine, model_dir: Path, started: Identity, where: str) -> None:
    """A resumed run recomputes its reference only from the same weights it started with: the same
    base, dtypes and starting adapter content. RecipeError otherwise, one line."""
    reference = str(started["reference"])
    now = reference_identity(recipe, reference, model_dir, engine.start_adapter) if (
        reference != "init_from" or engine.start_adapter is not None) else None

    def content(ident: Identity | None) -> object:
        if ident is None:
            return None
        start = ident.get("init_from")
        return {**ident, "init_from": start.get("sha256") if isinstance(start, dict) else None}

    if content(now) == content(started):
        return
    was = reference_label(started)
    fix = (f"put back lora.init_from={was.split(':', 1)[1]} to recompute them" if reference == "init_from"
           else "put back the model and dtypes it started with")
    raise RecipeError(f"cannot resume: {where}, and only the weights the run started from ({was}) can recompute "
                      f"them; lora.init_from now gives {reference_label(now) if now else 'no adapter'}: {fix}, or "
                      "start fresh with --no-resume")


def _reference_pass(engine: Engine, data: DataLoaders, reference: str) -> dict[str, torch.Tensor]:
    """Every split's per-sequence reference log-probs (sample order), each dp rank its share,
    gathered over dp. Collective."""
    values = {}
    for split, batches in data.pairs.items():
        ids, logps = [], []
        pairs_and_batches = list(batches.reference_batches())
        for pair_ids, got in zip((i for i, _ in pairs_and_batches),
                                 row_logps(engine, (b for _, b in pairs_and_batches), reference), strict=True):
            ids.append(pair_ids)
            logps.append(got)
        if engine.state.size("dp") > 1:
            gathered: list[object] = [None] * engine.state.size("dp")
            dist.all_gather_object(gathered, (ids, logps), group=engine.state.host_group("dp"))
            ids = [t for part in gathered for t in part[0]]  # type: ignore[index]
            logps = [t for part in gathered for t in part[1]]  # type: ignore[index]
        values[split] = assemble_ref_logps(len(batches.pairs), ids, logps)
    return values

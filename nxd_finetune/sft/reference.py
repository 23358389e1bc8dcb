"""Reference log-probs for preference tuning: which weights, where they are stored, the passes.

DPO compares the policy's log-probs with a frozen reference model's. No second model is held: a
pair goes through the engine in eval mode with the reference weights (:func:`row_logps`), and each
sequence's summed completion log-prob is stored with the tokenized data (the data layer's
``ref-<key>/``, keyed by :func:`reference_identity`: base weights, starting adapter, dtypes), so a
resumed run, a later epoch or a rerun reads it back instead of recomputing it with trained weights.
``nxd-finetune run`` computes a pair's values at the step that first uses it
(:mod:`nxd_finetune.sft.ref_source`); :func:`attach_reference` (``eval``, the Lightning module)
computes every pair of the splits it is asked for in one pass before it returns (each
data-parallel rank its share, then gathered). Every later micro-batch carries its rows'
``ref_logps`` (the batch contract of :mod:`nxd_finetune.preference`).

The reference weights (:func:`nxd_finetune.recipe.reference_of`): ``base`` is the model with the
LoRA adapter path off (or, for full fine-tuning, the initial model: only before the first step);
``init_from`` is the adapter the run starts from (``lora.init_from``), that is the model as it
stands before the first step: a copy of its adapter tensors (:class:`ReferenceWeights`) is swapped
in for each later pass.
The pass runs through :meth:`Engine.eval_stats`, so it is vocab-parallel, chunked and pipelined as
the layout is: the same call as an eval, handed the :class:`RowLogps` objective (each row's summed
per-token log-probs) instead of the run's; nothing is swapped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune.data.loader import DataLoaders
from nxd_finetune.data.pairs import assemble_ref_logps, ref_logps_key
from nxd_finetune.data.ref_store import RefStoreError, load_parts, load_ref_logps
from nxd_finetune.errors import NxdError, NxdWarning, RecipeError
from nxd_finetune.lora import load_adapter, lora_modules
from nxd_finetune.lora.identity import weights_fingerprint
from nxd_finetune.loss import Scores
from nxd_finetune.objective import NoTrainStats, SideData, TokenBatch
from nxd_finetune.objectives import run_reference
from nxd_finetune.preference import real_pairs, sequence_logps
from nxd_finetune.registry.fetch import fetch_adapter
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


Weights = Callable[[], contextlib.AbstractContextManager[None]]
"""The reference weights: a context in which the engine computes with them."""


@torch.no_grad()
def row_logps(engine: Engine, batches: Iterable[TokenBatch], reference: str,
              weights: Weights | None = None) -> Iterator[torch.Tensor]:
    """Each batch's per-row summed completion log-prob (``[rows]`` float32, on the CPU) under the
    ``reference`` weights (``base``: the adapter off; otherwise the engine as it stands), or under
    ``weights`` where given, in eval mode. Collective like :meth:`Engine.eval_stats` (every rank of
    a tp / pp group passes the same batches)."""
    was_training = engine.modules[0].training
    engine.train(False)
    off: contextlib.AbstractContextManager[None]
    if weights is None:
        off = adapter_off(engine.modules) if reference == "base" else contextlib.nullcontext()
    else:
        off = weights()
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
                     run_recipe: Recipe | None = None, started: Identity | None = None,
                     splits: Sequence[str] | None = None) -> Identity | None:
    """Give every preference batch of ``splits`` (None: every split) its ``ref_logps``: the ones
    stored with the tokenized data under this reference's key, checked against their integrity
    record, and one pass over the pairs not stored (each dp rank its share, gathered over dp) with
    the engine as it stands (before the first step), then stored. A store that fails its checks is
    named in one warning line and recomputed. ``run_recipe``: the training run's recipe when
    ``engine`` holds another adapter (``nxd-finetune eval`` of its result): its ``base`` reference
    is still computed (adapter off), its ``init_from`` one must be stored. ``started``: a resumed
    run's reference (the identity its checkpoint records): used whatever ``lora.init_from`` says
    now (see :func:`open_reference`). Returns the identity of the reference used (None: the
    objective has none). Collective."""
    ref = open_reference(recipe, engine, data, model_dir, run_recipe, started, splits)
    if ref is None:
        return None
    for split in list(ref.pending):
        ref.complete(split, split_logps(engine, data, split, ref.weights))
    return ref.ident


@dataclasses.dataclass
class OpenReference:
    """A run's reference as stored so far: its identity and store key, the splits complete
    (attached to ``data``), the ``pending`` ones (split -> float32 values in sample order, NaN
    where none is stored yet) and the weights that compute the rest."""

    ident: Identity
    key: str
    data: DataLoaders
    weights: Weights
    pending: dict[str, torch.Tensor]
    is_logger: bool

    def complete(self, split: str, values: torch.Tensor) -> None:
        """``values`` of the whole split fill its missing entries; the split is attached and, with
        every split complete so far, stored (the logger writes)."""
        table = self.pending.pop(split)
        self.data.attach_ref_logps({split: torch.where(torch.isnan(table), values, table)})
        if self.is_logger and self.data.cache_entry is not None:
            done = {s: v for s, b in self.data.pairs.items() if (v := b.pairs.ref_logps) is not None}
            self.data.save_ref_logps(self.key, done, self.ident, replace=True, partial=True)


def open_reference(recipe: Recipe, engine: Engine, data: DataLoaders, model_dir: Path,
                   run_recipe: Recipe | None = None, started: Identity | None = None,
                   splits: Sequence[str] | None = None) -> OpenReference | None:
    """The run's reference (None: the objective has none): its stored values read (global rank 0
    reads the store and hands it to every rank, so all ranks hold the same), the complete splits
    attached, and the weights that compute the rest. What cannot be computed is refused here, one
    line: for an eval (``run_recipe``) an ``init_from`` reference not stored; for a resumed run
    (``started``) one whose weights the engine does not start from: where nothing is stored any
    more, only the weights the engine starts from recompute it (the same base, dtypes and starting
    adapter content); where the run stored some of its values, the adapter it started from is
    fetched again from its source (checked against the digest its checkpoint records). Collective."""
    run = run_recipe or recipe
    if started is not None:
        ident = started
    else:
        reference = run_reference(run)
        if reference is None:
            return None
        ident = reference_identity(run, reference, model_dir, _start(run, reference, engine, run_recipe))
    key = ref_logps_key(ident)
    wanted = list(data.pairs) if splits is None else [s for s in splits if s in data.pairs]
    stored, damaged = _broadcast(engine, _read_store(data, key, wanted) if engine.is_logger else None)
    data.attach_ref_logps({s: v for s, v in stored.items() if not torch.isnan(v).any()})
    pending = {s: stored.get(s, torch.full((2 * len(data.pairs[s].pairs),), float("nan"))) for s in wanted
               if data.pairs[s].pairs.ref_logps is None}
    kind = str(ident["reference"])
    ref = OpenReference(ident, key, data, _base_weights(engine, kind), pending, engine.is_logger)
    if not pending:
        return ref
    where = damaged[0] if damaged else f"the reference log-probs {_stored_at(data, key)}"
    if run_recipe is not None and kind == "init_from":
        raise NxdError(f"{where}: they are the run's starting adapter's ({reference_label(ident)}), which this eval "
                       "does not load to recompute them; train with this recipe first (same data cache)")
    some_stored = bool(stored) and any(not torch.isnan(v).all() for v in stored.values())
    if started is not None and not _same_start(recipe, engine, model_dir, started):
        if not (some_stored and kind == "init_from"):
            _refuse(recipe, engine, model_dir, started, str(where))
        ref.weights = ReferenceWeights(engine.trainable(), _fetched_start(engine, started))
    elif kind == "init_from":
        ref.weights = ReferenceWeights(engine.trainable())
    if engine.is_logger:
        for problem in damaged:
            warnings.warn(f"{problem}; recomputing them from the reference model", NxdWarning, stacklevel=3)
    return ref


def _base_weights(engine: Engine, kind: str) -> Weights:
    if kind == "base":
        return lambda: adapter_off(engine.modules)
    return contextlib.nullcontext


class ReferenceWeights:
    """The adapter the run started from, kept as a copy of ``params`` (its tensors as they are now,
    or ``values``) and swapped in for each reference pass (a context: the trained values come back
    after it, exactly)."""

    def __init__(self, params: list[torch.nn.Parameter], values: list[torch.Tensor] | None = None) -> None:
        self.params = params
        self.values = values if values is not None else [p.detach().clone() for p in params]

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        trained = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, v in zip(self.params, self.values, strict=True):
                p.copy_(v)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, v in zip(self.params, trained, strict=True):
                    p.copy_(v)


def _fetched_start(engine: Engine, started: Identity) -> list[torch.Tensor]:
    """The trainable tensors of the adapter a resumed run started from (``started``'s source,
    fetched again and checked against its recorded digest), loaded into the engine and copied
    out; the engine's tensors are put back. RecipeError (one line) where it cannot be had."""
    start = started.get("init_from")
    assert isinstance(start, dict)
    source, params = str(start["source"]), engine.trainable()
    now = [p.detach().clone() for p in params]
    try:
        with fetch_adapter(source, "lora.init_from") as fetched:
            if StartAdapter.of(fetched).sha256 != start["sha256"]:
                raise NxdError(f"{source} has changed since the run started from it")
            for m in engine.modules:
                load_adapter(m, fetched.path, inject=False)
        return [p.detach().clone() for p in params]
    except NxdError as e:
        raise RecipeError(f"cannot resume: the reference log-probs of the pairs not reached yet need the adapter "
                          f"the run started from ({e}); start fresh with --no-resume") from None
    finally:
        with torch.no_grad():
            for p, v in zip(params, now, strict=True):
                p.copy_(v)


def _read_store(data: DataLoaders, key: str, splits: list[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The values stored under ``key`` for ``splits`` (NaN where none) and the problems of what
    failed its checks (ignored, to be recomputed)."""
    if data.cache_entry is None:
        return {}, []
    sizes = {s: 2 * len(data.pairs[s].pairs) for s in splits}
    problems: list[str] = []
    try:
        whole = load_ref_logps(data.cache_entry, key, sizes) or {}
    except RefStoreError as e:
        whole, problems = {}, [str(e)]
    parts, damaged = load_parts(data.cache_entry, key, {s: n for s, n in sizes.items() if s not in whole})
    return {**parts, **whole}, problems + [str(e) for e in damaged]


def _broadcast(engine: Engine, read: tuple[dict[str, torch.Tensor], list[str]] | None,
               ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Global rank 0's reading of the store, on every rank."""
    if engine.state.world_size == 1:
        assert read is not None
        return read
    box: list[object] = [read]
    dist.broadcast_object_list(box, src=0, group=engine.state.host_group())
    got = box[0]
    assert isinstance(got, tuple)
    return got


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
    where = data.cache_entry / f"ref-{key}"
    return f"are not all stored ({where} holds some)" if where.is_dir() else f"are not stored ({where} is missing)"


def _same_start(recipe: Recipe, engine: Engine, model_dir: Path, started: Identity) -> bool:
    """The engine starts from the weights a resumed run started from: the same base, dtypes and
    starting adapter content."""
    return _content(_now(recipe, engine, model_dir, started)) == _content(started)


def _now(recipe: Recipe, engine: Engine, model_dir: Path, started: Identity) -> Identity | None:
    reference = str(started["reference"])
    return reference_identity(recipe, reference, model_dir, engine.start_adapter) if (
        reference != "init_from" or engine.start_adapter is not None) else None


def _content(ident: Identity | None) -> object:
    if ident is None:
        return None
    start = ident.get("init_from")
    return {**ident, "init_from": start.get("sha256") if isinstance(start, dict) else None}


def _refuse(recipe: Recipe, engine: Engine, model_dir: Path, started: Identity, where: str) -> None:
    """A resumed run recomputes its reference only from the same weights it started with:
    RecipeError, one line."""
    reference = str(started["reference"])
    now = _now(recipe, engine, model_dir, started)
    was = reference_label(started)
    fix = (f"put back lora.init_from={was.split(':', 1)[1]} to recompute them" if reference == "init_from"
           else "put back the model and dtypes it started with")
    raise RecipeError(f"cannot resume: {where}, and only the weights the run started from ({was}) can recompute "
                      f"them; lora.init_from now gives {reference_label(now) if now else 'no adapter'}: {fix}, or "
                      "start fresh with --no-resume")


def split_logps(engine: Engine, data: DataLoaders, split: str, weights: Weights) -> torch.Tensor:
    """Every pair of ``split``'s per-sequence reference log-probs (sample order) under ``weights``,
    each dp rank its share, gathered over dp. Collective."""
    batches = data.pairs[split]
    ids, logps = [], []
    pairs_and_batches = list(batches.reference_batches())
    for pair_ids, got in zip((i for i, _ in pairs_and_batches),
                             row_logps(engine, (b for _, b in pairs_and_batches), "", weights), strict=True):
        ids.append(pair_ids)
        logps.append(got)
    if engine.state.size("dp") > 1:
        gathered: list[object] = [None] * engine.state.size("dp")
        dist.all_gather_object(gathered, (ids, logps), group=engine.state.host_group("dp"))
        ids = [t for part in gathered for t in part[0]]  # type: ignore[index]
        logps = [t for part in gathered for t in part[1]]  # type: ignore[index]
    return assemble_ref_logps(len(batches.pairs), ids, logps)

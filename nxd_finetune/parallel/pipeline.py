"""Pipeline parallelism: cut a decoder into stages and run them with ``torch.distributed.pipelining``.

Stages and ranks. ``split_layers`` cuts ``num_hidden_layers`` into ``pp * virtual_stages`` stages
(global stage ``s`` holds a contiguous block of layers). Stage ``s`` runs on pipeline rank
``s % pp`` (torch's interleaved layout): with ``virtual_stages=2`` rank ``r`` holds chunks ``r``
and ``r + pp``. Stage 0 also holds ``model.embed_tokens``, the last stage ``model.norm`` and
``lm_head``.

Stage modules keep the full model's names. ``build_stage_module`` returns a
``DecoderForCausalLM`` *shell* that shares its submodules with the given model but holds only
the stage's layers in a ``ModuleDict`` keyed by their global index, so parameter names stay
``model.layers.<i>...`` / ``lm_head.weight``: HF checkpoint slices load and PEFT adapter keys come
out by name. The shell's forward is the model's own:
``forward(hidden_or_ids, position_ids=None, segment_ids=None)`` -> hidden states ``[B, T, H]``, or
logits ``[B, T, V]`` on the last stage, unless its ``return_hidden`` is set: then its final hidden
states, and the loss runs the output layer a chunk of target positions at a time
(``ParallelizeSpec.loss_chunk_rows``, :func:`nxd_finetune.loss.hidden_scores`).

Side inputs. Position and segment ids must reach every stage. In torch 2.13 the schedules pass
the positional ``step`` arguments to the first stage only (later stages get the received
activations instead), but ``step``'s keyword arguments are split into micro-batches on each
rank and given to *every* local stage (``PipelineStage.forward_one_chunk``: "kwargs can be
passed to all stages via respective step calls"). So :class:`PipelineRunner` calls
``schedule.step(input_ids (first rank only), position_ids=..., segment_ids=..., target=index
(last rank only))`` on every pipeline rank; only the hidden states travel between ranks. This
needs every rank of a pipeline group to be given the same micro-batches.

Side data. The objective is handed to each call (:meth:`PipelineRunner.train_step`,
:meth:`PipelineRunner.eval_step`), not stored. On the last stage each micro-batch's side data
(:meth:`Objective.side`: a dict of tensors, e.g. the labels and DPO's reference log-probs) is
taken from the micro-batch and kept for the call; the schedule's ``target`` is the micro-batch
index (a CPU ``[n]`` tensor that the schedule splits into one index per micro-batch), by which
the loss function finds its side data. The objective's metric sums come back from the loss by
micro-batch index and are summed, then broadcast from the last stage to every pipeline rank.

Loss and ``scale_grads``. The loss function gets ``n_targets`` (target tokens of the whole
optimizer step) through ``loss_kwargs``; each micro-batch loss is ``sum / n_targets``, as in
``sft/trainer.py``, so the accumulated gradient is already the token mean. The schedules are
built with ``scale_grads=False``: by default they would divide every gradient by the number of
micro-batches once more.

Tied embeddings (``tie_word_embeddings``). With ``pp > 1`` stage 0's ``embed_tokens.weight`` and
the last stage's ``lm_head.weight`` are two copies on two ranks. :meth:`PipelineRunner.step`
sums their gradients over a ``[first, last]`` process group after the backward, so both copies
get the full-model gradient and, stepped by the same optimizer, stay equal.

Eval. :meth:`PipelineRunner.eval_step` runs one batch forward only (GPipe / looped-BFS schedule
of one micro-batch) and returns the objective's eval statistics (supervised: ``[loss sum,
correct, targets]``) on every pipeline rank.

Router auxiliary loss. A mixture-of-experts model with ``output_router_logits`` sends
``(hidden, router sums)`` between stages (:mod:`nxd_finetune.parallel.pipeline_io`); the last adds
the loss, and :meth:`PipelineRunner.take_aux_loss` gives the step's share on every pipeline rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from nxd_finetune.errors import NxdError
from nxd_finetune.loss import LogitScores, Scores, hidden_scores, shift_labels
from nxd_finetune.models.llama import DecoderForCausalLM
from nxd_finetune.objective import SFT, Objective, SideData, add_stats, maxed_entries
from nxd_finetune.parallel.pipeline_io import MASK, RouterAux, RouterSumStage, aux_term, pad_to, router_masks
from nxd_finetune.parallel.recompute import recording_graph
from nxd_finetune.parallel.state import ParallelState

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase

# schedule name -> its class in torch.distributed.pipelining, imported when a pipeline first runs: the
# module costs ~1-2 s to import (torch.distributed.tensor with it), which every run without pp paid
SCHEDULES: dict[str, str] = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}
SIDE_INPUTS = ("position_ids", "segment_ids")
_MAX_CACHED_SHAPES = 4

# loss_fn(output, target, n_targets) -> the micro-batch's loss (its share of the step's mean)
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | int], torch.Tensor]


def split_layers(
    num_layers: int, pp: int, virtual_stages: int = 1, cuts: Sequence[int] | None = None
) -> list[list[int]]:
    """Layer indices of each of the ``pp * virtual_stages`` stages, in global stage order.

    ``cuts=None`` splits evenly and needs ``num_layers`` divisible by the number of stages (as
    ``recipe.check_against_model``); otherwise ``cuts`` are the first layer index of every stage
    after the first (``parallel.pp_cuts``): ``split_layers(4, 2, cuts=[1]) == [[0], [1, 2, 3]]``.
    Raises NxdError (one line, with the numbers) when the split is impossible.
    """
    for name, value in (("num_layers", num_layers), ("pp", pp), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise NxdError(f"{name} must be a positive integer, got {value!r}")
    stages = pp * virtual_stages
    what = f"pp*virtual_stages={pp}*{virtual_stages}={stages} stages"
    if cuts is None:
        if num_layers % stages:
            raise NxdError(f"{num_layers} layers do not split evenly into {what}; set parallel.pp_cuts")
        size = num_layers // stages
        bounds = list(range(0, num_layers + 1, size))
    else:
        cuts = list(cuts)
        if len(cuts) != stages - 1:
            raise NxdError(f"parallel.pp_cuts={cuts} has {len(cuts)} entries; {what} need {stages - 1}")
        bounds = [0, *cuts, num_layers]
        if any(not isinstance(c, int) or isinstance(c, bool) for c in cuts) or any(
            b <= a for a, b in zip(bounds, bounds[1:], strict=False)
        ):
            raise NxdError(
                f"parallel.pp_cuts={cuts} must be strictly increasing layer indices in 1..{num_layers - 1} "
                f"({num_layers} layers; every stage needs at least one layer)"
            )
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]


def stage_ids_of_rank(pp_rank: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Global stage indices held by pipeline rank ``pp_rank``: ``[r, r + pp, r + 2*pp, ...]``."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


def _shell(module: _ModuleT) -> _ModuleT:
    """A shallow copy of ``module`` with its own tables (children, parameters, buffers, hooks:
    every dict attribute) that share their entries, so replacing a child of the copy leaves the
    original alone."""
    new = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict):
            setattr(new, key, copy.copy(value))
    return new


def build_stage_module(model: DecoderForCausalLM, layer_ids: Sequence[int], first: bool,
                       last: bool) -> DecoderForCausalLM:
    """The pipeline stage of ``model`` (a ``DecoderForCausalLM``) holding ``layer_ids``.

    Returns a shell of the same class that shares submodules (and so parameters) with ``model``;
    ``model`` itself is left intact, so several chunks can be cut from one model (interleaved
    schedules). ``model.layers`` holds only the stage's layers, keyed by global index;
    ``model.embed_tokens`` is None unless ``first``; ``model.norm`` and ``lm_head`` are None unless
    ``last``. Drop the full model afterwards so the layers no stage holds are freed.
    Attributes added: ``stage_layer_ids``, ``stage_first``, ``stage_last``.
    Raises NxdError for a layer index the model does not have.
    """
    layers = model.model.layers
    missing = [i for i in layer_ids if str(i) not in layers]
    if missing:
        raise NxdError(f"pipeline stage layers {missing} are not in the model (layers 0..{len(layers) - 1})")
    stage = _shell(model)
    stage.model = _shell(model.model)
    stage.model.layers = nn.ModuleDict({str(i): layers[str(i)] for i in layer_ids})
    if not first:
        stage.model.embed_tokens = None
    if not last:
        stage.model.norm = None
        stage.lm_head = None
    # torch's stub types Module.__setattr__ for tensors and modules only; plain attributes are fine
    stage.stage_layer_ids, stage.stage_first, stage.stage_last = (
        list(layer_ids), first, last)  # type: ignore[assignment]
    return stage


def build_stages(model: nn.Module, state: ParallelState, virtual_stages: int = 1,
                 cuts: Sequence[int] | None = None) -> list[nn.Module]:
    """This rank's stage modules (one per virtual stage, in local order) cut from ``model`` (a
    ``DecoderForCausalLM``; NxdError otherwise)."""
    if not isinstance(model, DecoderForCausalLM):
        raise NxdError(f"pipeline parallel cuts a DecoderForCausalLM into stages, got {type(model).__name__}")
    pp = state.size("pp")
    split = split_layers(model.config.num_hidden_layers, pp, virtual_stages, cuts)
    n = len(split)
    return [build_stage_module(model, split[s], s == 0, s == n - 1)
            for s in stage_ids_of_rank(state.coord("pp"), pp, virtual_stages)]


@dataclasses.dataclass
class _Call:
    """One :meth:`PipelineRunner.train_step`'s objective, its micro-batches' side data (last stage)
    and their metric sums by micro-batch index (a schedule's shape inference runs one twice)."""

    objective: Objective
    sides: list[SideData]
    stats: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    units: list[torch.Tensor] = dataclasses.field(default_factory=list)  # each micro-batch's (router aux loss)
    aux: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # their logged aux shares


class PipelineRunner:
    """Forward + backward of one optimizer step's micro-batches through a pipeline schedule.

    ``stage_modules``: this rank's stages in local order (``build_stages``): one for ``1f1b`` and
    ``gpipe``, ``virtual_stages`` (>= 2) for ``interleaved_1f1b``. ``state``: the ParallelState
    (``pp_size >= 2``; the pipeline runs over ``state.group("pp")``). The last stage's loss and eval
    statistics are those of the objective each call is handed (:mod:`nxd_finetune.objective`;
    default supervised cross entropy) over this rank's vocabulary shard; ``loss_fn(logits,
    labels, n_targets)`` / ``stats_fn(logits, targets)`` replace them (the NxD-style API's custom
    loss).
    ``loss_chunk_rows``: the last stage returns hidden states and its output layer runs inside the
    objective's scores, this many target positions at a time. Construction is collective over the
    world when the model has tied embeddings (it creates the [first, last] stage groups).
    Stage buffers are sized from the first micro-batch of a shape; a new shape builds (and
    caches) a new schedule, which costs one extra metadata forward/backward.
    """

    def __init__(self, stage_modules: Sequence[nn.Module], state: ParallelState, schedule: str = "1f1b",
                 n_microbatches: int = 1, loss_fn: LossFn | None = None,
                 stats_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 loss_chunk_rows: int | None = None) -> None:
        if schedule not in SCHEDULES:
            raise NxdError(f"pipeline schedule {schedule!r} is not supported (supported: {', '.join(SCHEDULES)})")
        if state.size("pp") < 2:
            raise NxdError(f"PipelineRunner needs pp >= 2 (pp={state.size('pp')}); run micro-batches directly")
        chunks = len(stage_modules)
        interleaved = schedule == "interleaved_1f1b"
        if interleaved and chunks < 2 or not interleaved and chunks != 1:
            need = "at least 2 stage modules per rank" if interleaved else "exactly 1 stage module per rank"
            raise NxdError(f"pipeline schedule {schedule} needs {need}, got {chunks}")
        pp = state.size("pp")
        if (n_microbatches < 1 or schedule == "1f1b" and n_microbatches < pp
                or interleaved and n_microbatches % max(1, n_microbatches // pp)):
            raise NxdError(f"{n_microbatches} micro-batches do not fit pipeline schedule {schedule} with pp={pp} "
                           "(1f1b needs n >= pp; interleaved_1f1b needs n divisible by max(1, n // pp))")
        self.state, self.schedule_name, self.n_microbatches = state, schedule, n_microbatches
        self.stage_modules = list(stage_modules)
        self.num_stages = state.size("pp") * chunks
        self.stage_ids = stage_ids_of_rank(state.coord("pp"), state.size("pp"), chunks)
        self._call: _Call | None = None  # the train_step under way
        self.custom_loss, self.stats_fn = loss_fn, stats_fn
        self._tp_group = state.group("tp") if state.size("tp") > 1 else None
        self._head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._rows = 0
        if loss_chunk_rows is not None and state.is_last_stage and loss_fn is None and stats_fn is None:
            self._head_in_loss(loss_chunk_rows)
        self.device = next(self.stage_modules[0].parameters()).device
        self._schedules: dict[tuple[int, ...], Any] = {}
        self._stepped: weakref.WeakSet[Any] = weakref.WeakSet()  # schedules past their first (shape-inferring) step
        self._tied_group = self._make_tied_group()
        # the router auxiliary loss, unless a custom loss replaces the objective's
        self.router_aux = RouterAux.of(self.stage_modules[0]) if loss_fn is None and stats_fn is None else None
        self.aux_loss: torch.Tensor | None = None

    # ------------------------------------------------------------------ set-up

    def _head_in_loss(self, rows: int) -> None:
        """The last stage returns its final hidden states; the objective's scores run its output
        layer over the target positions, ``rows`` at a time (no ``[tokens, vocab]`` logits)."""
        last = self.stage_modules[-1]
        if not isinstance(last, DecoderForCausalLM) or last.lm_head is None:
            raise NxdError("a chunked pipeline loss needs the last stage of a DecoderForCausalLM")
        last.return_hidden = True
        self._head, self._rows = last.head, rows  # lm_head and the final soft-cap (Gemma 2)

    def _scores(self, output: torch.Tensor, labels: torch.Tensor) -> Scores:
        """The last stage's ``output`` (logits, or hidden states with the head in the loss) as the
        objective reads it."""
        if self._head is not None:
            return hidden_scores(output, labels, head=self._head, rows=self._rows, tp_group=self._tp_group)
        return LogitScores(output, shift_labels(labels), self._tp_group)

    def _loss(self, output: torch.Tensor, index: torch.Tensor, n_targets: torch.Tensor | int) -> torch.Tensor:
        """The schedule's loss function: micro-batch ``index``'s loss (its share of the step's mean)
        from the objective of the call under way and the micro-batch's side data."""
        call = self._call
        assert call is not None, "the schedule's loss runs inside PipelineRunner.train_step"
        i = int(index.reshape(-1)[0])
        side = call.sides[i]
        if self.custom_loss is not None:
            return self.custom_loss(output, side["labels"], n_targets)
        sums = None
        if isinstance(output, tuple):  # (output, the router sums of every stage)
            output, sums = output
        loss, stats = call.objective.loss(self._scores(output, call.objective.labels(side)), side)
        if stats is not None:
            call.stats[i] = stats
        if sums is None or self.router_aux is None:
            return loss / n_targets
        term, call.aux[i] = aux_term(self.router_aux, sums, call.units[i], n_targets)
        return loss / n_targets + term

    def _make_tied_group(self) -> dist.ProcessGroup | None:
        """The [first, last] stage group of this rank's pipeline, if embeddings are tied."""
        config = getattr(self.stage_modules[0], "config", None)
        if not getattr(config, "tie_word_embeddings", False):
            return None
        mine = None
        for ranks in self.state.layout.groups("pp"):
            group = dist.new_group([ranks[0], ranks[-1]])
            if self.state.rank in (ranks[0], ranks[-1]):
                mine = group
        return mine

    def _tied_weight(self) -> nn.Parameter | None:
        """This rank's copy of the tied embedding (None on middle ranks)."""
        for module, sid in zip(self.stage_modules, self.stage_ids, strict=True):
            assert isinstance(module, DecoderForCausalLM)  # the tied group exists for stages of a tied decoder
            owner = module.model.embed_tokens if sid == 0 else module.lm_head if sid == self.num_stages - 1 else None
            if owner is not None:
                weight = getattr(owner, "weight", None)
                if not isinstance(weight, nn.Parameter):
                    raise NxdError(f"tied embeddings with pp > 1 need a plain weight on {type(owner).__name__}")
                return weight
        return None

    def _schedule_for(self, shape: tuple[int, ...], train: bool = True) -> Any:
        """The schedule for micro-batches of ``shape`` (cached): ``train`` runs forward + backward of
        ``n_microbatches`` with the loss, else one forward-only micro-batch (eval)."""
        key = (train, *shape)
        if key not in self._schedules:
            from torch.distributed import pipelining

            if len(self._schedules) >= _MAX_CACHED_SHAPES:
                self._schedules.pop(next(iter(self._schedules)))
            aux = self.router_aux
            stages: list[_PipelineStageBase] = [
                pipelining.PipelineStage(m if aux is None else RouterSumStage(m, aux), sid, self.num_stages,
                                         self.device, group=self.state.group("pp"))
                for m, sid in zip(self.stage_modules, self.stage_ids, strict=True)
            ]
            multi = len(stages) > 1
            if train:
                # scale_grads=False: the loss is already divided by the step's target tokens
                cls = getattr(pipelining, SCHEDULES[self.schedule_name])
                schedule = cls(stages if multi else stages[0], self.n_microbatches, loss_fn=self._loss,
                               scale_grads=False)
            else:  # forward only; these two accept a single micro-batch
                schedule = (pipelining.ScheduleLoopedBFS(stages, 1) if multi
                            else pipelining.ScheduleGPipe(stages[0], 1))
            self._schedules[key] = schedule
        return self._schedules[key]

    def _uniform(self, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """The micro-batches' fields (model inputs and what the objective reads, e.g. preference
        ``ref_logps``), padded to one shape."""
        mbs = [dict(b) for b in micro_batches]
        if any(m.keys() != mbs[0].keys() for m in mbs):
            raise NxdError("pipeline micro-batches of one step must all carry the same fields")
        rows = max(m["input_ids"].shape[0] for m in mbs)
        cols = max(m["input_ids"].shape[1] for m in mbs)
        return [m if m["input_ids"].shape == (rows, cols) else pad_to(m, rows, cols) for m in mbs]

    def _inputs(self, mbs: list[dict[str, torch.Tensor]]) -> tuple[tuple, dict[str, torch.Tensor]]:
        """``step`` arguments of this rank: ids for the first stage only (later stages receive hidden
        states); position/segment ids as keyword arguments, which every local stage gets."""
        kwargs = {k: torch.cat([m[k] for m in mbs]) for k in SIDE_INPUTS if k in mbs[0]}
        args = (torch.cat([m["input_ids"] for m in mbs]),) if self.state.is_first_stage else ()
        return args, kwargs

    def _from_last(self, value: torch.Tensor | None, size: tuple[int, ...] = ()) -> torch.Tensor:
        """Broadcast ``value`` (given on the last stage) to every rank of the pipeline group."""
        out = value.detach().float() if value is not None else torch.zeros(size, device=self.device)
        dist.broadcast(out, src=self.state.ranks("pp")[-1], group=self.state.group("pp"))
        return out

    def step(self, micro_batches: Sequence[Mapping[str, torch.Tensor]],
             n_targets: torch.Tensor | int | None = None) -> torch.Tensor:
        """:meth:`train_step` of the supervised objective; returns the step loss."""
        return self.train_step(micro_batches, n_targets, SFT)[0]

    def train_step(self, micro_batches: Sequence[Mapping[str, torch.Tensor]], n_targets: torch.Tensor | int | None,
                   objective: Objective) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward and backward of one optimizer step's ``micro_batches`` (dicts of ``input_ids``,
        ``labels``, optional ``position_ids``/``segment_ids``, each ``[B, T]``, and the fields
        ``objective`` reads); every rank of the pipeline group passes the same micro-batches.
        Gradients accumulate into ``.grad``.

        ``n_targets``: the objective's units of the whole optimizer step (default: counted here;
        pass the count summed over dp ranks under data parallelism). Micro-batches of unequal
        shape are padded to the largest (no loss, no attention to real tokens). Returns the step
        loss (sum of micro-batch losses, detached, fp32) and the objective's metric sums over the
        micro-batches (None when it has none), both the same on every rank of the pipeline
        group. Call once per optimizer step, gradients zeroed before: the tied-embedding sync
        sums the accumulated gradients.
        """
        if len(micro_batches) != self.n_microbatches:
            raise NxdError(f"pipeline step got {len(micro_batches)} micro-batches, expected {self.n_microbatches}")
        mbs = self._uniform(micro_batches)
        if n_targets is None:
            n_targets = torch.stack([objective.count(m) for m in mbs]).sum().clamp(min=1)
        schedule = self._schedule_for(tuple(mbs[0]["input_ids"].shape))
        args, kwargs = self._inputs(mbs)
        last = self.state.is_last_stage
        call = _Call(objective, [objective.side(m) for m in mbs] if last else [])
        if self.router_aux is not None:
            kwargs[MASK] = router_masks(micro_batches, *mbs[0]["input_ids"].shape)
            call.units = [objective.count(m) for m in mbs] if last else []
        index = torch.arange(len(mbs)) if last else None  # on the CPU: read without a device sync
        losses: list[torch.Tensor] | None = [] if last else None
        self._call = call
        try:
            # a new schedule's first step infers the gradients' shapes with torch.autograd.grad
            with recording_graph() if schedule not in self._stepped else contextlib.nullcontext():
                schedule.step(*args, target=index, losses=losses, return_outputs=False,
                              loss_kwargs={"n_targets": n_targets}, **kwargs)
        finally:
            self._call = None
        self._stepped.add(schedule)
        loss = self._from_last(torch.stack(losses).sum() if losses else None)
        if self.router_aux is not None:  # the step's aux shares, for every rank
            self.aux_loss = self._from_last(torch.stack([call.aux[i] for i in sorted(call.aux)]).sum() if last
                                            else None)
        stats = None
        if objective.train_width:  # the objective's step metrics, computed on the last stage, for every rank
            mine = None
            for i in sorted(call.stats) if last else ():
                mine = add_stats(mine, call.stats[i], maxed_entries(objective))
            stats = self._from_last(mine, (objective.train_width,))
        self.sync_tied_grads()
        return loss, stats

    @torch.no_grad()
    def eval_step(self, batch: Mapping[str, torch.Tensor], objective: Objective = SFT) -> torch.Tensor:
        """Forward only of one batch: ``objective``'s eval statistics (supervised: ``[loss summed
        over targets, correct next-token predictions, targets]``, fp32), the same on every rank of
        the pipeline group (the trainer's eval sums these over batches)."""
        mb = self._uniform([batch])
        schedule = self._schedule_for(tuple(mb[0]["input_ids"].shape), train=False)
        args, kwargs = self._inputs(mb)
        logits = schedule.step(*args, **kwargs)
        if isinstance(logits, tuple):  # (logits, the router sums)
            logits = logits[0]
        stats = None
        if self.state.is_last_stage:
            if self.stats_fn is not None:
                stats = self.stats_fn(logits, shift_labels(mb[0]["labels"]))
            else:
                side = objective.side(mb[0])
                stats = objective.eval_stats(self._scores(logits, objective.labels(side)), side)
        return self._from_last(stats, (3,) if self.stats_fn is not None else (objective.eval_width,))

    def take_aux_loss(self) -> torch.Tensor | None:
        """The router auxiliary loss shares of the last :meth:`train_step`'s micro-batches, summed
        (``aux x units / n_targets`` each; fp32, the same on every pipeline rank; None without
        one), reset."""
        out, self.aux_loss = self.aux_loss, None
        return out

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Give the last stage's tied ``lm_head`` copy the first stage's embedding values (after a
        random initialisation that drew the two apart). Collective over the [first, last] stage
        groups (every rank calls it); no-op without tied embeddings."""
        weight = self._tied_weight() if self._tied_group is not None else None
        if weight is not None:
            src = self.state.ranks("pp")[0]
            dist.broadcast(weight.data, src=src, group=self._tied_group)

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Sum the gradients of the two tied-embedding copies (first and last stage). No-op
        without tied embeddings, on middle ranks, and for a frozen embedding."""
        weight = self._tied_weight() if self._tied_group is not None else None
        if weight is None or not weight.requires_grad:
            return
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=self._tied_group)

    def not_counted_parameters(self) -> list[nn.Parameter]:
        """The last stage's tied ``lm_head`` copy, which stage 0's embedding already counts in the
        global gradient norm (empty otherwise)."""
        if self._tied_group is None or not self.state.is_last_stage:
            return []
        weight = self._tied_weight()
        return [weight] if weight is not None else []

    def grad_norm_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters of this rank that count towards the global gradient norm: the
        last stage's tied ``lm_head`` copy is left out (stage 0 counts it). Sum the squared norms
        over ``state.group("pp")`` for the model's norm (and over tp for sharded parameters)."""
        skip = self._tied_weight() if self._tied_group is not None and self.state.is_last_stage else None
        seen, out = set(), []
        for module in self.stage_modules:
            for p in module.parameters():
                if p.requires_grad and p is not skip and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

"""GRPO's batch source (:class:`~nxd_finetune.sft.source.BatchSource`): completions sampled on the
training model, scored, and laid out as :mod:`nxd_finetune.rl.objective`'s micro-batches.

A step's generation batch is ``micro_batch_size x grad_accum x dp`` completions (TRL's
``generation_batch_size`` with ``steps_per_generation = gradient_accumulation_steps``): that many
over ``num_generations`` prompts, taken in order from the prompt data (shuffled per epoch with
``data.shuffle``), each repeated ``num_generations`` times (TRL's ``RepeatSampler`` order), and dp
rank ``r`` samples the ``r``-th slice. Every ``num_iterations``-th step generates (TRL's reuse);
the steps between reuse the same micro-batches. Generating:

1. sample the completions on the engine's own model (:func:`nxd_finetune.rl.sampler.sample`, KV
   cache; under tp the vocabulary shards gathered), each row seeded by the run's seed, the step and
   its place in the generation batch, so every layout and a resumed run sample the same; pipeline
   parallel and sequence parallel are refused (one line);
2. score them with the reward functions (:func:`nxd_finetune.rl.rewards.score`), gather the scores
   over dp and compute the advantages over the whole generation batch as TRL does;
3. with ``num_iterations`` > 1 the old log-probs, with ``beta`` > 0 the reference's, each through
   the engine's eval call (:class:`TokenLogps`, every layout). No second model: the reference
   (:func:`reference_weights`) is the adapter off (``base``) or the adapter the run started from
   (``init_from``: a copy of the trainable tensors taken when the source is made, before a resumed
   run loads its checkpoint, swapped in for the pass).

The generation metrics (TRL's names: ``reward``, ``reward_std``, ``rewards/<name>/mean`` and
``/std``, ``frac_reward_zero_std``, ``completions/mean_length``, ``min_length``, ``max_length``,
``clipped_ratio``, ``mean_terminated_length`` ...) are over the whole generation batch, kept until
:meth:`GRPOSource.metrics` takes them (averaged per key, as TRL's logging window), with this
rank's sampling time apart from training: ``time/generation_s`` (seconds sampling a step's
completions) and ``time/generation_tokens_per_s`` (completion tokens sampled per second).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nxd_finetune.data.formats import load_chat_template
from nxd_finetune.data.prompts import PromptRow, load_prompt_data, prompt_rows
from nxd_finetune.errors import NxdError
from nxd_finetune.loss import IGNORE_INDEX
from nxd_finetune.rl.metrics import generation_metrics
from nxd_finetune.rl.objective import TokenLogps, grpo_reference
from nxd_finetune.rl.rewards import Reward, TrainerState, advantages, build_rewards, score
from nxd_finetune.rl.sampler import Completions, SamplingSettings, left_pad, sample
from nxd_finetune.rl.section import RLSection

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.sft.engine import Engine
    from nxd_finetune.sft.setup import RankRun

Batch = dict[str, torch.Tensor]
Weights = Callable[[], contextlib.AbstractContextManager[None]]
"""The reference's weights: a context in which the engine's model is the reference."""
Generate = Callable[["Engine", Sequence[PromptRow], int], Completions]
"""How a step's completions are made: ``(engine, rows, step) -> Completions`` of ``rows`` (a
prompt's group consecutive), one completion per row. Default: :func:`sample_completions`."""


def step_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of row ``row`` of ``step``'s generation batch (every rank that holds the
    row, on any layout, draws it the same)."""
    return (seed * 1_000_003 + step * 7919 + row * 104_729) % (2**63 - 1)


def completions_of(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                   stop_ids: Sequence[int], pad_id: int) -> Completions:
    """:class:`Completions` of given token lists (a stop token included where the completion
    ended), truncated as TRL reads it: the last token neither a stop id nor the pad id."""
    ids, mask = left_pad(prompts, pad_id)
    width = max(1, *(len(c) for c in completions))
    out = torch.full((len(completions), width), pad_id, dtype=torch.long)
    cmask = torch.zeros(len(completions), width, dtype=torch.long)
    for row, c in enumerate(completions):
        out[row, :len(c)] = torch.tensor(list(c), dtype=torch.long)
        cmask[row, :len(c)] = 1
    ends = set(stop_ids) | {pad_id}
    truncated = torch.tensor([not c or c[-1] not in ends for c in completions])
    return Completions(ids, mask, out, cmask, truncated)


def token_logps(engine: Engine, batch: Batch, temperature: float) -> torch.Tensor:
    """``[B, T]`` log-probs of ``batch``'s targets (at the predicting position; 0 elsewhere) under
    the engine's model as it stands, in eval mode. Collective like :meth:`Engine.eval_stats`."""
    rows, width = batch["labels"].shape
    was_training = engine.modules[0].training
    engine.train(False)
    try:
        moved = {k: v.to(engine.device) for k, v in batch.items()
                 if k in ("input_ids", "labels", "prompt_lengths", "n_tokens")}
        flat = engine.eval_stats(moved, TokenLogps(rows, width, temperature))
    finally:
        engine.train(was_training)
    return flat.reshape(rows, width).float().cpu()


@dataclasses.dataclass
class GRPOSource:
    """The GRPO batch source (module docstring). ``rows``: the prompt data; ``generate``: how
    completions are made (None: sampled on the engine's model); ``reference``: the KL term's
    weights (:func:`reference_weights`; None: the adapter off)."""

    rl: RLSection
    rows: list[PromptRow]
    tokenizer: PreTrainedTokenizerBase
    rewards: list[Reward]
    micro_batch_size: int
    grad_accum: int
    total_steps: int
    stop_ids: tuple[int, ...]
    pad_id: int
    seed: int = 0
    shuffle: bool = False
    dp_rank: int = 0
    dp_world: int = 1
    dp_group: dist.ProcessGroup | None = None
    generate: Generate | None = None
    reference: Weights | None = None
    epoch: int = 0
    cursor: int = 0
    buffer: list[Batch] | None = None
    _metrics: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        g = self.rl.num_generations
        if self.rows_per_step % g:
            raise NxdError(f"a step's completions (micro_batch_size x grad_accum x dp = {self.rows_per_step}) are not "
                           f"a multiple of rl.num_generations={g}: each prompt's group must be whole")
        if not self.rows:
            raise NxdError("the prompt data is empty")

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp_world

    # ------------------------------------------------------------------ BatchSource

    def next_step(self, engine: Engine, step: int) -> tuple[list[Batch], int]:
        if (step - 1) % self.rl.num_iterations == 0 or self.buffer is None:
            self.buffer = self._generation(engine, step)
        return [dict(b) for b in self.buffer], sum(int(b["n_tokens"].sum()) for b in self.buffer)

    def state_dict(self) -> dict[str, object]:
        state: dict[str, object] = {"epoch": self.epoch, "cursor": self.cursor}
        if self.rl.num_iterations > 1 and self.buffer is not None:
            state["buffer"] = {f"{i}/{k}": v for i, b in enumerate(self.buffer) for k, v in b.items()}
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        epoch, cursor = state.get("epoch"), state.get("cursor")
        if not isinstance(epoch, int) or not isinstance(cursor, int) or set(state) - {"epoch", "cursor", "buffer"}:
            raise NxdError(f"the checkpoint's data record {sorted(state)} is not a GRPO source's position (was it "
                           "saved by a run with another objective?)")
        self.epoch, self.cursor = epoch, cursor
        buffer = state.get("buffer")
        if isinstance(buffer, dict):
            if self.dp_world > 1:
                raise NxdError("resuming a GRPO run between the num_iterations steps of one generation is not "
                               "supported at dp > 1 yet; resume from a checkpoint at a generation step")
            out: dict[int, Batch] = {}
            for key, value in buffer.items():
                i, name = key.split("/", 1)
                out.setdefault(int(i), {})[name] = value
            self.buffer = [out[i] for i in sorted(out)]

    def close(self) -> None:
        self.buffer = None

    def metrics(self) -> dict[str, float]:
        """The generation metrics since the last call, each the mean of its values (TRL's window)."""
        out = {k: sum(v) / len(v) for k, v in self._metrics.items() if v}
        self._metrics = {}
        return out

    # ------------------------------------------------------------------ one generation

    def _take_prompts(self) -> list[PromptRow]:
        """The next ``rows_per_step / num_generations`` prompts, continuing into the next epoch."""
        out: list[PromptRow] = []
        while len(out) < self.rows_per_step // self.rl.num_generations:
            order = self._order()
            out.append(self.rows[order[self.cursor]])
            self.cursor += 1
            if self.cursor == len(self.rows):
                self.epoch, self.cursor = self.epoch + 1, 0
        return out

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.rows)))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def _generation(self, engine: Engine, step: int) -> list[Batch]:
        g = self.rl.num_generations
        prompts = [p for p in self._take_prompts() for _ in range(g)]
        local = len(prompts) // self.dp_world
        mine = prompts[self.dp_rank * local:(self.dp_rank + 1) * local]
        generate = self.generate or sample_completions(self.rl, self.stop_ids, self.pad_id, self.seed,
                                                       self.dp_rank * local)
        started = time.perf_counter()
        done = generate(engine, mine, step)
        sampled = time.perf_counter() - started
        ids = done.completions()
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] if isinstance(p.prompt, list) else t
                       for p, t in zip(mine, texts, strict=True)]
        columns = {name: [p.columns.get(name) for p in mine] for name in (mine[0].columns if mine else {})}
        scores = score(self.rewards, [p.prompt for p in mine], completions, ids, columns,
                       TrainerState(global_step=step - 1, max_steps=self.total_steps))
        lengths = done.completion_mask.sum(1)
        everything = self._gather(torch.cat([scores, lengths[:, None].float(), done.truncated[:, None].float()], 1))
        all_scores = everything[:, :-2]
        weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float32)
        adv = advantages(all_scores, weights, g, self.rl.scale_rewards, self.rl.multi_objective_aggregation)
        timing = {"time/generation_s": sampled,
                  "time/generation_tokens_per_s": float(lengths.sum()) / max(sampled, 1e-9)}
        for k, v in {**generation_metrics(self.rewards, all_scores, adv, everything[:, -2],
                                          everything[:, -1].bool()), **timing}.items():
            self._metrics.setdefault(k, []).append(v)
        my_adv = adv.advantages[self.dp_rank * local:(self.dp_rank + 1) * local]
        batches = self._micro_batches(mine, done, my_adv)
        for b in batches:
            if self.rl.num_iterations > 1:
                b["old_logps"] = token_logps(engine, b, self.rl.temperature)
            if self.rl.beta:
                with (self.reference or reference_weights(engine, "base"))():
                    b["ref_logps"] = token_logps(engine, b, self.rl.temperature)
        return batches

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.dp_world == 1:
            return local
        parts: list[torch.Tensor | None] = [None] * self.dp_world
        dist.all_gather_object(parts, local, group=self.dp_group)
        return torch.cat([p for p in parts if p is not None])

    def _micro_batches(self, rows: Sequence[PromptRow], done: Completions, adv: torch.Tensor) -> list[Batch]:
        """``rows``' completions as micro-batches of ``micro_batch_size`` (see the objective's
        contract); ``n_tokens``: each row's tokens, padding not counted."""
        loss_mask = done.completion_mask.clone()
        if self.rl.mask_truncated_completions:
            loss_mask[done.truncated] = 0
        out = []
        for start in range(0, len(rows), self.micro_batch_size):
            part = range(start, min(start + self.micro_batch_size, len(rows)))
            seqs, labels, prompts = [], [], []
            for i in part:
                prompt = done.prompt_ids[i][done.prompt_mask[i].bool()].tolist()
                prompts.append(len(prompt))
                n = int(done.completion_mask[i].sum())
                completion = done.completion_ids[i, :n].tolist()
                keep = loss_mask[i, :n].tolist()
                seqs.append(prompt + completion)
                labels.append([IGNORE_INDEX] * len(prompt) + [t if k else IGNORE_INDEX
                                                              for t, k in zip(completion, keep, strict=True)])
            width = max(len(s) for s in seqs)
            ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
            lab = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
            for r, (s, lb) in enumerate(zip(seqs, labels, strict=True)):
                ids[r, :len(s)] = torch.tensor(s)
                lab[r, :len(lb)] = torch.tensor(lb)
            out.append({"input_ids": ids, "labels": lab, "advantages": adv[start:start + len(seqs)].float(),
                        "n_tokens": torch.tensor([len(s) for s in seqs]), "prompt_lengths": torch.tensor(prompts)})
        return out


def reference_weights(engine: Engine, kind: str) -> Weights:
    """The KL reference's weights on ``engine`` (:func:`~nxd_finetune.rl.objective.grpo_reference`):
    ``base``: its LoRA layers contribute nothing; ``init_from``: its trainable tensors as they are
    now (the starting adapter, when called before any step or checkpoint load), swapped in."""
    from nxd_finetune.sft.reference import ReferenceWeights, adapter_off

    if kind == "init_from":
        return ReferenceWeights(engine.trainable())
    return lambda: adapter_off(engine.modules)


def sample_completions(rl: RLSection, stop_ids: Sequence[int], pad_id: int, seed: int, first_row: int) -> Generate:
    """The default :data:`Generate`: :func:`~nxd_finetune.rl.sampler.sample` on the engine's
    model (pipeline parallel refused), each row with its own generator seeded by :func:`step_seed`
    (``first_row``: the generation batch's index of the rank's first row)."""
    settings = SamplingSettings(rl.max_completion_length, rl.temperature, rl.top_p, rl.top_k or None)

    def generate(engine: Engine, rows: Sequence[PromptRow], step: int) -> Completions:
        if engine.runner is not None:
            raise NxdError("objective=grpo samples on the training model, which pipeline parallel splits into "
                           "stages: not supported yet (use parallel.pp: 1)")
        if engine.sequence_parallel:
            raise NxdError("objective=grpo samples on the training model: not supported with "
                           "parallel.sequence_parallel yet (set it false)")
        generators = [torch.Generator(device=engine.device).manual_seed(step_seed(seed, step, first_row + i))
                      for i in range(len(rows))]
        return sample(engine.model, [r.ids for r in rows], settings, stop_ids, pad_id,  # type: ignore[arg-type]
                      generators, vocab_group=engine.tp_group)
    return generate


def grpo_source(rr: RankRun, generate: Generate | None = None) -> GRPOSource:
    """The GRPO source of a rank (a :data:`~nxd_finetune.sft.setup.SourceFactory`): the recipe's
    prompt data (``data.train``, the ``prompt`` format) and ``rl`` section."""
    from nxd_finetune.serve.generate import stop_token_ids

    recipe = rr.recipe
    rl = recipe.rl
    if rl is None:
        raise NxdError("objective=grpo needs an rl section (at least rl.reward_funcs)")
    if recipe.training.max_steps is None:
        raise NxdError("objective=grpo needs training.max_steps (its steps are generations, not passes over "
                       "loader batches)")
    d = recipe.data
    if d.eval is not None or d.eval_fraction:
        raise NxdError("objective=grpo has no eval over data.eval / data.eval_fraction yet (a GRPO eval samples "
                       "completions): remove them (eval.prompts still shows sample generations)")
    template = load_chat_template(d.chat_template)
    rows = prompt_rows(load_prompt_data(d.train), rr.tokenizer, d.fields.get("prompt", "prompt"), template,
                       d.chat_template_kwargs, rl.max_prompt_length)
    pad = rr.tokenizer.pad_token_id if rr.tokenizer.pad_token_id is not None else rr.tokenizer.eos_token_id
    kind = grpo_reference(rl, recipe.lora.init_from if recipe.lora else None)
    return GRPOSource(rl, rows, rr.tokenizer, build_rewards(rl), recipe.training.micro_batch_size, rr.grad_accum,
                      rr.total_steps, stop_token_ids(rr.tokenizer, rr.model_dir, template,
                                                     d.chat_template_kwargs), int(pad),
                      seed=recipe.training.seed, shuffle=d.shuffle, dp_rank=rr.layout.coord("dp"),
                      dp_world=rr.layout.size("dp"), dp_group=rr.layout.host_group("dp"), generate=generate,
                      reference=None if kind is None else reference_weights(rr.engine, kind))

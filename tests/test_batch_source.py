"""A batch source other than the loader's (``nxd_finetune.sft.source``) in a real run.

:class:`GreedySource` makes every optimizer step from the model being trained and from its own
state: a counter picks each row's prompt, the engine's model greedy-generates a completion of it
as the previous step left the weights, and the step trains on prompt + completion (loss on the
completion). ``run(recipe, source=...)`` on the shortened quickstart, single process: stopped by
SIGTERM after step 3 (the source sends it) and resumed, the run logs the same curve, counts the
same tokens and writes the same adapter as an uninterrupted one, which it can only do when the
checkpoint carried the source's counter; resumed with the default (loader) source instead, the
run stops in one line. ``NxdLightningModule(recipe, source=...)`` (one process):
the run's curve, and resumed from its own checkpoint of step 3 the same curve again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from cli_run import QUICKSTART, RUN, STEPS, curve, env, records  # noqa: F401

from nxd_finetune.sft.engine import Engine
from nxd_finetune.sft.setup import RankRun

pytestmark = [pytest.mark.usefixtures("one_thread_and_tmpdir"), pytest.mark.slow]  # end-to-end runs

PROMPT, NEW, ROWS = 4, 6, 2  # prompt tokens, generated tokens, rows per micro-batch


@dataclasses.dataclass
class GreedySource:
    """Step ``n``: ``grad_accum`` micro-batches of ``ROWS`` prompts (tokens picked by the counter),
    each completed greedily by the engine's model; the counter advances once per micro-batch.
    ``stop_at``: SIGTERM this process while making that step (the run then saves after it and stops)."""

    vocab: int
    grad_accum: int
    stop_at: int | None = None
    count: int = 0
    asked: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (step, counter) at each call

    def next_step(self, engine: Engine, step: int) -> tuple[list[dict[str, torch.Tensor]], int]:
        self.asked.append((step, self.count))
        if step == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        micro = []
        for _ in range(self.grad_accum):
            micro.append(self._generate(engine))
            self.count += 1
        return micro, sum(b["input_ids"].numel() for b in micro)

    def _generate(self, engine: Engine) -> dict[str, torch.Tensor]:
        model = engine.modules[0]
        ids = torch.tensor([[(11 * self.count + 5 * r + 3 * j + 1) % self.vocab for j in range(PROMPT)]
                            for r in range(ROWS)], device=engine.device)
        engine.train(False)  # no dropout while generating
        with torch.no_grad():
            for _ in range(NEW):
                next_ids = model(ids)[:, -1].float().argmax(-1, keepdim=True)
                ids = torch.cat([ids, next_ids], dim=1)
        engine.train(True)
        labels = ids.clone()
        labels[:, :PROMPT] = -100  # the loss is on the completion only
        return {"input_ids": ids, "labels": labels}

    def state_dict(self) -> dict[str, object]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, object]) -> None:
        count = state["count"]
        assert isinstance(count, int)
        self.count = count

    def close(self) -> None:
        pass


class Sources:
    """The factory handed to ``run``: one :class:`GreedySource` per call, kept for the asserts."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.made: list[GreedySource] = []

    def __call__(self, rr: RankRun) -> GreedySource:
        self.made.append(GreedySource(rr.engine.config.vocab_size, rr.grad_accum, self.stop_at))
        return self.made[-1]


def test_a_generating_source_stopped_and_resumed_trains_as_an_uninterrupted_run(env, tmp_path, monkeypatch):  # noqa: F811
    from nxd_finetune.checkpoint.training import TrainingStopped
    from nxd_finetune.errors import NxdError
    from nxd_finetune.recipe import load_recipe
    from nxd_finetune.sft import trainer

    monkeypatch.setenv("NXD_FINETUNE_CACHE", env["NXD_FINETUNE_CACHE"])

    def recipe(out: Path):
        return load_recipe(QUICKSTART, [*RUN, f"output.dir={out}", "training.grad_accum=2"])

    ref_out, out = tmp_path / "uninterrupted", tmp_path / "interrupted"
    uninterrupted = Sources()
    ref_summary = trainer.run(recipe(ref_out), source=uninterrupted)
    assert [a[0] for a in uninterrupted.made[0].asked] == list(range(1, STEPS + 1))

    stopping = Sources(stop_at=3)
    with pytest.raises(TrainingStopped):
        trainer.run(recipe(out), source=stopping)
    assert [r["step"] for r in records(out) if "train_loss" in r] == [1, 2, 3]
    assert (out / "checkpoints" / "step-00000003" / "manifest.json").exists()

    resumed = Sources()
    summary = trainer.run(recipe(out), source=resumed)
    assert summary is not None and ref_summary is not None and summary["resumed_from"].endswith("step-00000003")
    assert resumed.made[0].asked[0] == (4, 3 * 2)  # the counter came back with the checkpoint
    assert resumed.made[0].asked == uninterrupted.made[0].asked[3:]

    assert curve(out) == curve(ref_out)  # train and eval losses, exactly, in the same order
    assert [r["step"] for r in records(out) if "train_loss" in r] == list(range(1, STEPS + 1))
    assert summary["loss_tokens"] == ref_summary["loss_tokens"] == STEPS * 2 * ROWS * NEW
    assert summary["input_tokens"] == ref_summary["input_tokens"] == STEPS * 2 * ROWS * (PROMPT + NEW)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / "final" / name).read_bytes() == (ref_out / "final" / name).read_bytes(), name
    saved = json.loads((out / "checkpoints" / f"step-{STEPS:08d}" / "extra.json").read_text())
    assert saved["data"] == {"count": STEPS * 2}  # the source's state, where the loader's position was

    # the same checkpoint resumed with the default source (the loader's): one line, no traceback
    with pytest.raises(NxdError) as wrong:
        trainer.run(recipe(out))
    assert str(wrong.value) == ("the checkpoint's data record ['count'] is not a position of this run's train data "
                                "(was it saved by a run with another batch source?)")


def test_the_lightning_module_trains_on_the_source_and_resumes_it(env, tmp_path, monkeypatch):  # noqa: F811
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from nxd_finetune.lightning import NxdLightningModule, NxdModelCheckpoint, NxdStrategy
    from nxd_finetune.recipe import load_recipe
    from nxd_finetune.sft import trainer

    monkeypatch.setenv("NXD_FINETUNE_CACHE", env["NXD_FINETUNE_CACHE"])
    overrides = [*RUN, "training.grad_accum=2", "lora.dropout=0.0"]  # no dropout: Lightning's RNG use is its own
    reference = trainer.run(load_recipe(QUICKSTART, [*overrides, f"output.dir={tmp_path / 'run'}"]), source=Sources())
    assert reference is not None
    ref = {h["step"]: h["train_loss"] for h in reference["history"]}

    def fit(out: Path, sources: Sources, ckpt_path: str | None = None) -> dict[int, float]:
        module = NxdLightningModule(QUICKSTART, [*overrides, f"output.dir={out}"], source=sources)
        pl.Trainer(devices=1, accelerator="cpu", strategy=NxdStrategy(), max_steps=STEPS, logger=False,
                   callbacks=[NxdModelCheckpoint(out / "checkpoints", every_n_train_steps=3)],
                   enable_model_summary=False, enable_progress_bar=False, limit_val_batches=0,
                   num_sanity_val_steps=0).fit(module, ckpt_path=ckpt_path)
        return {h["step"]: h["train_loss"] for h in module.history if "train_loss" in h}

    first, again = Sources(), Sources()
    curve_one = fit(tmp_path / "one", first)
    assert sorted(curve_one) == list(range(1, STEPS + 1))
    assert [curve_one[s] == pytest.approx(ref[s], rel=1e-5) for s in ref] == [True] * STEPS, (curve_one, ref)
    resumed = fit(tmp_path / "resumed", again, str(tmp_path / "one" / "checkpoints" / "step-00000003"))
    assert again.made[0].asked[0] == (4, 3 * 2)  # the counter came back with Lightning's checkpoint
    assert resumed == curve_one  # the restored history, then the same steps exactly

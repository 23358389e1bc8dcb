"""Preference objectives against TRL: the same tiny Llama (fp32, random init), LoRA adapter, data
(text pairs and conversations) and hyper-parameters; our data pipeline's micro-batches equal TRL's
own collated batches (in order; each objective tokenized as its TRL trainer does), and on them our
engine's step loss and reward metrics equal TRL's per optimizer step within 1e-5; the adapter we
write loads in peft.
Also the recipe rules, the stable ORPO term and the scores' per-token NLL on every output form."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import yaml
from datasets import Dataset
from safetensors import safe_open
from torch.utils.data import SequentialSampler
from transformers import AutoModelForCausalLM

from nxd_finetune.data.datasets import DataSpec
from nxd_finetune.data.loader import build_dataloaders
from nxd_finetune.errors import NxdError, RecipeError
from nxd_finetune.export import ExportSpec, export_model
from nxd_finetune.loss import ChunkedScores, LogitScores, causal_lm_loss, shift_labels
from nxd_finetune.preference import DirectPreference, OddsRatioPreference, log1mexp, sequence_logps
from nxd_finetune.recipe import recipe_from_dict, reference_of
from nxd_finetune.recipe.resume import check_resume, describe_changes
from nxd_finetune.serve.evaluate import evaluate_recipe
from nxd_finetune.sft import trainer
from nxd_finetune.sft.engine import build_engine
from nxd_finetune.sft.reference import row_logps
from nxd_finetune.sft.setup import objective_of
from nxd_finetune.sft.step import train_step
from tests.preference_helpers import (
    LORA,
    chat_pairs,
    chat_word_tokenizer,
    dpo_recipe,
    dpo_setup,
    pairs,
    start_adapter,
    word_tokenizer,
)

trl = pytest.importorskip("trl")
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: E402

STEPS, PAIRS_PER_STEP, LR, BETA = 10, 2, 5e-3, 0.1


class Recorder:
    """A transformers callback keeping every training log record."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def __getattr__(self, name: str) -> Any:  # the other TrainerCallback hooks: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.logs.append(dict(logs))


def run_trl(kind: str, model_dir: Path, adapter: Path | None, data: list[dict[str, Any]], out: Path, **cfg: Any):
    """TRL's trainer of ``kind`` (dpo, cpo, orpo) over ``data`` in order (conversations: with
    :func:`chat_word_tokenizer`): (logs, its batches, trainer)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model = hf if adapter is None else peft.PeftModel.from_pretrained(hf, adapter, is_trainable=True)
    common = dict(output_dir=str(out), per_device_train_batch_size=PAIRS_PER_STEP, gradient_accumulation_steps=1,
                  learning_rate=LR, max_steps=STEPS, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1,
                  report_to=[], use_cpu=True, save_strategy="no", bf16=False, fp16=False, seed=0,
                  max_grad_norm=1.0, weight_decay=0.0, beta=BETA, dataloader_num_workers=0, max_length=None)
    base: type[Any]
    if kind == "dpo":
        base, args = DPOTrainer, DPOConfig(**common, gradient_checkpointing=False, disable_dropout=True, **cfg)
    elif kind == "cpo":
        base, args = CPOTrainer, CPOConfig(**common, **cfg)
    else:
        base, args = ORPOTrainer, ORPOConfig(**common, **cfg)

    class InOrder(base):  # type: ignore[misc, valid-type]
        def _get_train_sampler(self, train_dataset: Any = None) -> SequentialSampler:
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    rec = Recorder()
    tokenizer = chat_word_tokenizer() if isinstance(data[0]["chosen"], list) else word_tokenizer()
    trainer = InOrder(model=model, args=args, train_dataset=Dataset.from_list(data),
                      processing_class=tokenizer, callbacks=[rec])
    batches = list(trainer.get_train_dataloader())[:STEPS]
    trainer.recorded_batches = batches
    trainer.train()
    return rec.logs, batches, trainer


def our_batch(kind: str, b: dict[str, torch.Tensor], pad: int) -> dict[str, torch.Tensor]:
    """TRL's collated batch as our contract: [chosen; rejected] rows, labels -100 off the completions."""
    if kind == "dpo":
        ids = b["input_ids"]
        return {"input_ids": ids, "labels": ids.masked_fill(b["completion_mask"] == 0, -100)}
    c_ids, r_ids = b["chosen_input_ids"], b["rejected_input_ids"]
    t = max(c_ids.shape[1], r_ids.shape[1])

    def padded(x: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, t - x.shape[1]), value=fill)

    return {"input_ids": torch.cat([padded(c_ids, pad), padded(r_ids, pad)]),
            "labels": torch.cat([padded(b["chosen_labels"], -100), padded(b["rejected_labels"], -100)])}


def our_recipe(model_dir: Path, adapter: Path | None, out: Path, objective: str, **preference: Any):
    full = {"lora": None} if adapter is None else {}
    return recipe_from_dict({
        "model": {"path": str(model_dir)},
        "data": {"train": str(out / "unused.jsonl"), "format": "preference", "packing": False},
        "objective": objective, **({"preference": preference} if preference else {}),
        "lora": {"rank": LORA["r"], "alpha": LORA["lora_alpha"], "target_modules": LORA["target_modules"],
                 "init_from": str(adapter)},
        "training": {"micro_batch_size": PAIRS_PER_STEP, "max_steps": STEPS, "lr": LR, "scheduler": "constant",
                     "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.0, "device": "cpu"},
        "output": {"dir": str(out / "ours")}, **full,
    })


def data_of(form: str, seed: int, prompt: bool = True) -> list[dict[str, Any]]:
    """``STEPS * PAIRS_PER_STEP`` pairs: ``text`` (:func:`pairs`) or ``chat`` (:func:`chat_pairs`)."""
    return chat_pairs(STEPS * PAIRS_PER_STEP, seed=seed) if form == "chat" else \
        pairs(STEPS * PAIRS_PER_STEP, seed=seed, prompt=prompt)


def pipeline_batches(recipe, data: list[dict[str, Any]], trainer_, kind: str) -> list[dict[str, torch.Tensor]]:
    """Our data pipeline's first ``STEPS`` micro-batches of ``data`` (the recipe's data settings:
    its objective's tokenization), each equal to TRL's collated batch of the same step."""
    path = Path(recipe.output.dir).parent / "pairs.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in data))
    spec = DataSpec.from_recipe(recipe)
    spec.train, spec.shuffle = str(path), False
    tokenizer = trainer_.processing_class
    loaders = build_dataloaders(spec, tokenizer, micro_batch_size=PAIRS_PER_STEP, use_cache=False)
    stream = iter(loaders.train)
    ours = [next(stream) for _ in range(STEPS)]
    for step, (mine, theirs) in enumerate(zip(ours, trainer_.recorded_batches, strict=True), 1):
        want = our_batch(kind, theirs, tokenizer.pad_token_id)
        assert torch.equal(mine["input_ids"], want["input_ids"]), (step, mine["input_ids"], want["input_ids"])
        assert torch.equal(mine["labels"], want["labels"]), (step, mine["labels"], want["labels"])
    return ours


def run_ours(recipe, model_dir: Path, batches: list[dict[str, torch.Tensor]], reference: str | None):
    objective = objective_of(recipe)
    engine = build_engine(recipe, model_dir, torch.device("cpu"), STEPS)
    if reference is not None:  # the reference pass the run makes before its first step
        batches = [{**b, "ref_logps": logps} for b, logps in zip(batches, row_logps(engine, batches, reference),
                                                                  strict=True)]
    records = []
    engine.train(True)
    for b in batches:
        result = train_step(engine, [b], int(b["input_ids"].numel()), objective=objective)
        stats = result.stats
        assert stats is not None
        records.append({"loss": float(result.loss), **objective.train_record(stats.tolist())})
    return records, engine


def assert_same_curves(ours: list[dict[str, float]], theirs: list[dict[str, float]], keys: tuple[str, ...]) -> None:
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        for k in keys:
            assert a[k] == pytest.approx(b[k], abs=1e-5), (step, k, a[k], b[k])
    assert len({round(r["loss"], 4) for r in ours}) > 3  # it trained: the losses move


REWARDS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


@pytest.mark.parametrize(("loss_type", "form"), [("sigmoid", "text"), ("sigmoid", "chat"), ("ipo", "text"),
                                                  ("hinge", "chat")])
def test_dpo_equals_trl_per_step(loss_type, form, make_tiny_hf, tmp_path):
    _, model_dir = make_tiny_hf("llama")
    adapter = tmp_path / "start"
    start_adapter(model_dir, adapter)
    data = data_of(form, seed=0)
    logs, batches, trainer = run_trl("dpo", model_dir, adapter, data, tmp_path / "trl", loss_type=[loss_type])
    # TRL's reference for a PEFT model that starts from an adapter is that adapter (a frozen "ref"
    # copy); ours too, by default with lora.init_from
    recipe = our_recipe(model_dir, adapter, tmp_path, "dpo", beta=BETA, loss_type=loss_type)
    assert reference_of(recipe.objective, recipe.preference, recipe.lora.init_from) == "init_from"
    ours, engine = run_ours(recipe, model_dir, pipeline_batches(recipe, data, trainer, "dpo"), "init_from")
    assert_same_curves(ours, logs, REWARDS)
    if loss_type == "sigmoid":  # the adapter we write loads in peft and equals TRL's trained one
        spec = ExportSpec(mode="adapter", source_dir=model_dir, base_name=str(model_dir), dtype=torch.float32,
                          revision=None, tokenizer=None)
        export_model(engine.rank_model, tmp_path / "final", spec, config=engine.config, lora=engine.lora_config,
                     lora_targets=engine.lora_targets)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
        loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "final").eval()
        trained = trainer.model.eval()
        ids = batches[0]["input_ids"]
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, trained(ids).logits, atol=1e-4, rtol=1e-4)


def test_full_finetuning_dpo_equals_trl_per_step(make_tiny_hf, tmp_path):
    """Full fine-tuning: the reference is the initial model (TRL: a second copy loaded from the
    path; ours: its log-probs computed before the first step, no copy held)."""
    _, model_dir = make_tiny_hf("llama")
    data = pairs(STEPS * PAIRS_PER_STEP, seed=4)
    logs, batches, trainer_ = run_trl("dpo", model_dir, None, data, tmp_path / "trl", loss_type=["sigmoid"])
    pad = trainer_.processing_class.pad_token_id
    recipe = our_recipe(model_dir, None, tmp_path, "dpo", beta=BETA)
    assert recipe.lora is None and reference_of(recipe.objective, recipe.preference, None) == "base"
    ours, _ = run_ours(recipe, model_dir, [our_batch("dpo", b, pad) for b in batches], "base")
    assert_same_curves(ours, logs, REWARDS)


@pytest.mark.parametrize("form", ["text", "chat"])
def test_simpo_equals_trl_cpo_per_step(form, make_tiny_hf, tmp_path):
    """SimPO as TRL's ``CPOTrainer`` (``loss_type="simpo"``, ``cpo_alpha=0``), its tokenization
    included (its bos before the prompt, its eos after a conversation's end of turn)."""
    _, model_dir = make_tiny_hf("llama")
    adapter = tmp_path / "start"
    start_adapter(model_dir, adapter)
    data = data_of(form, seed=1)
    logs, batches, trainer = run_trl("cpo", model_dir, adapter, data, tmp_path / "trl", loss_type="simpo",
                                     cpo_alpha=0.0, simpo_gamma=0.3, label_smoothing=0.1)
    recipe = our_recipe(model_dir, adapter, tmp_path, "dpo", beta=BETA, loss_type="simpo", simpo_gamma=0.3,
                        label_smoothing=0.1)
    ours, _ = run_ours(recipe, model_dir, pipeline_batches(recipe, data, trainer, "cpo"), None)
    assert_same_curves(ours, logs, REWARDS)


@pytest.mark.parametrize(("orpo_nll", "form", "prompt"), [(None, "text", True), ("completion", "text", False),
                                                          (None, "chat", True)])
def test_orpo_equals_trl_per_step(orpo_nll, form, prompt, make_tiny_hf, tmp_path):
    """TRL's ORPO NLL is the token mean of the chosen sequences' prompt and completion tokens over
    the batch's chosen rows: ours by default, with prompts. ``orpo_nll: completion`` (the
    completion tokens only) is the same quantity where the prompt is only TRL's bos. Conversations
    are tokenized as ``ORPOTrainer`` does: its eos after the template's end of turn."""
    _, model_dir = make_tiny_hf("llama")
    adapter = tmp_path / "start"
    start_adapter(model_dir, adapter)
    data = data_of(form, seed=2, prompt=prompt)
    logs, batches, trainer = run_trl("orpo", model_dir, adapter, data, tmp_path / "trl")
    recipe = our_recipe(model_dir, adapter, tmp_path, "orpo", beta=BETA,
                        **({"orpo_nll": orpo_nll} if orpo_nll else {}))
    assert recipe.preference is not None and recipe.preference.orpo_nll == (orpo_nll or "prompt_and_completion")
    ours, _ = run_ours(recipe, model_dir, pipeline_batches(recipe, data, trainer, "orpo"), None)
    assert_same_curves(ours, logs, (*REWARDS, "nll_loss", "log_odds_ratio", "log_odds_chosen"))


# ---------------------------------------------------------------------- pieces


def test_token_nll_is_the_same_from_every_scores_form():
    """Full logits, target-position logits and chunked hidden states give the same per-token NLL at
    the same micro-batch positions and per-row log-probs, equal to transformers-style per-token
    cross entropy (summed over each row)."""
    torch.manual_seed(0)
    b, t, h, v = 4, 9, 8, 13
    hidden = torch.randn(b, t, h)
    head = torch.nn.Linear(h, v, bias=False)
    labels = torch.randint(0, v, (b, t))
    labels[:, :3] = -100
    labels[1, 6:] = -100
    per_token = causal_lm_loss(head(hidden), labels, reduction="none")
    full = LogitScores(head(hidden), shift_labels(labels))
    flat_t = shift_labels(labels).reshape(-1)
    index = (flat_t != -100).nonzero().squeeze(1)
    gathered = LogitScores(head(hidden.reshape(-1, h)[index]), flat_t[index], index=index)
    chunked = ChunkedScores(hidden.reshape(-1, h)[index], head, flat_t[index], 3, index=index)
    for scores in (full, gathered, chunked):
        torch.testing.assert_close(sequence_logps(scores, labels), -per_token.sum(1))
        nll, position = scores.token_nll()
        torch.testing.assert_close(torch.zeros(b * t).index_add(0, position, nll).view(b, t), per_token)


def test_orpo_log1mexp_is_finite_near_zero_and_far_below():
    x = torch.tensor([-1e-12, -1e-6, -0.5, -0.7, -5.0, -80.0, -1e4], dtype=torch.float32, requires_grad=True)
    y = log1mexp(x)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    ref = torch.log1p(-torch.exp(x.detach().double()))
    mid = slice(1, 7)
    torch.testing.assert_close(y[mid].double(), ref[mid], rtol=1e-5, atol=1e-6)
    # the whole ORPO loss at log-probs that round to 0 and far below it: finite loss and gradients
    logits = torch.zeros(4, 3, 5)
    logits[..., 0] = torch.tensor([60.0, 1e-3, -30.0]).view(1, 3).expand(4, 3)
    logits.requires_grad_(True)
    labels = torch.zeros(4, 3, dtype=torch.long)
    labels[:, 0] = -100
    orpo = OddsRatioPreference()
    side = orpo.side({"input_ids": labels.clamp(min=0), "labels": labels})
    loss, _ = orpo.loss(LogitScores(logits, shift_labels(orpo.labels(side))), side)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()


def test_dpo_without_reference_logps_reads_zeros_and_label_smoothing_is_cdpo():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    labels[:, :2] = -100
    ref = torch.tensor([-3.0, -4.0])
    scores = LogitScores(logits, shift_labels(labels))
    logps = sequence_logps(scores, labels)
    delta = (logps[0] - ref[0]) - (logps[1] - ref[1])
    got, _ = DirectPreference(beta=0.2, label_smoothing=0.1).loss(scores, {"labels": labels, "ref_logps": ref})
    want = -0.9 * torch.nn.functional.logsigmoid(0.2 * delta) - 0.1 * torch.nn.functional.logsigmoid(-0.2 * delta)
    torch.testing.assert_close(got, want)
    # a DPO batch that missed the reference pass is refused, not trained against zeros
    batch = {"input_ids": labels.clamp(min=0), "labels": labels}
    with pytest.raises(NxdError, match="without ref_logps"):
        DirectPreference().side(batch)
    assert set(DirectPreference(loss_type="simpo").side(batch)) == {"labels"}  # SimPO has no reference


@pytest.mark.parametrize(("overrides", "message"), [
    ({"objective": "dpo"}, "objective=dpo needs data.format=preference (got messages)"),
    ({"data.format": "preference"}, "data.format=preference needs objective: dpo or orpo (objective=sft)"),
    ({"preference": {"beta": 0.2}}, "preference is set but objective=sft"),
    ({"objective": "orpo", "data.format": "preference", "preference": {"reference": "base"}},
     "preference.reference=base but objective=orpo uses no reference model"),
    ({"objective": "dpo", "data.format": "preference", "preference": {"reference": "init_from"}},
     "preference.reference=init_from needs lora.init_from"),
    ({"objective": "dpo", "data.format": "preference", "preference": {"loss_type": "hinge", "label_smoothing": 0.1}},
     "preference.label_smoothing=0.1 has no effect with loss_type=hinge"),
    ({"objective": "dpo", "data.format": "preference", "preference": {"precompute_ref_log_probs": False}},
     "preference.precompute_ref_log_probs=false is not supported"),
    ({"objective": "dpo", "data.format": "preference", "preference": {"orpo_nll": "completion"}},
     "preference.orpo_nll=completion is an ORPO setting; objective=dpo has no use for it"),
    ({"objective": "orpo", "data.format": "preference", "preference": {"orpo_nll": "prompt"}},
     "preference.orpo_nll"),
])
def test_recipe_rules_are_one_line(overrides, message, tmp_path):
    data: dict[str, Any] = {"model": {"path": "builtin:tiny-llama"}, "data": {"train": str(tmp_path / "x.jsonl")},
                            "lora": {}}
    for key, value in overrides.items():
        if key == "data.format":
            data["data"]["format"] = value
        else:
            data[key] = value
    with pytest.raises(RecipeError) as e:
        recipe_from_dict(data)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_orpo_nll_is_written_back_and_a_resumed_change_is_said(tmp_path):
    """``preference.orpo_nll`` survives the recipe written with a checkpoint (a DPO recipe's default
    too); resuming with another value applies it from the resumed step, in the one line."""
    def recipe(objective: str, **preference: Any):
        return recipe_from_dict({"model": {"path": "builtin:tiny-llama"}, "lora": {}, "objective": objective,
                                 "data": {"train": str(tmp_path / "x.jsonl"), "format": "preference"},
                                 "preference": preference})

    dpo = recipe("dpo")
    assert recipe_from_dict(yaml.safe_load(dpo.to_yaml())).preference == dpo.preference
    saved = recipe("orpo", orpo_nll="completion")
    assert recipe_from_dict(yaml.safe_load(saved.to_yaml())).preference.orpo_nll == "completion"
    changes = check_resume(saved.to_yaml(), recipe("orpo"), "ck", 3)
    assert [(c.key, c.old, c.new) for c in changes] == [
        ("preference.orpo_nll", "completion", "prompt_and_completion")]
    assert describe_changes(changes, 3) == ("recipe changed since the checkpoint; applied from step 4: "
                                            "preference.orpo_nll 'completion' -> 'prompt_and_completion'")


# ---------------------------------------------------------------------- the run, end to end


def test_run_equals_trl_and_records_the_reference(make_tiny_hf, tmp_path):
    """``nxd-finetune run``'s loop on a preference jsonl (our tokenization, loader, reference pass
    and metrics.jsonl) reproduces TRL's DPOTrainer curve on the same pairs in order; the adapter
    records its objective and reference; a second run reads the stored reference log-probs."""
    setup = dpo_setup(make_tiny_hf, tmp_path, STEPS * PAIRS_PER_STEP, seed=3)
    model_dir, adapter = setup["model_dir"], setup["adapter"]
    logs, _, _ = run_trl("dpo", model_dir, adapter, setup["data"], tmp_path / "trl", loss_type=["sigmoid"])

    def recipe(out: Path):
        training = {"micro_batch_size": PAIRS_PER_STEP, "max_steps": STEPS, "lr": LR}
        rec = dpo_recipe(setup, out, BETA, training)
        rec["data"]["eval"] = str(setup["train"])  # scored after training (eval_ metrics)
        return recipe_from_dict(rec)

    def run(out: Path) -> dict[str, Any]:
        summary = trainer.run(recipe(out))
        assert summary is not None
        return summary

    summary = run(tmp_path / "run1")
    assert summary["reference"] == "init_from"
    # every pair trained once: its two sequences' real tokens (one per word, then the eos), no padding
    real = sum(len((d["prompt"] + c).split()) + 1 for d in setup["data"] for c in (d["chosen"], d["rejected"]))
    assert summary["input_tokens"] == real
    records = [json.loads(line) for line in (tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()]
    ours = [{"loss": r["train_loss"], **r} for r in records if "train_loss" in r]
    assert_same_curves(ours, logs, REWARDS)
    with safe_open(str(tmp_path / "run1" / "final" / "adapter_model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["nxd_objective"] == "dpo" and meta["nxd_reference"] == f"init_from:{adapter}"
    stored = list((tmp_path / "cache").rglob("ref_logps.safetensors"))
    assert len(stored) == 1
    mtime = stored[0].stat().st_mtime_ns
    run(tmp_path / "run2")  # the stored reference log-probs are read back, not recomputed
    assert [p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("ref_logps.safetensors")] == [mtime]
    again = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_loss"] for r in again if "train_loss" in r] == [r["loss"] for r in ours]
    # nxd-finetune eval of the trained adapter: measured against the run's reference (the starting
    # adapter's stored log-probs), the same scores as the run's own eval after training
    after = summary["eval_after"]
    assert {"eval_loss", "eval_rewards/accuracies", "eval_rewards/margins", "eval_logps/chosen"} <= after.keys()
    scores = evaluate_recipe(recipe(tmp_path / "run1"), out=tmp_path / "eval.json")
    for k in after:
        assert scores[k] == pytest.approx(after[k], abs=1e-5), k


def test_resumed_dpo_run_continues_the_curve(make_tiny_hf, tmp_path):
    """A DPO run stopped at step 5 and resumed to 10 logs the uninterrupted run's curve: the resumed
    process's reference log-probs are the starting adapter's (stored with the data, or computed
    before the checkpoint's trained weights load), not the trained adapter's."""
    setup = dpo_setup(make_tiny_hf, tmp_path, STEPS * PAIRS_PER_STEP, seed=6)

    def run(out: Path, steps: int, resumed: bool = False) -> list[dict[str, Any]]:
        training = {"micro_batch_size": PAIRS_PER_STEP, "max_steps": steps, "lr": LR}
        rec = dpo_recipe(setup, out, BETA, training, checkpoint={"every_n_steps": 5})
        summary = trainer.run(recipe_from_dict(rec))
        assert summary is not None and (summary["resumed_from"] is not None) == resumed
        return [h for h in summary["history"] if "train_loss" in h]

    whole = run(tmp_path / "whole", STEPS)
    run(tmp_path / "split", 5)
    resumed = run(tmp_path / "split", STEPS, resumed=True)
    assert len(resumed) == len(whole) == STEPS
    for a, b in zip(resumed, whole, strict=True):
        for k in REWARDS[1:] + ("train_loss",):
            assert a[k] == pytest.approx(b[k], abs=1e-6), (a["step"], k)


def test_lightning_runs_the_dpo_objective_equal_to_run(make_tiny_hf, tmp_path, monkeypatch):
    """NxdLightningModule + NxdStrategy at one process: the run's DPO loss and reward curve (the
    reference pass in configure_model, the objective's metrics logged beside train_loss)."""
    pl = pytest.importorskip("lightning.pytorch")
    import yaml

    from nxd_finetune.lightning import NxdLightningModule, NxdStrategy

    setup = dpo_setup(make_tiny_hf, tmp_path, STEPS * PAIRS_PER_STEP, seed=7)
    training = {"micro_batch_size": PAIRS_PER_STEP, "max_steps": STEPS, "lr": LR}
    summary = trainer.run(recipe_from_dict(dpo_recipe(setup, tmp_path / "run", BETA, training)))
    assert summary is not None
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(dpo_recipe(setup, tmp_path / "lightning", BETA, training)))
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # Lightning's launcher sets them in this process
        monkeypatch.setenv(key, os.environ.get(key, "127.0.0.1" if key == "MASTER_ADDR" else "29533"))
    module = NxdLightningModule(path)
    pl.Trainer(devices=1, accelerator="cpu", strategy=NxdStrategy(), max_steps=STEPS, logger=False,
               enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
               limit_val_batches=0, num_sanity_val_steps=0).fit(module)
    want = [h for h in summary["history"] if "train_loss" in h]
    assert len(module.history) == STEPS
    for a, b in zip(module.history, want, strict=True):
        for k in REWARDS[1:] + ("train_loss",):
            assert a[k] == pytest.approx(b[k], abs=1e-6), (a["step"], k)

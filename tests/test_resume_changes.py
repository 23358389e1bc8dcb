"""A resumed run whose recipe changed: what it cannot change is refused in one line naming the key,
what it can (lr, the schedule, max_steps, logging...) is applied and said in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nxd_finetune.checkpoint.training import apply_training_changes
from nxd_finetune.errors import RecipeError
from nxd_finetune.recipe import load_recipe
from nxd_finetune.recipe.resume import check_resume, describe_changes
from nxd_finetune.sft.schedule import lr_factor

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
QUICKSTART_DPO = ROOT / "recipes" / "quickstart-dpo.yaml"


def _recipe(*overrides: str):
    return load_recipe(QUICKSTART, list(overrides))


@pytest.mark.parametrize(("override", "key"), [
    ("lora.rank=4", "lora.rank"),
    ("lora.target_modules=[q_proj]", "lora.target_modules"),
    ("model.dtype=bf16", "model.dtype"),
    ("data.max_seq_len=64", "data.max_seq_len"),
    ("data.chat_template_kwargs.enable_thinking=false", "data.chat_template_kwargs"),
    ("training.seed=7", "training.seed"),
    ("lora=null", "lora"),
])
def test_a_change_to_what_was_trained_is_refused_naming_the_key(override, key):
    saved = _recipe().to_yaml()
    with pytest.raises(RecipeError) as err:
        check_resume(saved, _recipe(override), "ck/step-00000004", 4)
    message = str(err.value)
    assert "\n" not in message and key in message and "ck/step-00000004" in message and "--no-resume" in message


@pytest.mark.parametrize(("override", "key"), [
    ("objective=orpo", "objective"),
    ("preference.max_prompt_length=8", "preference.max_prompt_length"),
    ("preference.truncation_mode=keep_end", "preference.truncation_mode"),
    ("preference.reference=base", "preference.reference"),
])
def test_a_change_to_the_objective_pairs_or_reference_is_refused(override, key):
    saved = load_recipe(QUICKSTART_DPO).to_yaml()
    with pytest.raises(RecipeError) as err:
        check_resume(saved, load_recipe(QUICKSTART_DPO, [override]), "ck/step-00000004", 4)
    message = str(err.value)
    assert "\n" not in message and key in message


def test_a_preference_loss_setting_is_applied_on_resume():
    saved = load_recipe(QUICKSTART_DPO).to_yaml()
    changes = check_resume(saved, load_recipe(QUICKSTART_DPO, ["preference.beta=0.2"]), "ck/step-00000004", 4)
    assert "preference.beta 0.05 -> 0.2" in (describe_changes(changes, 4) or "")


def test_the_global_batch_may_not_change_but_its_split_may():
    saved = _recipe("training.grad_accum=2", "training.micro_batch_size=2").to_yaml()
    with pytest.raises(RecipeError, match="global batch changed .*4 -> 8"):
        check_resume(saved, _recipe("training.grad_accum=4", "training.micro_batch_size=2"), "ck", 4)
    # the same 4 sequences per step on two data-parallel ranks: a layout change, which checkpoints reshard
    same = _recipe("training.grad_accum=1", "training.micro_batch_size=2", "parallel.nproc=2")
    changes = check_resume(saved, same, "ck", 4)
    assert {c.key for c in changes} == {"training.grad_accum", "parallel.nproc"}


def test_max_steps_below_the_checkpoint_is_refused():
    with pytest.raises(RecipeError, match="max_steps=3 is below the checkpoint's step 4"):
        check_resume(_recipe().to_yaml(), _recipe("training.max_steps=3", "training.warmup_steps=1"), "ck", 4)


def test_allowed_changes_are_listed_in_one_line_and_start_only_keys_are_said_to_be_ignored():
    saved = _recipe().to_yaml()
    changes = check_resume(saved, _recipe("training.lr=0.01", "logging.every_n_steps=5", "eval.before=false"), "ck", 4)
    line = describe_changes(changes, 4)
    assert line is not None and "\n" not in line
    assert "applied from step 5: " in line and "training.lr 0.002 -> 0.01" in line
    assert "logging.every_n_steps 10 -> 5" in line and "ignored (only a fresh start reads them): eval.before" in line
    assert describe_changes(check_resume(saved, _recipe(), "ck", 4), 4) is None


def _optimizer(lr: float, weight_decay: float, total: int):
    torch.manual_seed(0)
    decay, no_decay = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([{"params": [decay], "weight_decay": weight_decay},
                             {"params": [no_decay], "weight_decay": 0.0}], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total, 1, "cosine"))
    return opt, sched


def test_the_restored_optimizer_takes_the_new_lr_schedule_and_decay_at_the_resumed_step():
    old_opt, old_sched = _optimizer(2e-3, 0.0, total=6)
    for _ in range(4):
        old_opt.step()
        old_sched.step()
    opt, sched = _optimizer(2e-3, 0.0, total=10)  # built from the new recipe, then restored as run does
    opt.load_state_dict(old_opt.state_dict())
    sched.load_state_dict(old_sched.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * lr_factor(4, 6, 1, "cosine"))  # the old schedule
    new = _recipe("training.lr=0.01", "training.max_steps=10", "training.weight_decay=0.1",
                  "training.betas=[0.8, 0.9]").training
    changes = check_resume(_recipe().to_yaml(), _recipe("training.lr=0.01", "training.max_steps=10",
                                                          "training.weight_decay=0.1", "training.betas=[0.8, 0.9]"),
                           "ck", 4)
    apply_training_changes(opt, sched, new, changes)
    want = 0.01 * lr_factor(4, 10, 1, "cosine")
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(want)] * 2 and sched.get_last_lr()[0] == want
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.8, 0.9) for g in opt.param_groups)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * lr_factor(5, 10, 1, "cosine"))


RUN = ["data.max_seq_len=64", "training.micro_batch_size=4", "logging.every_n_steps=1", "training.warmup_steps=1",
       "logging.progress=false", "eval.before=false", "checkpoint.every_n_steps=2"]


def _run(env: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nxd_finetune", "run", str(QUICKSTART), *RUN, f"output.dir={out}",
                           *extra], env=env, capture_output=True, text=True, timeout=600)


def test_cli_resume_applies_a_new_lr_says_so_and_refuses_a_new_rank(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "NXD_FINETUNE_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}
    out = tmp_path / "out"
    first = _run(env, out, "training.max_steps=4")
    assert first.returncode == 0, first.stdout + first.stderr
    refused = _run(env, out, "training.max_steps=6", "lora.rank=4")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].startswith("error: cannot resume from ")
    assert "lora.rank changed since the checkpoint (16 -> 4)" in refused.stderr and "Traceback" not in refused.stderr
    second = _run(env, out, "training.max_steps=6", "training.lr=0.01")
    assert second.returncode == 0, second.stdout + second.stderr
    lines = [ln for ln in second.stdout.splitlines() if ln.startswith("recipe changed since the checkpoint")]
    assert len(lines) == 1 and "training.lr 0.002 -> 0.01" in lines[0] and "training.max_steps 4 -> 6" in lines[0]
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    logged = {r["step"]: r["lr"] for r in rows if "lr" in r}
    t = _recipe().training
    assert logged[4] == pytest.approx(2e-3 * lr_factor(4, 4, 1, t.scheduler, t.min_lr_ratio))  # the first run's
    for step in (5, 6):
        assert logged[step] == pytest.approx(0.01 * lr_factor(step, 6, 1, t.scheduler, t.min_lr_ratio))

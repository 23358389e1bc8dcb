"""The ``rl:`` recipe section (``rl/section.py``) against TRL 1.x's ``GRPOConfig`` names and
defaults, its one-line errors, the rewards it builds, and the ``prompt`` data format
(``data/prompts.py``) against TRL's own prompt tokenization."""

from __future__ import annotations

import dataclasses
import types

import pytest
from transformers import AutoTokenizer

from nxd_finetune.errors import DataError, RecipeError
from nxd_finetune.recipe import recipe_from_dict
from nxd_finetune.rl.objective import GroupRelative
from nxd_finetune.rl.rewards import TrainerState, build_rewards, score
from nxd_finetune.rl.section import RLSection, rl_section
from tests.rl_helpers import grpo_trainer

GRPOTrainer = grpo_trainer()
TRL_NAMED = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "beta", "epsilon",
             "epsilon_high", "loss_type", "scale_rewards", "num_iterations", "mask_truncated_completions",
             "reward_weights", "multi_objective_aggregation", "use_bias_correction_kl")


def test_defaults_are_trls():
    from trl import GRPOConfig

    trl = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours = rl_section({"reward_funcs": ["exact_match"]})
    for name in TRL_NAMED:
        assert getattr(ours, name) == trl[name], name
    assert set(RLSection.model_fields) - {"reward_funcs", "max_prompt_length", "reference"} == set(TRL_NAMED)
    assert ours.clip_high == ours.epsilon


def test_entries_and_trl_spellings():
    section = rl_section({"reward_funcs": ["exact_match", "tests.test_rl_rewards:half_scored",
                                           {"type": "regex", "pattern": "^<a>"}, {"type": "length", "cache": 4}],
                          "scale_rewards": False, "max_completion_length": 16, "epsilon_high": 0.28})
    assert section.scale_rewards == "none" and section.clip_high == 0.28
    assert rl_section({"reward_funcs": ["a:b"], "scale_rewards": True}).scale_rewards == "group"
    rewards = build_rewards(section)
    assert [r.name for r in rewards] == ["exact_match", "half_scored", "regex", "length"]
    assert [r.weight for r in rewards] == [1.0] * 4
    scores = score(rewards, ["p", "p"], ["<a>4", "5"], [[1] * 13, [1] * 2],
                   {"answer": ["4", "5"], "step_bonus": [0.0, 0.0]}, TrainerState(2, 9))
    assert scores[:, 0].tolist() == [0.0, 1.0]  # "<a>4" != "4"
    assert scores[:, 2].tolist() == [1.0, 0.0]
    assert scores[:, 3].tolist() == [-0.25, 0.0]  # 13 tokens: (16 - 4 - 13) / 4


@pytest.mark.parametrize(("data", "message"), [
    ({}, "missing required key 'rl.reward_funcs'"),
    ({"reward_funcs": []}, "rl.reward_funcs must not be empty"),
    ({"reward_funcs": ["nope"]}, "rl.reward_funcs[0]='nope' is not 'module:function' nor a built-in"),
    ({"reward_funcs": ["regex"]}, "(a regex is {type: regex, pattern: ...})"),
    ({"reward_funcs": [{"type": "regex"}]}, "rl.reward_funcs[0] (regex): missing required key 'pattern'"),
    ({"reward_funcs": ["a:b", {"type": "regex", "pattern": "("}]}, "rl.reward_funcs[1] (regex): pattern '(' does "
                                                                    "not compile"),
    ({"reward_funcs": [{"type": "foo"}]}, "rl.reward_funcs[0]: type 'foo' is not a built-in reward"),
    ({"reward_funcs": [{"type": "exact_match", "colum": "a"}]}, "unknown key 'colum' (did you mean 'column'?)"),
    ({"reward_funcs": ["a:b"], "reward_weights": [1, 2]}, "rl.reward_weights has 2 weights for 1 reward_funcs"),
    ({"reward_funcs": ["a:b"], "num_generations": 1}, "rl.num_generations must be >= 2, got 1"),
    ({"reward_funcs": ["a:b"], "temperature": 0}, "rl.temperature must be > 0"),
    ({"reward_funcs": ["a:b"], "top_p": 1.5}, "rl.top_p must be <= 1"),
    ({"reward_funcs": ["a:b"], "top_k": -1}, "rl.top_k must be >= 0"),
    ({"reward_funcs": ["a:b"], "beta": float("nan")}, "rl.beta must be a finite number"),
    ({"reward_funcs": ["a:b"], "loss_type": "cispo"}, "rl.loss_type='cispo' is not supported; use one of grpo, "
                                                      "dr_grpo, dapo, bnpo"),
    ({"reward_funcs": ["a:b"], "scale_rewards": "std"}, "rl.scale_rewards: expected one of group, batch, none"),
    ({"reward_funcs": ["a:b"], "num_generation": 4}, "unknown key 'rl.num_generation' (did you mean "
                                                     "'rl.num_generations'?)"),
    ({"reward_funcs": ["a:b"], "num_iterations": 0}, "rl.num_iterations must be >= 1"),
    ({"reward_funcs": ["length"], "max_completion_length": 32}, "rl.reward_funcs[0]: length cache=64 must be below"),
    ("x", "rl: expected a mapping"),
])
def test_bad_values_are_one_line(data, message):
    with pytest.raises(RecipeError) as err:
        rl_section(data)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def tokenizer(quickstart_cache):
    from nxd_finetune.quickstart import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


@pytest.mark.parametrize("conversational", [False, True])
def test_prompt_ids_equal_trls(tokenizer, conversational):
    from nxd_finetune.data.prompts import columns_of, prompt_rows

    texts = ["What is 2+2?", "Name an even number.", "Say hi"]
    prompts = [[{"role": "user", "content": t}] for t in texts] if conversational else texts
    rows = [{"prompt": p, "answer": str(i), "level": i} for i, p in enumerate(prompts)]
    ours = prompt_rows(rows, tokenizer)
    trainer = types.SimpleNamespace(processing_class=tokenizer, chat_template=None, chat_template_kwargs={},
                                    tools=None, _is_vlm=False, environment_factories=None)
    theirs, _, _ = GRPOTrainer._tokenize_prompts(trainer, prompts)
    assert [r.ids for r in ours] == [list(t) for t in theirs]
    assert columns_of(ours, repeat=2) == {"answer": ["0", "0", "1", "1", "2", "2"], "level": [0, 0, 1, 1, 2, 2]}
    cut = prompt_rows(rows, tokenizer, max_prompt_length=3)
    assert [r.ids for r in cut] == [list(t)[-3:] for t in theirs]


@pytest.mark.parametrize(("rows", "message"), [
    ([{"question": "x"}], "prompt data row 0 has no column 'prompt' (columns: question;"),
    ([{"prompt": "ok"}, {"prompt": ""}], "prompt data row 1: the prompt is empty"),
    ([{"prompt": 3}], "prompt data row 0: a prompt is a string or a non-empty list of messages, got int"),
    ([{"prompt": [{"role": "user"}]}], "prompt data row 0: each message needs keys 'role' and 'content'"),
])
def test_bad_prompt_rows_are_one_line(tokenizer, rows, message):
    from nxd_finetune.data.prompts import prompt_rows

    with pytest.raises(DataError) as err:
        prompt_rows(rows, tokenizer)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_prompt_jsonl_read_as_datasets_reads_it_without_importing_it(tmp_path):
    """Local ``.jsonl`` prompt data: the rows ``datasets`` gives (a column a row lacks is None),
    read without importing ``datasets`` (pandas, pyarrow, scipy: ~110 MB a GRPO run never needs);
    a bad line is one line naming it (issue 44 item 9)."""
    import json
    import subprocess
    import sys

    from nxd_finetune.data.datasets import load_rows

    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "level": 3},
            {"prompt": [{"role": "user", "content": "Say hi"}], "answer": None, "level": 1}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    code = ("import sys; from nxd_finetune.data.prompts import load_prompt_data\n"
            f"print(repr(list(load_prompt_data('p.jsonl', {str(tmp_path)!r}))))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('datasets', 'pandas', 'pyarrow')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ours, imported = out.stdout.splitlines()
    assert imported == "[]", imported[:300]
    assert eval(ours) == list(load_rows("p.jsonl", tmp_path))
    from nxd_finetune.data.prompts import load_prompt_data

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(DataError) as err:
        load_prompt_data(str(tmp_path / "bad.jsonl"))
    assert str(err.value).startswith(f"cannot load dataset {str(tmp_path / 'bad.jsonl')!r}: line 2: ")
    assert "\n" not in str(err.value)


GRPO_RECIPE = {"model": {"path": "m"}, "data": {"train": "p.jsonl", "format": "prompt"}, "objective": "grpo",
               "lora": {},
               "rl": {"reward_funcs": ["exact_match"], "loss_type": "dr_grpo", "beta": 0.04, "epsilon_high": 0.3}}


def test_objective_grpo_takes_the_rl_section():
    from nxd_finetune.objectives import objective_of

    recipe = recipe_from_dict(GRPO_RECIPE)
    objective = objective_of(recipe)
    assert isinstance(objective, GroupRelative)
    assert (objective.loss_type, objective.beta, objective.epsilon, objective.epsilon_high) == ("dr_grpo", 0.04, 0.2,
                                                                                                0.3)
    assert recipe_from_dict(recipe.to_dict()) == recipe  # written back out, read the same


@pytest.mark.parametrize(("change", "message"), [
    ({"rl": None}, "objective=grpo needs an rl section (at least rl.reward_funcs)"),
    ({"objective": "sft", "data": {"train": "p.jsonl"}}, "rl is set but objective=sft (set objective: grpo)"),
    ({"data": {"train": "p.jsonl"}}, "objective=grpo needs data.format=prompt (got messages)"),
    ({"objective": "sft", "rl": None}, "data.format=prompt needs objective: grpo (objective=sft)"),
    ({"lora": None}, "rl.beta=0.04 needs a lora section"),
    ({"rl": {"reward_funcs": ["exact_match"], "loss_type": "cispo"}}, "rl.loss_type='cispo' is not supported"),
    ({"rl": {"reward_funcs": ["exact_match"], "beta": 0.1, "reference": "init_from"}},
     "rl.reference=init_from needs lora.init_from (the adapter the run starts from)"),
    ({"rl": {"reward_funcs": ["exact_match"], "reference": "start"}}, "rl.reference"),
])
def test_grpo_recipe_errors_are_one_line(change, message):
    with pytest.raises(RecipeError) as e:
        recipe_from_dict({**GRPO_RECIPE, **change})
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)

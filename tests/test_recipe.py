"""Recipe loading: one-line errors with paths, suggestions and numbers; overrides; paths; round trip."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from nxd_finetune.errors import RecipeError
from nxd_finetune.recipe import Recipe, check_against_model, load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parents[1]
BASE = {"model": {"path": "/models/m"}, "data": {"train": "/data/train.jsonl"}}


def with_(**sections) -> dict:
    """BASE with ``section={key: value}`` merged in (a value of None replaces the section)."""
    data = copy.deepcopy(BASE)
    for name, values in sections.items():
        if values is None or not isinstance(values, dict):
            data[name] = values
        else:
            data.setdefault(name, {}).update(values)
    return data


def write(tmp_path: Path, data: dict | str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


BAD = [
    # unknown keys: full dotted path and the nearest valid key
    (with_(lora={"rnak": 8}), ["unknown key 'lora.rnak'", "did you mean 'lora.rank'"]),
    ({**BASE, "trainig": {"lr": 1.0}}, ["unknown key 'trainig'", "did you mean 'training'"]),
    (with_(parallel={"tensor_parallel_size": 2}), ["unknown key 'parallel.tensor_parallel_size'",
                                                   "did you mean 'parallel.tp'"]),
    (with_(training={"learning_rate": 1.0}), ["did you mean 'training.lr'"]),
    (with_(output={"xyz": 1}), ["unknown key 'output.xyz'; valid keys: output.dir, output.registry"]),
    # types: dotted path and what is expected
    (with_(training={"lr": "fast"}), ["training.lr: expected a number, got 'fast'"]),
    (with_(lora={"rank": 2.5}), ["lora.rank: expected an integer, got 2.5"]),
    (with_(data={"train": 5}), ["data.train: expected a string or a list of strings, got 5"]),
    (with_(data={"format": "chatml"}), ["data.format: expected one of messages, alpaca, prompt_completion, text"]),
    (with_(logging={"tensorboard": "maybe"}), ["logging.tensorboard: expected true or false"]),
    (with_(lora=5), ["lora: expected a mapping (section) or null, got 5"]),
    ({"data": {"train": "x"}}, ["missing required key 'model'"]),
    (with_(model={"path": None}), ["model.path: expected a string, got None"]),
    # ranges
    (with_(training={"lr": -1}), ["training.lr must be > 0"]),
    (with_(lora={"dropout": 1.0}), ["lora.dropout must be < 1.0"]),
    (with_(lora={"rank": 0}), ["lora.rank must be >= 1, got 0"]),
    (with_(training={"betas": [0.9, 1.5]}), ["training.betas[1] must be < 1.0, got 1.5"]),
    # cross-field rules, with the numbers
    (with_(parallel={"nproc": 12, "tp": 8}), ["parallel.nproc=12 is not divisible by tp*pp=8*1=8"]),
    (with_(parallel={"nproc": 4, "tp": 2, "pp": 2, "virtual_stages": 2}),
     ["parallel.virtual_stages=2 needs parallel.pp_schedule=interleaved_1f1b (got 1f1b)"]),
    (with_(parallel={"virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}),
     ["parallel.virtual_stages=2 needs parallel.pp > 1 (pp=1)"]),
    (with_(parallel={"sequence_parallel": True}), ["parallel.sequence_parallel needs parallel.tp > 1 (tp=1)"]),
    (with_(parallel={"nproc": 4, "pp": 4, "pp_cuts": [8, 16]}),
     ["parallel.pp_cuts has 2 entries; pp*virtual_stages=4*1=4 stages need 3"]),
    (with_(parallel={"nproc": 3, "pp": 3, "pp_cuts": [16, 8]}),
     ["parallel.pp_cuts=[16, 8] must be strictly increasing"]),
    (with_(training={"max_steps": 100, "epochs": 2}), ["training.max_steps=100 and training.epochs=2.0 are both set"]),
    (with_(parallel={"nproc": 8, "tp": 2}, training={"micro_batch_size": 2, "global_batch_size": 20}),
     ["training.global_batch_size=20 is not divisible by micro_batch_size*dp=2*4=8"]),
    (with_(parallel={"nproc": 2}, training={"micro_batch_size": 2, "global_batch_size": 16, "grad_accum": 2}),
     ["training.global_batch_size=16 disagrees with micro_batch_size*grad_accum*dp=2*2*2=8"]),
    (with_(parallel={"nproc": 4, "tp": 4, "sequence_parallel": True}, data={"max_seq_len": 1030}),
     ["data.max_seq_len=1030 is not divisible by parallel.tp=4"]),
    (with_(eval={"every_n_steps": 50}), ["eval.every_n_steps=50 but there is no eval data"]),
    (with_(data={"eval": "/e.jsonl", "eval_fraction": 0.1}), ["data.eval is set and data.eval_fraction=0.1"]),
    (with_(data={"format": "prompt_completion", "fields": {"promt": "q"}}),
     ["data.fields.promt is not a field of format prompt_completion (did you mean 'prompt'?)"]),
    (with_(lora={"target_modules": []}), ["lora.target_modules is empty"]),
    (with_(parallel={"checkpoint_modules": ["self_attn"]}),
     ["parallel.checkpoint_modules is set but parallel.activation_checkpointing=none"]),
]


@pytest.mark.parametrize(("data", "expected"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_recipe_one_line_message(tmp_path, data, expected):
    path = write(tmp_path, data)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for part in expected:
        assert part in message, message


def test_several_problems_are_counted_on_one_line():
    with pytest.raises(RecipeError, match=r"^recipe: lora.rank: .*\(and 1 more: training.lr\)$"):
        recipe_from_dict(with_(training={"lr": "x"}, lora={"rank": "y"}))


@pytest.mark.parametrize(("text", "expected"), [
    ("model:\n  path: [a\n", ":3:1: invalid YAML"),
    ("model:\n  path: /m\n   dtype: bf16\n", ":3:9: invalid YAML: mapping values are not allowed here"),
    ("model:\n  path: /m\nmodel:\n  path: /n\n", ":3:1: invalid YAML: duplicate key 'model'"),
    ("- a\n- b\n", "the top level must be a mapping of sections, got list"),
])
def test_yaml_problems_give_file_and_line(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value).startswith(str(path))
    assert expected in str(info.value)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found: .*nope.yaml"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize(("override", "expected"), [
    ("lora.rank16", "override 'lora.rank16' has no '='"),
    ("lora..rank=3", "'lora..rank' is not a dotted key"),
    ("training.lr=[1,", "the value is not valid YAML"),
    ("model.path.sub=3", "override 'model.path.sub=3': model.path is '/models/m', not a section"),
    ("lora.rnak=16", "override 'lora.rnak=16': unknown key 'lora.rnak' (did you mean 'lora.rank'?)"),
    ("training.lr=abc", "override 'training.lr=abc': training.lr: expected a number, got 'abc'"),
])
def test_bad_overrides(tmp_path, override, expected):
    path = write(tmp_path, BASE)
    with pytest.raises(RecipeError) as info:
        load_recipe(path, [override])
    assert expected in str(info.value)


def test_overrides_types_lists_nested_and_null(tmp_path):
    path = write(tmp_path, with_(lora={"rank": 8}))
    r = load_recipe(path, [
        "lora.rank=16", "lora.target_modules=[q_proj, v_proj]", "training.lr=1e-4", "training.max_steps=50",
        "parallel.zero1=true", "data.fields.messages=conversation", "training.betas=[0.9, 0.95]",
        "output.registry=s3://bucket/adapters", "checkpoint.every_n_steps=", "model.dtype=bf16",
    ])
    assert r.lora.rank == 16 and r.lora.target_modules == ["q_proj", "v_proj"]
    assert r.training.lr == 1e-4 and r.training.max_steps == 50 and r.training.epochs is None
    assert r.parallel.zero1 is True and r.data.fields == {"messages": "conversation"}
    assert r.training.betas == (0.9, 0.95) and r.output.registry == "s3://bucket/adapters"
    assert r.checkpoint.every_n_steps is None and r.model.dtype == "bf16"
    assert load_recipe(path, ["lora=null"]).lora is None


def test_override_creates_missing_sections(tmp_path):
    path = write(tmp_path, with_(lora=None))
    assert load_recipe(path).lora is None
    r = load_recipe(path, ["lora.rank=4", "eval.max_batches=3"])
    assert r.lora.rank == 4 and r.lora.alpha == 16.0 and r.eval.max_batches == 3
    r = load_recipe(path, ["lora={rank: 2, target_modules: all-linear}"])
    assert r.lora.rank == 2 and r.lora.target_modules == "all-linear"


def test_relative_paths_resolve_against_the_recipe_dir(tmp_path, monkeypatch):
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    path = write(recipe_dir, {
        "model": {"path": "../models/tiny", "tokenizer": "~/tok"},
        "data": {"train": ["data/a.jsonl", "/abs/b.jsonl"], "eval": "data/e.jsonl", "cache_dir": "cache",
                 "chat_template": "templates/chat.jinja"},
        "lora": {"init_from": "registry://bot:3"},
        "checkpoint": {"dir": "ckpt", "resume": "latest"},
        "output": {"dir": "out", "registry": "s3://team/adapters"},
    })
    monkeypatch.chdir(tmp_path)  # the working directory plays no part for paths in the file
    r = load_recipe(path)
    assert r.model.path == str(tmp_path / "models" / "tiny")
    assert r.model.tokenizer == os.path.expanduser("~/tok")
    assert r.data.train == [str(recipe_dir / "data" / "a.jsonl"), "/abs/b.jsonl"]
    assert r.data.eval == str(recipe_dir / "data" / "e.jsonl")
    assert r.data.cache_dir == str(recipe_dir / "cache")
    assert r.data.chat_template == str(recipe_dir / "templates" / "chat.jinja")
    # outputs stay relative to the working directory, where the user runs the job
    assert r.checkpoint.dir == "ckpt" and r.checkpoint.resume == "latest"
    assert r.output.dir == "out"
    assert r.lora.init_from == "registry://bot:3" and r.output.registry == "s3://team/adapters"


def test_schemes_builtin_and_inline_templates_are_untouched(tmp_path):
    path = write(tmp_path, {"model": {"path": "builtin:tiny-llama", "tokenizer": "hf://org/tok"},
                            "data": {"train": "hf://tatsu-lab/alpaca", "chat_template": "{{ messages }}"}})
    r = load_recipe(path)
    assert r.model.path == "builtin:tiny-llama" and r.model.tokenizer == "hf://org/tok"
    assert r.data.train == "hf://tatsu-lab/alpaca" and r.data.chat_template == "{{ messages }}"
    assert r.output.dir == "outputs/run"  # a default stays relative to the working directory


def test_override_paths_resolve_against_the_working_dir(tmp_path, monkeypatch):
    (tmp_path / "recipes").mkdir()
    path = write(tmp_path / "recipes", BASE)
    monkeypatch.chdir(tmp_path)
    r = load_recipe(path, ["data.train=mine.jsonl", "model={path: m2}", "checkpoint.resume=ckpt/step-10"])
    assert r.data.train == str(tmp_path / "mine.jsonl")
    assert r.model.path == str(tmp_path / "m2")
    assert r.checkpoint.resume == "ckpt/step-10"  # an output path: left relative to the working dir


def test_defaults_and_derived_values():
    r = recipe_from_dict(BASE)
    assert r.lora is None and r.training.epochs == 1.0 and r.training.max_steps is None
    assert r.parallel.dp == 1 and r.grad_accum_steps == 1 and r.data.format == "messages"
    r = recipe_from_dict(with_(parallel={"nproc": 16, "tp": 2, "pp": 2},
                               training={"micro_batch_size": 2, "global_batch_size": 64}))
    assert r.parallel.dp == 4 and r.grad_accum_steps == 8 and r.training.global_batch(4) == 64
    r = recipe_from_dict(with_(parallel={"nproc": 4}, training={"grad_accum": 3}))
    assert r.grad_accum_steps == 3 and r.training.global_batch(4) == 12


@pytest.mark.parametrize("name", ["llama3-8b-lora", "mistral-7b-sft", "qwen2-7b-lora"])
def test_shipped_recipes_round_trip(tmp_path, name):
    r = load_recipe(REPO / "recipes" / f"{name}.yaml")
    again = load_recipe(write(tmp_path, r.to_yaml()))
    assert again == r
    assert Recipe.model_validate(yaml.safe_load(r.to_yaml())) == r
    assert r.to_dict()["training"]["betas"] == list(r.training.betas)


def _cfg(heads=32, kv=8, layers=32, vocab=128256, inter=14336):
    return SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=layers,
                           vocab_size=vocab, intermediate_size=inter)


@pytest.mark.parametrize(("parallel", "cfg", "expected"), [
    ({"nproc": 3, "tp": 3}, _cfg(), "parallel.tp=3 does not divide the model's num_attention_heads=32"),
    ({"nproc": 16, "tp": 16}, _cfg(heads=48, kv=12), "parallel.tp=16 must divide the model's num_key_value_heads=12"),
    ({"nproc": 2, "tp": 2}, _cfg(vocab=32001), "parallel.tp=2 does not divide the model's vocab_size=32001"),
    ({"nproc": 8, "tp": 8}, _cfg(inter=11012), "parallel.tp=8 does not divide the model's intermediate_size=11012"),
    ({"nproc": 3, "pp": 3}, _cfg(), "num_hidden_layers=32 is not divisible by pp*virtual_stages=3*1=3"),
    ({"nproc": 2, "pp": 2, "virtual_stages": 3, "pp_schedule": "interleaved_1f1b"}, _cfg(),
     "num_hidden_layers=32 is not divisible by pp*virtual_stages=2*3=6"),
    ({"nproc": 2, "pp": 2, "pp_cuts": [32]}, _cfg(), "parallel.pp_cuts=[32] must lie below the model's "
                                                     "num_hidden_layers=32"),
])
def test_check_against_model_errors(parallel, cfg, expected):
    r = recipe_from_dict(with_(parallel=parallel))
    with pytest.raises(RecipeError) as info:
        check_against_model(r, cfg)
    assert expected in str(info.value)


@pytest.mark.parametrize("parallel", [
    {"nproc": 8, "tp": 8},  # 8 kv heads, one per rank
    {"nproc": 16, "tp": 16},  # kv heads replicated twice
    {"nproc": 6, "pp": 3, "pp_cuts": [10, 20]},  # uneven stages placed by hand
    {"nproc": 8, "pp": 4, "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"},
])
def test_check_against_model_accepts(parallel):
    check_against_model(recipe_from_dict(with_(parallel=parallel)), _cfg(inter=14336, vocab=128256))


def test_check_against_model_with_decoder_config():
    from nxd_finetune.models import DecoderConfig

    cfg = DecoderConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 224,
                                 "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
                                 "intermediate_size": 512, "vocab_size": 1024})
    check_against_model(recipe_from_dict(with_(parallel={"nproc": 4, "tp": 4})), cfg)
    with pytest.raises(RecipeError, match="parallel.tp=8 does not divide the model's num_attention_heads=28"):
        check_against_model(recipe_from_dict(with_(parallel={"nproc": 8, "tp": 8})), cfg)


def test_warmup_longer_than_the_run_is_clamped_with_one_line(tmp_path, capsys):
    """A short trial run needs no second override: warmup is clamped to the run, and the CLI says
    so in one ``warning:`` line (no Python source line)."""
    import warnings

    from nxd_finetune.cli import main
    from nxd_finetune.errors import NxdWarning

    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(with_(training={"max_steps": 10, "warmup_steps": 20})))
    with pytest.warns(NxdWarning, match="warmup_steps=20 exceeds training.max_steps=10: warmup clamped to 10"):
        assert load_recipe(path).training.warmup_steps == 10
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with pytest.raises(SystemExit):
            main(["validate", str(path), "model.path=/nonexistent"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "warmup" in ln]
    assert lines == ["warning: training.warmup_steps=20 exceeds training.max_steps=10: warmup clamped to 10 step(s)"]
    assert "sections.py" not in err and "warnings.warn" not in err

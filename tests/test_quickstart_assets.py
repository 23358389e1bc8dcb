"""Quickstart assets: the generated data files, the tiny local model, the accuracy metric."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from nxd_finetune import quickstart
from nxd_finetune.assets import SHIPPED
from nxd_finetune.errors import ModelLoadError, RecipeError
from nxd_finetune.recipe import load_recipe

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "nxd_finetune" / "assets" / "quickstart"


def _rows(name):
    return [json.loads(line) for line in (ASSETS / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return quickstart.ensure_tiny_model(tmp_path_factory.mktemp("nxd-cache"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval(), AutoTokenizer.from_pretrained(tiny_dir)


def test_make_data_reproduces_shipped_files():
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "recipes" / "quickstart" / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    for name, text in make_data.render_all().items():
        assert (ASSETS / name).read_text(encoding="utf-8") == text, f"{name} is stale: run make_data.py"


def test_dataset_shape_and_disjoint_splits():
    train, eval_ = _rows("train.jsonl"), _rows("eval.jsonl")
    assert 400 <= len(train) <= 600 and 60 <= len(eval_) <= 100
    for row in train + eval_:
        roles = [m["role"] for m in row["messages"]]
        assert roles[-1] == "assistant" and row["messages"][-1]["content"] in ("even", "odd")
    number = lambda row: "".join(c for c in row["messages"][-2]["content"] if c.isdigit())  # noqa: E731
    assert not {number(r) for r in train} & {number(r) for r in eval_}
    answers = [r["messages"][-1]["content"] for r in train]
    assert 0.4 < answers.count("odd") / len(answers) < 0.6
    assert 100_000 <= len((ASSETS / "corpus.txt").read_bytes()) <= 300_000


def test_tiny_model_loads_offline_and_chat_template_renders(tiny, tiny_dir):
    model, tok = tiny
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == len(tok) == quickstart.VOCAB_SIZE
    assert (tiny_dir / "model.safetensors").is_file()
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    text = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Is 7 even or odd?"},
            {"role": "assistant", "content": "odd"},
        ],
        tokenize=False,
    )
    assert text == "<|bos|><|system|>\nBe brief.\n<|user|>\nIs 7 even or odd?\n<|assistant|>\nodd<|eos|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>\n")
    for word in ("even", "odd"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1
    assert tok.convert_ids_to_tokens(tok("4725")["input_ids"]) == ["<|bos|>", "4", "7", "2", "5"]
    with torch.no_grad():
        logits = model(torch.tensor([tok("The cat")["input_ids"]])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_tiny_model_is_cached_and_resolved(tiny_dir, monkeypatch):
    stamp = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert quickstart.ensure_tiny_model(tiny_dir.parents[1]) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tiny_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    monkeypatch.setenv("NXD_FINETUNE_CACHE", str(tiny_dir.parents[1]))
    assert quickstart.resolve_model_path("builtin:tiny-llama") == tiny_dir
    assert quickstart.resolve_model_path("/models/llama") == "/models/llama"
    with pytest.raises(ModelLoadError, match="unknown built-in model"):
        quickstart.resolve_model_path("builtin:huge-llama")


def _oracle(rows, tok, wrong_every=0):
    """A model_fn whose logits put all mass on the true next token (optionally wrong on some rows)."""
    from nxd_finetune.quickstart import _answer_positions

    targets = {}
    for n, row in enumerate(rows):
        ids, _ = _answer_positions(tok, row["messages"], None)
        targets[tuple(ids)] = wrong_every and n % wrong_every == 0

    def model_fn(input_ids):
        logits = torch.zeros(*input_ids.shape, len(tok))
        for b, row in enumerate(input_ids.tolist()):
            key = next(k for k in targets if tuple(row[: len(k)]) == k)
            nxt = list(key[1:]) + [0] * (len(row) - len(key) + 1)
            logits[b, torch.arange(len(row)), torch.tensor(nxt)] = 1.0
            if targets[key]:
                logits[b, len(key) - 2, :] = 0.0
                logits[b, len(key) - 2, 0] = 1.0  # predict <|pad|> instead of the answer
        return logits

    return model_fn


def test_answer_accuracy(tiny):
    model, tok = tiny
    rows = _rows("eval.jsonl")[:20]
    assert quickstart.answer_accuracy(_oracle(rows, tok), tok, rows, batch_size=7) == 1.0
    assert quickstart.answer_accuracy(_oracle(rows, tok, wrong_every=4), tok, rows) == 0.75
    acc = quickstart.answer_accuracy(lambda ids: model(ids).logits, tok, rows)
    assert 0.0 <= acc <= 0.2  # random weights: essentially never right
    with pytest.raises(ValueError, match="end with an assistant message"):
        quickstart.answer_accuracy(
            lambda ids: model(ids).logits, tok, [{"messages": [{"role": "user", "content": "x"}]}]
        )


def test_quickstart_recipe_and_data_fit(tiny, tmp_path):
    from nxd_finetune.data.loader import build_dataloaders

    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    assert recipe.model.path == "builtin:tiny-llama" and recipe.data.format == "messages"
    _, tok = tiny
    spec = recipe.data.model_dump() | {"cache_dir": str(tmp_path)}
    loaders = build_dataloaders(spec, tok, micro_batch_size=recipe.training.micro_batch_size)
    train, eval_ = loaders.stats["train"], loaders.stats["eval"]
    assert train["samples"] == len(_rows("train.jsonl")) and eval_["samples"] == len(_rows("eval.jsonl"))
    assert train["truncated"] == train["dropped"] == 0 and train["fill"] > 0.9
    batch = next(iter(loaders.train))
    assert batch["input_ids"].shape == (recipe.training.micro_batch_size, recipe.data.max_seq_len)


def test_builtin_quickstart_recipe_is_the_checkout_one():
    shipped = load_recipe("builtin:quickstart")
    assert shipped.model_dump() == load_recipe(ROOT / "recipes" / "quickstart.yaml").model_dump()
    assert Path(shipped.data.train).parent == ASSETS and Path(shipped.data.train).is_file()
    assert all(p.is_file() and ROOT / "nxd_finetune" in p.parents for p in SHIPPED)
    with pytest.raises(RecipeError, match="unknown built-in recipe 'builtin:nope'; known: builtin:quickstart"):
        load_recipe("builtin:nope")


def test_wheel_ships_the_assets(tmp_path):
    """A wheel built from the project carries every shipped asset (pyproject's package-data), so an
    installed package runs ``builtin:quickstart`` (the whole installed run: .ci/installed_quickstart.sh)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "nxd_finetune", src / "nxd_finetune", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True)
    (wheel,) = (tmp_path / "dist").glob("nxd_finetune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in SHIPPED:
        assert path.relative_to(ROOT).as_posix() in names


def _preference_generator():
    spec = importlib.util.spec_from_file_location("make_preference_data",
                                                  ROOT / "recipes" / "quickstart" / "make_preference_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_preference_data_reproduces_shipped_files():
    for name, text in _preference_generator().render_all().items():
        assert (ASSETS / name).read_text(encoding="utf-8") == text, f"{name} is stale: run make_preference_data.py"


def test_preference_pairs_teach_a_style_the_sft_data_lacks(tiny, tmp_path):
    """Chosen: the polite answer with the right parity (never in the SFT data); rejected: the SFT
    data's bare word or the polite answer with the wrong parity; eval numbers unseen in train; every pair fits
    the DPO recipe's max_seq_len untruncated."""
    import yaml

    from nxd_finetune.data.loader import build_dataloaders

    train, eval_ = _rows("preference_train.jsonl"), _rows("preference_eval.jsonl")
    assert 300 <= len(train) <= 500 and 50 <= len(eval_) <= 100
    number = lambda row: int("".join(c for c in row["prompt"][-1]["content"] if c.isdigit()))  # noqa: E731
    assert not {number(r) for r in train} & {number(r) for r in eval_}
    sft_answers = {m["content"] for r in _rows("train.jsonl") for m in r["messages"] if m["role"] == "assistant"}
    wrong = 0
    for row in train + eval_:
        parity = "even" if number(row) % 2 == 0 else "odd"
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen == f"{parity}, my friend." and chosen not in sft_answers
        assert rejected in (parity, f"{'odd' if parity == 'even' else 'even'}, my friend.")
        wrong += rejected != parity
    assert 0.15 < wrong / len(train + eval_) < 0.35
    recipe = yaml.safe_load((ROOT / "recipes" / "quickstart-dpo.yaml").read_text())
    data = recipe["data"] | {"cache_dir": str(tmp_path)}
    data = data | {k: str((ROOT / "recipes" / data[k]).resolve()) for k in ("train", "eval")}
    assert Path(data["train"]) == ASSETS / "preference_train.jsonl"
    loaders = build_dataloaders(data, tiny[1], micro_batch_size=recipe["training"]["micro_batch_size"])
    stats = loaders.stats["train"]
    assert stats["pairs"] == len(train) and stats["truncated"] == stats["dropped"] == 0
    assert loaders.stats["eval"]["pairs"] == len(eval_)
    assert recipe["lora"]["init_from"] == "../outputs/quickstart/final"

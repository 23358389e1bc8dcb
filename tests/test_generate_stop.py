"""Where ``generate``, ``chat`` and ``eval --generate`` stop: at the tokenizer's eos, at every id the
model's ``generation_config.json`` names as ``eos_token_id`` and at the chat template's end-of-turn
token (Gemma 3: eos ``<eos>``, generation config ``[<eos>, <end_of_turn>]``, turns closed by
``<end_of_turn>``).

The model under test is a tiny Gemma 3 whose greedy continuation of any prompt is ``A``,
``<end_of_turn>``, then ``Z <end_of_turn>`` for ever: a model that stops only at ``<eos>`` runs to
the token limit, as Gemma 3 did. Its attention and MLP outputs are zero, so the residual stream is
the current token's embedding and the logits a bigram table: the embeddings are one-hot rows, the
LM head maps them to the next token. The oracle is ``transformers``' own ``generate`` on the same
checkpoint: with no eos given (it reads ``generation_config.json`` itself) and with the eos list.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import torch
from chat_helpers import bpe_backend, chat_tokenizer

from nxd_finetune.serve import generate as gen
from tests.cli_run import run_cli

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
MAX_NEW = 12
SPECIALS = ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
CORPUS = ["What is two plus two?", "It is four.", "A Z model user"] * 4
# Gemma 3's released template (text only)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set prefix = '' %}{% set loop_messages = messages %}"
    "{% endif %}{% for m in loop_messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') }}{{ m['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# a template whose turns end with no special token (so only the generation config names <end_of_turn>)
PLAIN = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'model: ' }}{% endif %}")
# case -> (chat template, generation config lists <end_of_turn>)
CASES = {"gemma-3": (GEMMA, True), "template only": (GEMMA, False), "generation config only": (PLAIN, True)}
QUESTIONS = ["What is two plus two?", "It is four. What is two?"]


def repeating_gemma(path: Path, template: str, config_lists_eot: bool) -> None:
    """The module docstring's tiny Gemma 3 with its tokenizer, saved to ``path``."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    tok = chat_tokenizer(bpe_backend(SPECIALS, CORPUS), SPECIALS, template, "<bos>", "<eos>", "<pad>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<pad>", "<bos>", "<eos>", "<end_of_turn>", "A", "Z")}
    config = Gemma3TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=16, intermediate_size=96, vocab_size=len(tok), max_position_embeddings=256,
                              bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
                              tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    eot, a, z = ids["<end_of_turn>"], ids["A"], ids["Z"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        emb.zero_()
        emb[:, 2] = 1.0  # any token -> A
        emb[a, 2], emb[a, 0] = 0.0, 1.0  # A -> <end_of_turn>
        emb[z, 2], emb[z, 0] = 0.0, 1.0  # Z -> <end_of_turn>
        emb[eot, 2], emb[eot, 1] = 0.0, 1.0  # <end_of_turn> -> Z
        head.zero_()
        head[eot, 0], head[z, 1], head[a, 2] = 1.0, 1.0, 1.0
    model.save_pretrained(path)
    tok.save_pretrained(path)
    eos = [ids["<eos>"], eot] if config_lists_eot else ids["<eos>"]
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["<bos>"], "eos_token_id": eos, "pad_token_id": ids["<pad>"]}))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stop")
    for i, (template, lists_eot) in enumerate(CASES.values()):
        repeating_gemma(root / str(i), template, lists_eot)
    return {name: root / str(i) for i, name in enumerate(CASES)}


def hf_generate(model_dir: Path, ids: list[int], eos: list[int] | int | None) -> list[int]:
    """``transformers``' greedy generation; ``eos`` None: the checkpoint's generation config decides."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = torch.tensor([ids])
    stop = {} if eos is None else {"eos_token_id": eos}
    with torch.no_grad():
        y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False,
                           **stop)
    return y[0, len(ids):].tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_generation_stops_where_transformers_does(case, models):
    model_dir = models[case]
    with gen.load_model(None, str(model_dir), device="cpu") as loaded:
        tok = loaded.tokenizer
        prompts = [gen.prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
        config = gen.GenerationConfig(MAX_NEW)
        single = [gen.generate_ids(loaded, p, config) for p in prompts]
        batched = gen.generate_batch(loaded, prompts, config, batch_size=2)
        streamed = ["".join(gen.stream(loaded, p, config)) for p in prompts]
    eos, eot = tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")
    answer = [tok.convert_tokens_to_ids("A"), eot]
    # the model would repeat <end_of_turn> up to the token limit when only the tokenizer's eos stops it
    assert len(hf_generate(model_dir, prompts[0], eos)) == MAX_NEW
    for p, ours, in_batch, text in zip(prompts, single, batched, streamed, strict=True):
        assert ours == hf_generate(model_dir, p, [eos, eot]) == answer
        if CASES[case][1]:
            assert ours == hf_generate(model_dir, p, None)  # transformers reading generation_config.json
        assert in_batch == ours
        assert text == gen.decode(tok, ours) == "A"


def test_generate_chat_and_eval_stop_at_end_of_turn(models, capsys, monkeypatch, tmp_path):
    model_dir = str(models["gemma-3"])
    code, text, err = run_cli(capsys, "generate", "--base", model_dir, "--prompt", QUESTIONS[0],
                              "--max-new-tokens", str(MAX_NEW), "--device", "cpu")
    assert code == 0, err
    assert text == "A\n"  # not AZZZ...

    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTIONS[0]}\n{QUESTIONS[1]}\n/exit\n"))
    code, text, err = run_cli(capsys, "chat", "--base", model_dir, "--max-new-tokens", str(MAX_NEW), "--device", "cpu")
    assert code == 0, err
    assert text.splitlines() == ["A", "A"]

    rows = tmp_path / "eval.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": "A"}]}) + "\n"
                            for q in QUESTIONS * 2))
    dest = tmp_path / "scores.json"
    code, _, err = run_cli(capsys, "eval", str(QUICKSTART), f"model.path={model_dir}", f"data.train={rows}",
                           f"data.eval={rows}", "training.micro_batch_size=1", f"output.dir={tmp_path / 'out'}",
                           "--adapter", model_dir, "--generate", "--max-new-tokens", str(MAX_NEW), "--out", str(dest))
    assert code == 0, err
    scores = json.loads(dest.read_text())
    assert scores["generated"] == 4 and scores["exact_match"] == 1.0, scores["examples"]


# family -> (specials, eos, chat template, the end-of-turn token it closes assistant turns with)
FAMILIES = {
    "chatml (Qwen2.5 base: eos <|endoftext|>)": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>",
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}", "<|im_end|>"),
    "llama 3 (eos <|end_of_text|>)": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|end_of_text|>",
        "{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>"
        "\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
        "<|eot_id|>"),
    "phi-3 (an eos after the conversation)": (
        ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|endoftext|>",
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}", "<|end|>"),
    "mistral (turns closed by the eos)": (
        ["<s>", "</s>"], "</s>",
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}", None),
    "no special token closes a turn": (["<eos>"], "<eos>", PLAIN, None),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stop_ids_hold_the_templates_end_of_turn(family, tmp_path):
    specials, eos, template, end_of_turn = FAMILIES[family]
    tok = chat_tokenizer(bpe_backend(specials, CORPUS), specials, template, None, eos, eos)
    expected = [tok.eos_token_id] + ([tok.convert_tokens_to_ids(end_of_turn)] if end_of_turn else [])
    assert list(gen.stop_token_ids(tok, None)) == expected
    # the same template given instead of the tokenizer's (--chat-template), and no template at all
    bare = chat_tokenizer(bpe_backend(specials, CORPUS), specials, None, None, eos, eos)
    assert list(gen.stop_token_ids(bare, None, template)) == expected
    assert list(gen.stop_token_ids(bare, None)) == [tok.eos_token_id]
    # the generation config's ids join them, each once
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, tok.eos_token_id, 7]}))
    assert list(gen.stop_token_ids(tok, tmp_path)) == [expected[0], 7, *expected[1:]]

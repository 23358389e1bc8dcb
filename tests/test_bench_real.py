"""bench/bench_real.py's TRL side trains what nxd-finetune trains: SmolLM2's chat template with
``{% generation %}`` markers (bench/real_worker.py) renders the text of the original template, and
the tokens TRL's assistant mask selects (``return_assistant_tokens_mask``, what
``assistant_only_loss`` trains) are exactly our labels' (each assistant turn's content and
``<|im_end|>``) on the quickstart conversations. Needs the ``[smollm2]`` extra."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.real_worker import training_template
from nxd_finetune.data.formats import render_row, tokenize_rendered
from nxd_finetune.loss import IGNORE_INDEX

ASSETS = Path(__file__).resolve().parents[1] / "nxd_finetune" / "assets" / "quickstart"


@pytest.mark.smollm2
def test_trl_assistant_mask_is_our_labels():
    from transformers import AutoTokenizer

    from nxd_finetune import smollm2

    tok = AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())
    marked = AutoTokenizer.from_pretrained(smollm2.ensure_smollm2())
    marked.chat_template = training_template(tok.chat_template)
    rows = [json.loads(line) for line in (ASSETS / "eval.jsonl").read_text().splitlines()[:12]]
    for row in rows:
        messages = row["messages"]
        assert marked.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(messages, tokenize=False)
        got = marked.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        trl = [t for t, m in zip(got["input_ids"], got["assistant_masks"], strict=True) if m]
        columns = {"messages": "messages", "role": "role", "content": "content"}
        ((ids, labels),) = tokenize_rendered(tok, [render_row(row, "messages", columns, tok)])
        assert list(ids) == list(got["input_ids"])
        assert [t for t in labels if t != IGNORE_INDEX] == trl, messages

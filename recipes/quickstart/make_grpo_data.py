"""Regenerate the GRPO quickstart's prompts: ``grpo_train.jsonl`` (next to the SFT quickstart's
data, ``nxd_finetune/assets/quickstart/``).

Generated from a fixed seed with the standard library only: ``python recipes/quickstart/make_grpo_data.py``
reproduces the shipped file byte for byte (``tests/test_grpo_quickstart.py`` checks that).

The task: the SFT quickstart (``make_data.py``) taught a tiny model to answer "Is N even or odd?"
with the parity of N. These prompts ask about the next number, "Is the next number after N even or
odd?", a question the SFT data never asks; the verifiable reward (the built-in ``exact_match``
against the ``answer`` column) is the parity of N + 1. The SFT model reads the question as its own
and answers the parity of N, so its reward starts near 0; sampling (``top_k: 2`` at a high
temperature: the other word, never anything else) finds the flip often enough for GRPO to learn it.
Prompt-only conversational form (TRL's): ``prompt`` a list of messages, ``answer`` the checked word.
The numbers the docs ask the trained adapter about (1234, 4321) are not among them.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_data as md  # noqa: E402  (the SFT quickstart's generator: parity, jsonl, write)

SEED = 11
N_TRAIN = 512
QUESTION = "Is the next number after {n} even or odd?"


def make_rows(seed: int = SEED) -> list[dict]:
    """One prompt per number drawn from [0, 10000); ``answer``: the parity of the next number."""
    return [
        {"prompt": [{"role": "user", "content": QUESTION.format(n=n)}], "answer": md.parity(n + 1)}
        for n in random.Random(seed).sample(range(10000), N_TRAIN)
    ]


def render_all() -> dict[str, str]:
    """File name -> exact content of the generated file."""
    return {"grpo_train.jsonl": md.jsonl(make_rows())}


if __name__ == "__main__":
    md.write(render_all())

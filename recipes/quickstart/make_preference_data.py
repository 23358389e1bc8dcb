"""Regenerate the DPO quickstart's preference pairs: ``preference_train.jsonl`` and
``preference_eval.jsonl`` (next to the SFT quickstart's data, ``nxd_finetune/assets/quickstart/``).

Generated from a fixed seed with the standard library only: ``python
recipes/quickstart/make_preference_data.py`` reproduces the shipped files byte for byte
(``tests/test_quickstart_assets.py`` checks that).

The preference: the SFT quickstart (``make_data.py``) taught a tiny model to answer an even/odd
question with one bare word (``even`` / ``odd``). These pairs ask the same questions and prefer a
polite answer, ``odd, my friend.``, which the SFT data never shows: the rejected answer is
the bare word the SFT model gives (three pairs in four) or the polite answer with the wrong parity
(one in four), so the style is learnt without giving up the rule. The answer word stays first,
where the SFT model already gets it right; what DPO must change is what follows it (the polite
tail instead of the end of the turn). Conversational form
(TRL's): ``prompt`` a list of messages, ``chosen`` / ``rejected`` the assistant turn. Eval numbers
never occur in train.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 4321
N_TRAIN = 384
N_EVAL = 64
WRONG_PARITY_SHARE = 0.25


def _make_data():
    """The SFT quickstart's generator (same folder): its question templates and ``parity``."""
    spec = importlib.util.spec_from_file_location("quickstart_make_data", HERE / "make_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def polite(answer: str) -> str:
    """The preferred style: the answer, then a thank-you."""
    return f"{answer}, my friend."


def make_pairs(numbers: list[int], rng: random.Random) -> list[dict]:
    """One pair per number: the question, the polite answer with the right parity as chosen, the
    bare word (or the polite answer with the wrong parity) as rejected."""
    md = _make_data()
    rows = []
    for n in numbers:
        right = md.parity(n)
        wrong = "odd" if right == "even" else "even"
        question = rng.choice(md.QUESTION_TEMPLATES).format(n=n)
        rejected = polite(wrong) if rng.random() < WRONG_PARITY_SHARE else right
        rows.append({
            "prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": polite(right)}],
            "rejected": [{"role": "assistant", "content": rejected}],
        })
    return rows


def make_splits(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """Train and eval pairs over disjoint numbers in [0, 10000)."""
    rng = random.Random(seed)
    numbers = rng.sample(range(10000), N_TRAIN + N_EVAL)
    return make_pairs(numbers[:N_TRAIN], rng), make_pairs(numbers[N_TRAIN:], rng)


def render_all() -> dict[str, str]:
    """File name -> exact content of every generated file."""
    md = _make_data()
    train, eval_ = make_splits()
    return {"preference_train.jsonl": md.jsonl(train), "preference_eval.jsonl": md.jsonl(eval_)}


if __name__ == "__main__":
    _make_data().write(render_all())

"""Generate the benchmark's SFT data: ``bench/data/sft.jsonl`` (messages format).

Deterministic (fixed seed, standard library + the quickstart tokenizer, which is itself built
deterministically from ``nxd_finetune/assets/quickstart/corpus.txt``), so ``python bench/make_data.py``
reproduces the shipped file byte for byte.

Lengths: each conversation's total token count (chat template included) is drawn log-uniformly from
[MIN_TOKENS, MAX_TOKENS] -- many short samples and a long tail, as in real SFT sets (Alpaca, Dolly,
OpenAssistant are all right-skewed) -- and the prompt takes 20-80 % of it. A quarter of the rows have
two user/assistant turns, some a system message, so the loss masking is multi-turn. The text is
sentences of the quickstart corpus (plain English from a grammar), so the tokenizer sees its
natural distribution.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "data" / "sft.jsonl"
SEED = 20240611
N_SAMPLES = 512
MIN_TOKENS, MAX_TOKENS = 20, 500
SYSTEM = "You are a helpful assistant. Answer in plain sentences."


def _sentences() -> list[str]:
    sys.path.insert(0, str(HERE.parent))
    from nxd_finetune.quickstart import CORPUS

    words = CORPUS.read_text().split()
    out, cur = [], []
    for w in words:
        cur.append(w)
        if w.endswith((".", "?", "!")) and len(cur) >= 3:
            out.append(" ".join(cur))
            cur = []
    return out


def _text(rng: random.Random, sentences: list[str], n_tokens: int, count) -> str:
    """Corpus sentences cut to ``n_tokens`` tokens (as ``count`` measures), at least one word."""
    words: list[str] = []
    while count(" ".join(words)) < n_tokens:
        words += rng.choice(sentences).split()
    lo, hi = 1, len(words)  # largest prefix within budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    from transformers import AutoTokenizer

    from nxd_finetune.quickstart import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(SEED)
    sentences = _sentences()
    rows = []
    for _ in range(N_SAMPLES):
        total = int(math.exp(rng.uniform(math.log(MIN_TOKENS), math.log(MAX_TOKENS))))
        turns = 2 if rng.random() < 0.25 and total >= 60 else 1
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
        # template overhead: bos + per message marker, newline (+ eos after answers) ~ 3 tokens
        budget = max(total - 3 * (len(messages) + 2 * turns) - (count(SYSTEM) if messages else 0), 2 * turns)
        for _ in range(turns):
            share = budget // turns
            prompt = max(1, int(share * rng.uniform(0.2, 0.8)))
            messages.append({"role": "user", "content": _text(rng, sentences, prompt, count)})
            messages.append({"role": "assistant", "content": _text(rng, sentences, max(1, share - prompt), count)})
        rows.append({"messages": messages})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    encoded = [tok.apply_chat_template(r["messages"], tokenize=True) for r in rows]
    ids = [len(e["input_ids"] if hasattr(e, "keys") else e) for e in encoded]
    print(f"wrote {OUT}: {len(rows)} rows, {OUT.stat().st_size / 1e3:.0f} kB, tokens min {min(ids)} "
          f"mean {sum(ids) / len(ids):.0f} max {max(ids)}")


if __name__ == "__main__":
    main()

"""Data pipeline: formats and loss masks, truncation, loading, cache, packing, sampler, loaders."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from nxd_finetune.data import datasets as data_mod
from nxd_finetune.data import tokenize as tokenize_mod
from nxd_finetune.data.datasets import DataSpec, TokenizedDataset, load_rows, prepare_datasets, tokenize_rows
from nxd_finetune.data.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from nxd_finetune.data.loader import build_dataloaders
from nxd_finetune.data.packing import collate, make_rows, pack_bins
from nxd_finetune.data.sampler import ResumableSampler
from nxd_finetune.errors import DataError, NxdWarning
from nxd_finetune.loss import IGNORE_INDEX

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORD_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WORDS = ["hi", "hello", "bye", "ok", "be", "brief", "what", "is", "up", "nothing"]


@pytest.fixture(scope="module")
def word_tok():
    """One token per word (WordLevel): label positions can be written out by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="[UNK]",
        additional_special_tokens=specials[4:],
        chat_template=WORD_TEMPLATE,
    )


@pytest.fixture(scope="module")
def bpe_tok():
    """The quickstart's byte-level BPE tokenizer (lossless; adds <|bos|> to plain text)."""
    from nxd_finetune.quickstart import build_tokenizer

    return build_tokenizer()


def tokenize(rows, tok, **spec):
    return tokenize_rows(rows, DataSpec.of({"max_seq_len": 512, **spec}), tok)


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- formats and masks


def test_messages_multi_turn_masks_only_assistant_turns(word_tok):
    conv = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "what is up"},
        {"role": "assistant", "content": "nothing"},
    ]
    ds = tokenize([{"messages": conv}], word_tok)
    sample = ds[0]
    tokens = word_tok.convert_ids_to_tokens(sample["input_ids"])
    assert tokens == [
        "<s>",
        "<|system|>",
        "be",
        "brief",
        "<|user|>",
        "hi",
        "<|assistant|>",
        "hello",
        "</s>",
        "<|user|>",
        "what",
        "is",
        "up",
        "<|assistant|>",
        "nothing",
        "</s>",
    ]
    trained = [i for i, t in enumerate(sample["labels"]) if t != IGNORE_INDEX]
    assert trained == [7, 8, 14, 15]  # hello </s> ... nothing </s>; no extra eos appended
    assert all(sample["labels"][i] == sample["input_ids"][i] for i in trained)
    assert ds.stats == {"samples": 1, "tokens": 16, "trainable_tokens": 4, "truncated": 0, "dropped": 0}


def test_messages_train_on_prompt_and_trailing_user_turn(word_tok):
    conv = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ]
    sample = tokenize([{"messages": conv}], word_tok)[0]
    # rendering ends with a user turn: eos appended untrained; only "hello </s>" trained
    assert word_tok.convert_ids_to_tokens(sample["input_ids"])[-1] == "</s>"
    assert [t for t in sample["labels"] if t != IGNORE_INDEX] == enc(word_tok, "hello") + [word_tok.eos_token_id]
    full = tokenize([{"messages": conv}], word_tok, train_on_prompt=True)[0]
    assert full["labels"] == full["input_ids"]


def test_messages_with_bpe_tokenizer_and_sharegpt_fields(bpe_tok):
    row = {
        "conversations": [
            {"from": "human", "value": "Is 47 even or odd?"},
            {"from": "gpt", "value": "odd"},
            {"from": "human", "value": "Is 12 even or odd?"},
            {"from": "gpt", "value": "even"},
        ]
    }
    sample = tokenize([row], bpe_tok, fields={"messages": "conversations", "role": "from", "content": "value"})[0]
    ids, labels = sample["input_ids"], sample["labels"]
    runs, cur = [], []
    for i, t in zip(ids, labels, strict=True):
        if t != IGNORE_INDEX:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    assert [bpe_tok.decode(r) for r in runs] == ["odd<|eos|>", "even<|eos|>"]
    prompt = bpe_tok.apply_chat_template(
        [{"role": "user", "content": "Is 47 even or odd?"}], tokenize=False, add_generation_prompt=True
    )
    n = len(enc(bpe_tok, prompt))
    assert labels[:n] == [IGNORE_INDEX] * n and labels[n] == ids[n] == enc(bpe_tok, "odd")[0]


def test_alpaca_exact_labels(bpe_tok):
    eos, bos = bpe_tok.eos_token_id, bpe_tok.bos_token_id
    rows = [
        {"instruction": "Name a fruit.", "input": "", "output": "A banana."},
        {"instruction": "Add.", "input": "2 and 3", "output": "5"},
    ]
    ds = tokenize(rows, bpe_tok, format="alpaca")
    prompts = [
        ALPACA_PROMPT_NO_INPUT.format(instruction="Name a fruit."),
        ALPACA_PROMPT.format(instruction="Add.", input="2 and 3"),
    ]
    for i, (row, prompt) in enumerate(zip(rows, prompts, strict=True)):
        p, a = enc(bpe_tok, prompt), enc(bpe_tok, row["output"])
        assert ds[i]["input_ids"] == [bos] + p + a + [eos]
        assert ds[i]["labels"] == [IGNORE_INDEX] * (1 + len(p)) + a + [eos]


def test_alpaca_without_input_column_and_prompt_completion_and_text(bpe_tok):
    eos, bos = bpe_tok.eos_token_id, bpe_tok.bos_token_id
    ds = tokenize([{"q": "Hi.", "a": "Hello."}], bpe_tok, format="alpaca", fields={"instruction": "q", "output": "a"})
    assert bpe_tok.decode([t for t in ds[0]["labels"] if t != IGNORE_INDEX]) == "Hello.<|eos|>"

    ds = tokenize([{"prompt": "Q: red?\nA:", "completion": " yes"}], bpe_tok, format="prompt_completion")
    p, c = enc(bpe_tok, "Q: red?\nA:"), enc(bpe_tok, " yes")
    assert ds[0]["input_ids"] == [bos] + p + c + [eos]
    assert ds[0]["labels"] == [IGNORE_INDEX] * (1 + len(p)) + c + [eos]

    ds = tokenize([{"text": "The cat sees the dog."}], bpe_tok, format="text")
    ids = ds[0]["input_ids"]
    assert ids == [bos] + enc(bpe_tok, "The cat sees the dog.") + [eos]
    assert ds[0]["labels"] == [IGNORE_INDEX] + ids[1:]


def test_missing_column_lists_available(bpe_tok):
    with pytest.raises(DataError, match=r"'output'.*has: instruction, answer"):
        tokenize([{"instruction": "x", "answer": "y"}], bpe_tok, format="alpaca")
    with pytest.raises(DataError, match="not used by format"):
        tokenize([{"text": "x"}], bpe_tok, format="text", fields={"prompt": "text"})
    with pytest.raises(DataError, match="keys 'role' and 'content'"):
        tokenize([{"messages": [{"speaker": "user", "text": "hi"}]}], bpe_tok)


def test_chat_template_from_recipe_string_or_file(bpe_tok, tmp_path):
    from nxd_finetune.data.formats import load_chat_template

    (tmp_path / "t.jinja").write_text(WORD_TEMPLATE)
    assert load_chat_template("t.jinja", tmp_path) == WORD_TEMPLATE
    assert load_chat_template(WORD_TEMPLATE) == WORD_TEMPLATE
    with pytest.raises(DataError, match="neither a Jinja template nor an existing file"):
        load_chat_template("missing.jinja", tmp_path)
    from transformers import PreTrainedTokenizerFast

    from nxd_finetune.data.formats import render_chat

    bare = PreTrainedTokenizerFast(tokenizer_object=bpe_tok.backend_tokenizer, eos_token="<|eos|>")
    with pytest.raises(DataError, match="no chat template"):
        render_chat(bare, [{"role": "user", "content": "hi"}])
    assert render_chat(bare, [{"role": "user", "content": "hi"}], WORD_TEMPLATE).startswith("<|user|>\nhi")


def test_truncation_and_drop_are_counted(bpe_tok):
    long_text = "The cat sees the dog. " * 20
    rows = [
        {"prompt": "Say it:", "completion": long_text},  # truncated, keeps trained tokens
        {"prompt": long_text, "completion": " ok"},  # answer beyond max_seq_len: dropped
        {"prompt": "Hi", "completion": " ok"},  # fits
    ]
    ds = tokenize(rows, bpe_tok, format="prompt_completion", max_seq_len=16)
    assert ds.stats["truncated"] == 2 and ds.stats["dropped"] == 1 and ds.stats["samples"] == 2 == len(ds)
    assert ds.lengths.tolist() == [16, len(enc(bpe_tok, "Hi ok")) + 2]
    assert ds.stats["tokens"] == sum(ds.lengths.tolist())
    assert ds.stats["trainable_tokens"] == sum(
        sum(t != IGNORE_INDEX for t in ds[i]["labels"][1:]) for i in range(len(ds))
    )



def test_worker_processes_give_the_same_samples(bpe_tok, tmp_path):
    """``data.num_proc``: forked workers over contiguous shares give the same arrays, counts and
    order as one process, with truncated and dropped samples in several shares."""
    long_text = "The cat sees the dog. " * 20
    rows = []
    for i in range(2 * tokenize_mod._CHUNK + 37):
        kind = i % 7
        prompt = long_text if kind == 3 else f"Question {i}:"
        answer = long_text if kind == 5 else f" answer {i % 13}"
        rows.append({"prompt": prompt, "completion": answer})
    path = tmp_path / "rows.jsonl"
    _write_rows(path, rows)
    loaded = load_rows(str(path))
    with warnings.catch_warnings():  # on a machine with fewer cores than 3 (or 4, below): said, and capped
        warnings.filterwarnings("ignore", message="data.num_proc=", category=NxdWarning)
        results = [tokenize_rows(loaded, DataSpec(format="prompt_completion", max_seq_len=24, num_proc=n), bpe_tok)
                   for n in (1, 2, 3)]
        assert tokenize_mod.worker_count("auto", 100) == 1 and tokenize_mod.worker_count(4, 2) == 2
    one = results[0]
    assert one.stats["truncated"] > 0 and one.stats["dropped"] > 0
    for other in results[1:]:
        assert torch.equal(one.input_ids, other.input_ids) and torch.equal(one.labels, other.labels)
        assert torch.equal(one.offsets, other.offsets) and one.stats == other.stats


# ---------------------------------------------------------------- loading and cache


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_load_rows_local_formats(tmp_path):
    import datasets

    rows = [{"text": f"row {i}"} for i in range(5)]
    _write_rows(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "c.parquet"))
    ds.to_csv(str(tmp_path / "d.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "e"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "f"))
    cache = str(tmp_path / "hf")
    for name in ("a.jsonl", "b.json", "c.parquet", "d.csv", "e", "f"):
        assert load_rows(name, base_dir=tmp_path, hf_cache=cache)["text"] == [r["text"] for r in rows], name
    both = load_rows([str(tmp_path / "a.jsonl"), str(tmp_path / "e")], hf_cache=cache)
    assert len(both) == 10


def test_load_rows_errors(tmp_path):
    with pytest.raises(DataError, match=r"data file not found: .*nope\.jsonl"):
        load_rows("nope.jsonl", base_dir=tmp_path)
    with pytest.raises(DataError, match="Hub is offline"):
        load_rows("some-org/some-dataset")
    with pytest.raises(DataError, match="Hub is offline"):
        load_rows("hf://some-org/some-dataset")
    with pytest.raises(DataError, match="only local paths"):
        load_rows("s3://bucket/train.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match="cannot load dataset .*bad.jsonl.*: line 1: "):
        load_rows(str(tmp_path / "bad.jsonl"), hf_cache=str(tmp_path / "hf"))
    # one malformed line among 512: the error names its line
    lines = [json.dumps({"text": f"row {i}"}) for i in range(512)]
    lines[99] = '{"text": "row 99"'
    (tmp_path / "one_bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match="one_bad.jsonl.*: line 100: Expecting ',' delimiter"):
        load_rows(str(tmp_path / "one_bad.jsonl"), hf_cache=str(tmp_path / "hf"))


def _qa_rows(n, offset=0):
    return [
        {"prompt": f"Is {i} even? ", "completion": "yes" if i % 2 == 0 else "no"} for i in range(offset, offset + n)
    ]


def test_cache_hit_does_not_retokenize(bpe_tok, tmp_path, monkeypatch):
    _write_rows(tmp_path / "train.jsonl", _qa_rows(30))
    spec = {
        "train": str(tmp_path / "train.jsonl"),
        "format": "prompt_completion",
        "max_seq_len": 64,
        "cache_dir": str(tmp_path / "cache"),
        "eval_fraction": 0.2,
    }
    calls = []
    real = data_mod.tokenize_rows
    monkeypatch.setattr(data_mod, "tokenize_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    train, eval_ = prepare_datasets(spec, bpe_tok)
    assert len(calls) == 2 and (len(train), len(eval_)) == (24, 6)
    train2, eval2 = prepare_datasets({**spec, "packing": False, "shuffle": False}, bpe_tok)  # not in the key
    assert len(calls) == 2
    assert torch.equal(train.input_ids, train2.input_ids) and torch.equal(eval_.labels, eval2.labels)
    assert train2.stats == train.stats
    prepare_datasets({**spec, "max_seq_len": 32}, bpe_tok)
    assert len(calls) == 4
    _write_rows(tmp_path / "train.jsonl", _qa_rows(31))  # data changed (size): miss
    assert len(prepare_datasets(spec, bpe_tok)[0]) == 25 and len(calls) == 6


def test_eval_fraction_split_is_fixed_and_disjoint(bpe_tok, tmp_path):
    _write_rows(tmp_path / "t.jsonl", _qa_rows(20))
    spec = {"train": str(tmp_path / "t.jsonl"), "format": "prompt_completion", "eval_fraction": 0.25}
    train, eval_ = prepare_datasets(spec, bpe_tok, use_cache=False)
    seqs = lambda ds: {tuple(ds[i]["input_ids"]) for i in range(len(ds))}  # noqa: E731
    assert len(eval_) == 5 and not seqs(train) & seqs(eval_)
    assert seqs(prepare_datasets(spec, bpe_tok, use_cache=False)[1]) == seqs(eval_)
    with pytest.raises(DataError, match="either data.eval or data.eval_fraction"):
        prepare_datasets({**spec, "eval": spec["train"]}, bpe_tok)


# ---------------------------------------------------------------- packing


def test_pack_bins_best_fit_decreasing():
    assert pack_bins([5, 3, 4, 2, 6], 8) == [[3, 4], [0, 1], [2]]
    with pytest.raises(DataError, match="more than max_seq_len"):
        pack_bins([9], 8)


def test_pack_bins_invariants():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 65, (500,), generator=g).tolist()
    bins = pack_bins(lengths, 64)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(500))  # every sample exactly once, never split
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert sum(lengths) / (64 * len(bins)) > 0.95


def _toy_dataset(lengths, start_label=True):
    samples = []
    base = 10
    for n in lengths:
        ids = list(range(base, base + n))
        samples.append((ids, list(ids)))
        base += n
    return TokenizedDataset.from_samples(samples, {})


def test_collate_packed_rows():
    ds = _toy_dataset([3, 2, 4])
    batch = collate(ds, [[0, 1], [2]], pad_id=0, seq_len=7)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14, 0, 0], [15, 16, 17, 18, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 11, 12, -100, 14, -100, -100], [-100, 16, 17, 18, -100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0]]
    assert all(v.dtype == torch.long for v in batch.values())


def test_packing_preserves_all_tokens(bpe_tok):
    rows = _qa_rows(40)
    ds = tokenize(rows, bpe_tok, format="prompt_completion")
    packed_rows = make_rows(ds.lengths.tolist(), 32, packing=True)
    batch = collate(ds, packed_rows, bpe_tok.pad_token_id, seq_len=32)
    seen = []
    for r, row in enumerate(packed_rows):
        seg = batch["segment_ids"][r]
        for k, i in enumerate(row, start=1):
            where = seg == k
            assert torch.equal(batch["input_ids"][r][where], ds.tensors(i)[0].long())
            expected = ds.tensors(i)[1].long().clone()
            expected[0] = IGNORE_INDEX
            assert torch.equal(batch["labels"][r][where], expected)
            assert batch["position_ids"][r][where].tolist() == list(range(int(where.sum())))
            seen.append(i)
        assert (batch["labels"][r][seg == 0] == IGNORE_INDEX).all()
    assert sorted(seen) == list(range(len(ds)))


def test_unpacked_collate_pads_to_longest_or_fixed():
    ds = _toy_dataset([3, 5])
    b = collate(ds, [[0], [1]], pad_id=1)
    assert b["input_ids"].shape == (2, 5) and b["segment_ids"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert b["labels"][0].tolist() == [-100, 11, 12, -100, -100]
    assert collate(ds, [[0], [1]], pad_id=1, seq_len=8)["input_ids"].shape == (2, 8)


# ---------------------------------------------------------------- sampler


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_sampler_deterministic_and_reshuffled_per_epoch():
    a, b = ResumableSampler(20, 2, seed=3), ResumableSampler(20, 2, seed=3)
    assert _take(iter(a), 25) == _take(iter(b), 25)
    first = [i for batch in ResumableSampler(20, 2, seed=3).rank_batches(0) for i in batch]
    second = [i for batch in ResumableSampler(20, 2, seed=3).rank_batches(1) for i in batch]
    assert sorted(first) == sorted(second) == list(range(20)) and first != second
    assert [i for bt in ResumableSampler(20, 2, shuffle=False).rank_batches(0) for i in bt] == list(range(20))


@pytest.mark.parametrize("stop", [3, 10, 17])  # mid-epoch, at the epoch end, in the next epoch
def test_sampler_resume_continues_identically(stop):
    reference = _take(iter(ResumableSampler(21, 2, seed=7)), 30)
    s = ResumableSampler(21, 2, seed=7)
    it = iter(s)
    _take(it, stop)
    state = json.loads(json.dumps(s.state_dict()))
    resumed = ResumableSampler(21, 2, seed=7)
    resumed.load_state_dict(state)
    assert _take(iter(resumed), 30 - stop) == reference[stop:]
    assert s.batches_per_epoch == 10


def test_sampler_dp_shards_disjoint_equal_and_reshardable():
    world, mbs = 3, 2
    per_rank = [ResumableSampler(20, mbs, seed=1, dp_rank=r, dp_world=world).rank_batches(0) for r in range(world)]
    assert all(len(b) == 3 for b in per_rank)  # 20 // 3 = 6 rows per rank, remainder dropped
    flat = [set(i for batch in b for i in batch) for b in per_rank]
    assert all(not flat[x] & flat[y] for x in range(world) for y in range(x + 1, world))
    # micro-step k of all ranks together covers order[k*G:(k+1)*G]
    order = ResumableSampler(20, mbs, seed=1).epoch_order(0).tolist()
    for k in range(3):
        assert set().union(*(set(b[k]) for b in per_rank)) == set(order[k * 6 : (k + 1) * 6])
    # resume 2 ranks x mbs 2 as 1 rank x mbs 4: same global order
    s = ResumableSampler(20, 2, seed=1, dp_rank=0, dp_world=2)
    _take(iter(s), 2)
    single = ResumableSampler(20, 4, seed=1)
    single.load_state_dict(s.state_dict())
    assert next(iter(single)) == order[8:12]
    with pytest.raises(DataError, match="cannot resume"):
        ResumableSampler(20, 3, seed=1).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="seed"):
        ResumableSampler(20, 2, seed=2, dp_world=2).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="cannot fill one micro-batch"):
        ResumableSampler(5, 2, dp_world=3)


# ---------------------------------------------------------------- loaders


def test_build_dataloaders_resume_and_eval_shards(bpe_tok, tmp_path):
    _write_rows(tmp_path / "t.jsonl", _qa_rows(60))
    _write_rows(tmp_path / "e.jsonl", _qa_rows(9, offset=100))
    spec = {
        "train": "t.jsonl",
        "eval": "e.jsonl",
        "format": "prompt_completion",
        "max_seq_len": 32,
        "cache_dir": str(tmp_path / "cache"),
    }
    kw = dict(micro_batch_size=2, seed=5, base_dir=tmp_path)
    loaders = build_dataloaders(spec, bpe_tok, **kw)
    assert loaders.stats["train"]["samples"] == 60 and loaders.stats["train"]["fill"] > 0.8
    reference = _take(iter(build_dataloaders(spec, bpe_tok, **kw).train), 12)
    it = iter(loaders.train)
    first = _take(it, 5)
    resumed = build_dataloaders(spec, bpe_tok, **kw).train
    resumed.load_state_dict(loaders.train.state_dict())
    for got, want in zip(first + _take(iter(resumed), 7), reference, strict=True):
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert got["input_ids"].shape == (2, 32)
    # eval: same number of batches on every rank, every eval row exactly once
    shards = [
        build_dataloaders(
            {**spec, "packing": False}, bpe_tok, micro_batch_size=2, dp_rank=r, dp_world=2, base_dir=tmp_path
        ).eval
        for r in range(2)
    ]
    assert len(shards[0]) == len(shards[1]) == 3
    tokens = sum(int((b["segment_ids"] > 0).sum()) for s in shards for b in s)
    assert tokens == loaders.stats["eval"]["tokens"]
    fixed = build_dataloaders(
        {**spec, "packing": False}, bpe_tok, micro_batch_size=2, fixed_shape=True, base_dir=tmp_path
    )
    assert {tuple(b["input_ids"].shape) for b in fixed.eval} == {(2, 32)}

"""Preference data (``data.format: preference``): every form tokenized as TRL's ``DPOTrainer`` does
(its own dataset processing and collator are the oracle), masks on completion tokens only, pairs kept
together across micro-batches, dp ranks and resume, reference log-probs stored with the cached data,
and the bad rows refused in one line naming the row."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from nxd_finetune.data.datasets import DataSpec, cache_entry, tokenize_rows
from nxd_finetune.data.loader import build_dataloaders
from nxd_finetune.data.pairs import assemble_ref_logps, ref_logps_key
from nxd_finetune.data.preference import extract_prompt
from nxd_finetune.errors import DataError
from nxd_finetune.loss import IGNORE_INDEX
from nxd_finetune.preflight.data import check_data
from nxd_finetune.quickstart import TINY_QWEN3, build_tokenizer
from tests.chat_helpers import bpe_backend, chat_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_SPECIALS = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["What is two plus two?", "It is four.", "Four.", "You are terse.", "The sky is blue. It is green."] * 4

STANDARD = [
    {"prompt": "Is 12 even or odd?", "chosen": " It is even.", "rejected": " odd"},
    {"prompt": "The cat", "chosen": " sat.<|eos|>", "rejected": " ran away quickly"},  # eos already there
    {"prompt": "Question: 7?\nAnswer:", "chosen": "\nodd", "rejected": "\neven, since it ends in 7"},
]
CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": "What is two plus two?"}],
     "chosen": [{"role": "assistant", "content": "It is four."}],
     "rejected": [{"role": "assistant", "content": "Four."}]},
    {"prompt": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sky?"},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Sure?"}],
     "chosen": [{"role": "assistant", "content": "It is blue."}],
     "rejected": [{"role": "assistant", "content": "It is green."}]},
]
IMPLICIT_CHAT = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CONVERSATIONAL]
IMPLICIT_TEXT = [
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},
    {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: five"},
]


@pytest.fixture(scope="module")
def qs_tok():
    """The quickstart tokenizer: adds <|bos|> to text, its template ends answers with <|eos|>."""
    return build_tokenizer()


@pytest.fixture(scope="module")
def chatml_tok():
    """A ChatML tokenizer with no BOS (its template prints ``<|im_end|>\\n`` after every turn)."""
    return chat_tokenizer(bpe_backend(CHAT_SPECIALS, CORPUS), CHAT_SPECIALS, CHATML, None, "<|endoftext|>",
                          "<|pad|>")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def trl_batch(rows, tok, max_length=None, truncation_mode="keep_start"):
    """TRL's own processing of ``rows``: ``DPOTrainer._prepare_dataset`` (prompt extraction, eos,
    tokenization, the filter of fully truncated pairs) then ``DataCollatorForPreference``; labels
    are its completion mask applied to its input ids."""
    from datasets import Dataset

    args = SimpleNamespace(dataset_num_proc=None, max_length=max_length, truncation_mode=truncation_mode)
    ds = trl_dpo.DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), Dataset.from_list(rows), tok, args,
                                             "train")
    collator = trl_dpo.DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=max_length,
                                                 truncation_mode=truncation_mode)
    out = collator([ds[i] for i in range(len(ds))])
    labels = torch.where(out["completion_mask"].bool(), out["input_ids"], IGNORE_INDEX)
    return out["input_ids"], labels, int(out["attention_mask"].sum())


def our_batch(rows, tok, tmp_path, **settings):
    """All of ``rows`` as one eval micro-batch of our loaders."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    train = write_jsonl(tmp_path / "train.jsonl", rows * 4)  # enough to fill a training micro-batch
    spec = {"train": train, "eval": path, "format": "preference", "cache_dir": str(tmp_path / "cache"), **settings}
    loaders = build_dataloaders(spec, tok, micro_batch_size=len(rows))
    (batch,) = list(loaders.eval)
    return batch, loaders


@pytest.mark.parametrize("form", ["standard", "conversational", "implicit-chat", "implicit-text"])
@pytest.mark.parametrize("tok_name", ["qs_tok", "chatml_tok"])
def test_tokenized_as_trl(form, tok_name, request, tmp_path):
    tok = request.getfixturevalue(tok_name)
    rows = {"standard": STANDARD, "conversational": CONVERSATIONAL, "implicit-chat": IMPLICIT_CHAT,
            "implicit-text": IMPLICIT_TEXT}[form]
    ids, labels, tokens = trl_batch(rows, tok)
    batch, loaders = our_batch(rows, tok, tmp_path, max_seq_len=512)
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert torch.equal(batch["input_ids"], ids)
    assert torch.equal(batch["labels"], labels)
    stats = loaders.stats["eval"]
    assert stats["pairs"] == len(rows) and stats["samples"] == 2 * len(rows) and stats["tokens"] == tokens


def trl_orpo_rows(rows, tok):
    """TRL's ``ORPOTrainer`` (and ``CPOTrainer``: the same ``tokenize_row``) processing of each row:
    ``maybe_extract_prompt``, ``maybe_apply_chat_template`` (conversations rendered to text), then
    ``tokenize_row`` (its bos before the prompt, eos after each completion): each pair's
    ``[(chosen ids, labels), (rejected ids, labels)]``."""
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt
    from trl.experimental.orpo import ORPOTrainer

    this = SimpleNamespace(is_encoder_decoder=False, processing_class=tok, max_length=10**6)
    this.build_tokenized_answer = lambda prompt, answer: ORPOTrainer.build_tokenized_answer(this, prompt, answer)
    out = []
    for row in rows:
        row = maybe_apply_chat_template(maybe_extract_prompt(dict(row)), tok)
        f = ORPOTrainer.tokenize_row(this, row)
        out.append([(f[f"{s}_input_ids"], f[f"{s}_labels"]) for s in ("chosen", "rejected")])
    return out


@pytest.mark.parametrize("form", ["standard", "conversational", "implicit-chat", "implicit-text"])
@pytest.mark.parametrize("tok_name", ["qs_tok", "chatml_tok"])
def test_orpo_and_simpo_pairs_tokenized_as_trl_orpo_and_cpo(form, tok_name, request, tmp_path):
    """``objective: orpo`` and SimPO tokenize as TRL's ``ORPOTrainer`` / ``CPOTrainer``: the chat
    template's rendering as text, the tokenizer's bos before the prompt where it is not there and
    its eos after each completion where it is not there (after the template's end of turn:
    ChatML's ``<|im_end|>\n`` gets ``<|endoftext|>``), which ``DPOTrainer`` does not do."""
    tok = request.getfixturevalue(tok_name)
    rows = {"standard": STANDARD, "conversational": CONVERSATIONAL, "implicit-chat": IMPLICIT_CHAT,
            "implicit-text": IMPLICIT_TEXT}[form]
    want = trl_orpo_rows(rows, tok)
    batch, loaders = our_batch(rows, tok, tmp_path, max_seq_len=512, trl_tokenization="orpo")
    p = len(rows)
    for i, pair in enumerate(want):
        for half, (ids, labels) in enumerate(pair):
            row = i + half * p
            assert batch["input_ids"][row, :len(ids)].tolist() == ids, (i, half)
            assert batch["labels"][row, :len(ids)].tolist() == labels, (i, half)
            assert batch["labels"][row, len(ids):].eq(IGNORE_INDEX).all()
    assert loaders.stats["eval"]["tokens"] == sum(len(ids) for pair in want for ids, _ in pair)
    if tok_name == "chatml_tok" and form in ("conversational", "implicit-chat"):  # the report's case
        assert tok.decode(want[0][0][0][-3:]) == "<|im_end|>\n<|endoftext|>"  # eos after the end of turn
        dpo, _ = our_batch(rows, tok, tmp_path / "dpo", max_seq_len=512)  # DPOTrainer's pairs: none
        assert tok.decode(dpo["input_ids"][0][dpo["labels"][0] != IGNORE_INDEX][-2:]) == "<|im_end|>\n"


@pytest.mark.parametrize("form", ["conversational", "implicit-chat"])
def test_qwen3_without_thinking_tokenized_as_trl(form, tmp_path):
    """``data.chat_template_kwargs`` reach every render of a pair, as TRL's per-row
    ``chat_template_kwargs``: on Qwen3's template ``enable_thinking: false`` pre-fills the empty
    think block after the prompt, so the completions start after it."""
    tok = build_tokenizer(name=TINY_QWEN3)
    rows = {"conversational": CONVERSATIONAL, "implicit-chat": IMPLICIT_CHAT}[form]
    kwargs = {"enable_thinking": False}
    ids, labels, _ = trl_batch([r | {"chat_template_kwargs": kwargs} for r in rows], tok)
    batch, _ = our_batch(rows, tok, tmp_path / "off", max_seq_len=512, chat_template_kwargs=kwargs)
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["labels"], labels)
    thinking, _ = our_batch(rows, tok, tmp_path / "on", max_seq_len=512)
    assert torch.equal(thinking["input_ids"], ids) and not torch.equal(thinking["labels"], labels)
    trained = tok.decode([t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX])
    assert trained == "It is four.<|im_end|>\n"


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncation_and_drop_as_trl(qs_tok, tmp_path, mode):
    rows = STANDARD + [{"prompt": "A very long prompt about the old stone bridge and the river", "chosen": " yes",
                        "rejected": " no"}]
    ids, labels, _ = trl_batch(rows, qs_tok, max_length=12, truncation_mode=mode)
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    spec = DataSpec.of({"train": path, "format": "preference", "max_seq_len": 12, "truncation_mode": mode})
    ds = tokenize_rows([json.loads(line) for line in open(path)], spec, qs_tok)
    kept = len(ds) // 2
    assert kept == ids.shape[0] // 2 == (4 if mode == "keep_end" else 3)  # TRL drops a prompt filling max_length
    assert ds.stats["dropped"] == 4 - kept and ds.stats["truncated"] >= 1
    batch, _ = our_batch(rows, qs_tok, tmp_path, max_seq_len=12, truncation_mode=mode)
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["labels"], labels)


def test_max_prompt_length_keeps_the_prompts_end(qs_tok, tmp_path):
    rows = [{"prompt": "one two three four five six", "chosen": " yes", "rejected": " no"}]
    full, _ = our_batch(rows, qs_tok, tmp_path / "a", max_seq_len=64)
    short, _ = our_batch(rows, qs_tok, tmp_path / "b", max_seq_len=64, max_prompt_length=3)
    for r in range(2):
        n = int(full["labels"][r].ne(IGNORE_INDEX).nonzero()[0])  # the full prompt's tokens
        completion = full["input_ids"][r, n:][full["labels"][r, n:] != IGNORE_INDEX].tolist()
        assert n > 3 and short["input_ids"][r, :3].tolist() == full["input_ids"][r, n - 3:n].tolist()
        assert short["labels"][r, :3].eq(IGNORE_INDEX).all()
        assert short["labels"][r, 3:3 + len(completion)].tolist() == completion


def test_masks_only_completion_tokens(qs_tok, tmp_path):
    batch, _ = our_batch(CONVERSATIONAL[:1] * 1 + [CONVERSATIONAL[0] | {"rejected": [
        {"role": "assistant", "content": "Four."}, {"role": "user", "content": "More?"},
        {"role": "assistant", "content": "No."}]}], qs_tok, tmp_path, max_seq_len=256)
    decode = lambda row: qs_tok.decode([t for t in batch["labels"][row].tolist() if t != IGNORE_INDEX])  # noqa: E731
    assert decode(0) == decode(1) == "It is four.<|eos|>"
    assert decode(2) == "Four.<|eos|>"
    # TRL's DPO mask: everything the template prints after the prompt, later turns included
    assert decode(3) == "Four.<|eos|><|user|>\nMore?\n<|assistant|>\nNo.<|eos|>"
    prompt = qs_tok.apply_chat_template(CONVERSATIONAL[0]["prompt"], add_generation_prompt=True)["input_ids"]
    for row in range(4):
        assert batch["input_ids"][row, :len(prompt)].tolist() == list(prompt)
        assert (batch["labels"][row, :len(prompt)] == IGNORE_INDEX).all()


def test_extract_prompt_matches_trl():
    from trl.data_utils import extract_prompt as trl_extract

    for row in IMPLICIT_TEXT + IMPLICIT_CHAT + [{"chosen": "abc", "rejected": "abcdef"}]:
        got = extract_prompt(row["chosen"], row["rejected"])
        assert dict(zip(("prompt", "chosen", "rejected"), got, strict=True)) == trl_extract(row)


def numbered_pairs(n):
    """Pair ``i``: the prompt names i, chosen says ``yes i``, rejected ``no i``."""
    return [{"prompt": f"Pair {i}?", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(n)]


def pair_ids(batch, tok):
    """The pair number of each pair of a micro-batch, checking that row ``p`` and ``P + p`` are the
    chosen and the rejected answer of the same pair."""
    rows = batch["input_ids"].shape[0] // 2
    out = []
    for p in range(rows):
        chosen = tok.decode([t for t in batch["labels"][p].tolist() if t != IGNORE_INDEX])
        rejected = tok.decode([t for t in batch["labels"][rows + p].tolist() if t != IGNORE_INDEX])
        assert chosen.startswith(" yes ") and rejected.startswith(" no "), (chosen, rejected)
        number = chosen.split()[1].removesuffix("<|eos|>")
        assert rejected.split()[1].removesuffix("<|eos|>") == number
        out.append(int(number))
    return out


def test_pairs_stay_together_across_batches_ranks_and_resume(qs_tok, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", numbered_pairs(23))
    spec = {"train": path, "format": "preference", "max_seq_len": 64, "cache_dir": str(tmp_path / "cache")}

    def loaders(rank, world=2, fixed=False):
        return build_dataloaders(spec, qs_tok, micro_batch_size=3, dp_rank=rank, dp_world=world, seed=7,
                                 fixed_shape=fixed)

    ranks = [loaders(0), loaders(1)]
    assert ranks[0].train.batches_per_epoch == 23 // 2 // 3 == 3
    epoch = [[pair_ids(b, qs_tok) for b, _ in zip(iter(r.train), range(3), strict=False)] for r in ranks]
    seen = [p for rank in epoch for batch in rank for p in batch]
    assert len(seen) == len(set(seen)) == 18 and all(len(b) == 3 for rank in epoch for b in rank)
    # into the next epoch and resumed: the same micro-batches
    it = iter(loaders(0).train)
    first = [pair_ids(next(it), qs_tok) for _ in range(4)]
    state = ranks[0].train.state_dict()
    rest = [pair_ids(next(it), qs_tok) for _ in range(3)]
    resumed = loaders(0)
    resumed.train.load_state_dict(state)
    again = iter(resumed.train)
    assert [pair_ids(next(again), qs_tok) for _ in range(3)] == rest and first[:3] == epoch[0]
    # one process with 6 pairs per micro-batch sees the same global order (pairs, not rows, shuffled)
    single = build_dataloaders(spec, qs_tok, micro_batch_size=6, seed=7)
    one = pair_ids(next(iter(single.train)), qs_tok)
    assert sorted(one) == sorted(epoch[0][0] + epoch[1][0])
    fixed = next(iter(loaders(0, fixed=True).train))
    assert fixed["input_ids"].shape == (6, 64) and "segment_ids" not in fixed


def test_eval_one_pass_same_batches_per_rank(qs_tok, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", numbered_pairs(7))
    spec = {"train": path, "eval": path, "format": "preference", "max_seq_len": 32, "cache_dir": str(tmp_path)}
    ranks = [build_dataloaders(spec, qs_tok, micro_batch_size=2, dp_rank=r, dp_world=3) for r in range(3)]
    assert {len(r.eval) for r in ranks} == {2}
    seen = []
    for r in ranks:
        for batch in r.eval:
            real = [p for p in range(batch["input_ids"].shape[0] // 2) if (batch["labels"][p] != IGNORE_INDEX).any()]
            padding = [p for p in range(batch["input_ids"].shape[0] // 2) if p not in real]
            for p in padding:  # an all-padding pair: no target in either row
                assert (batch["labels"][[p, p + batch["input_ids"].shape[0] // 2]] == IGNORE_INDEX).all()
            seen += [pair_ids({k: v[[*real, *(x + len(batch["labels"]) // 2 for x in real)]]
                               for k, v in batch.items()}, qs_tok)]
    assert sorted(p for b in seen for p in b) == list(range(7))


def test_ref_logps_stored_with_the_data_and_reused(qs_tok, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", numbered_pairs(9))
    spec = {"train": path, "eval": path, "format": "preference", "max_seq_len": 32, "cache_dir": str(tmp_path)}
    key = ref_logps_key({"base_weights": "abc", "init_from": None, "dtype": "fp32"})
    # the reference pass: each of 2 dp ranks computes its pairs' rows; a row's log-prob here is
    # minus its sample number (2 * pair + 0 chosen / 1 rejected), so the placement is checked
    computed = {}
    for split in ("train", "eval"):
        ids, logps = [], []
        for rank in range(2):
            loaders = build_dataloaders(spec, qs_tok, micro_batch_size=2, dp_rank=rank, dp_world=2)
            for pair_index, batch in loaders.pairs[split].reference_batches():
                numbers = torch.tensor(pair_ids(batch, qs_tok) if (pair_index >= 0).all() else
                                       [int(i) for i in pair_index])
                assert torch.equal(numbers[pair_index >= 0], pair_index[pair_index >= 0])
                ids.append(pair_index)
                logps.append(-torch.cat([2.0 * pair_index, 2.0 * pair_index + 1]))
        computed[split] = assemble_ref_logps(9, ids, logps)
    assert torch.equal(computed["train"], -torch.arange(18.0))
    first = build_dataloaders(spec, qs_tok, micro_batch_size=2, seed=3)
    assert not first.load_ref_logps(key)
    first.save_ref_logps(key, computed, {"base_weights": "abc"})
    assert (cache_entry(spec, qs_tok) / f"ref-{key}" / "ref_logps.safetensors").is_file()
    # a resumed run finds them; every micro-batch carries its rows' values in row order
    again = build_dataloaders(spec, qs_tok, micro_batch_size=2, seed=3)
    assert again.load_ref_logps(key) and not again.load_ref_logps(ref_logps_key({"base_weights": "other"}))
    for batch in [next(iter(again.train)), *again.eval]:
        numbers = pair_ids(batch, qs_tok)
        expected = [-2.0 * n for n in numbers] + [-2.0 * n - 1 for n in numbers]
        assert batch["ref_logps"].dtype == torch.float32 and batch["ref_logps"].tolist() == expected
    with pytest.raises(DataError, match="pair 8 was not computed"):
        assemble_ref_logps(9, [torch.arange(8)], [torch.zeros(16)])
    with pytest.raises(DataError, match="NaN"):
        again.attach_ref_logps({"train": torch.full((18,), float("nan"))})


def test_tokenizing_settings_change_the_cache_key(qs_tok, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", numbered_pairs(3))
    base = {"train": path, "format": "preference", "cache_dir": str(tmp_path)}
    entries = {cache_entry(base | extra, qs_tok) for extra in
               ({}, {"truncation_mode": "keep_end"}, {"max_prompt_length": 4}, {"trl_tokenization": "orpo"},
                {"packing": False})}
    assert len(entries) == 4  # packing does not change pairs


@pytest.mark.parametrize("row, message", [
    ({"prompt": "Q?", "chosen": " a", "rejected": " a"}, "data.train row 2: chosen and rejected are the same"),
    ({"prompt": "Q?", "chosen": " a", "rejected": None}, "data.train row 2: no 'rejected'"),
    ({"prompt": "Q?", "chosen": "  ", "rejected": " b"}, "data.train row 2: the chosen completion is empty"),
    ({"chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}],
      "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "b"}]},
     "data.train row 2: the chosen completion is empty"),
    ({"prompt": "Q?", "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "data.train row 2: mix of strings (prompt)"),
])
def test_bad_rows_one_line(qs_tok, tmp_path, row, message):
    good = {"prompt": "Q?", "chosen": " a", "rejected": " b"}
    if isinstance(row["chosen"], list) and "prompt" not in row:
        good = {"chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "b"}]}
    rows = [good, row]
    spec = DataSpec.of({"train": "x", "format": "preference"})
    with pytest.raises(DataError) as got:
        tokenize_rows(rows, spec, qs_tok, split="data.train")
    assert str(got.value).startswith(message) and "\n" not in str(got.value)
    # validate reads the same rows and says the same
    recipe = SimpleNamespace(data=SimpleNamespace(format="preference", fields={}, cache_dir=None))
    with pytest.raises(DataError) as checked:
        check_data(recipe, "train", write_jsonl(tmp_path / "bad.jsonl", rows))
    assert message.split(": ", 1)[1] in str(checked.value) and "row 2" in str(checked.value)


def test_fields_map_columns_and_message_keys(qs_tok, tmp_path):
    rows = [{"q": [{"from": "human", "value": "What is two plus two?"}], "good": [{"from": "gpt", "value": "4"}],
             "bad": [{"from": "gpt", "value": "5"}]}]
    batch, _ = our_batch(rows, qs_tok, tmp_path, max_seq_len=64, fields={
        "prompt": "q", "chosen": "good", "rejected": "bad", "role": "from", "content": "value"})
    expected, _ = our_batch([{"prompt": [{"role": "user", "content": "What is two plus two?"}],
                              "chosen": [{"role": "assistant", "content": "4"}],
                              "rejected": [{"role": "assistant", "content": "5"}]}], qs_tok, tmp_path / "b",
                            max_seq_len=64)
    assert torch.equal(batch["input_ids"], expected["input_ids"])
    with pytest.raises(DataError, match="data.fields.prompt names column 'question'"):
        our_batch(rows, qs_tok, tmp_path / "c", fields={"prompt": "question", "chosen": "good", "rejected": "bad"})


def test_recipe_refuses_train_on_prompt_for_pairs(tmp_path):
    from nxd_finetune.errors import RecipeError
    from nxd_finetune.recipe import recipe_from_dict

    recipe = {"model": {"path": "builtin:tiny-llama"}, "objective": "dpo",
              "data": {"train": "pairs.jsonl", "format": "preference", "train_on_prompt": True}}
    with pytest.raises(RecipeError, match="data.train_on_prompt does not apply to format preference") as got:
        recipe_from_dict(recipe)
    assert "\n" not in str(got.value)
    assert recipe_from_dict(recipe | {"data": recipe["data"] | {"train_on_prompt": False}}).data.format == "preference"


def test_worker_processes_give_the_same_pairs_and_name_the_bad_row(qs_tok):
    rows = numbered_pairs(40)
    one = tokenize_rows(rows, DataSpec.of({"format": "preference", "num_proc": 1}), qs_tok)
    two = tokenize_rows(rows, DataSpec.of({"format": "preference", "num_proc": 2}), qs_tok)
    assert torch.equal(one.input_ids, two.input_ids) and torch.equal(one.labels, two.labels)
    assert one.stats == two.stats and one.stats["pairs"] == 40
    rows[33] = rows[33] | {"rejected": rows[33]["chosen"]}
    with pytest.raises(DataError, match="^data.train row 34: chosen and rejected are the same$"):
        tokenize_rows(rows, DataSpec.of({"format": "preference", "num_proc": 2}), qs_tok, split="data.train")

"""``data.train: s3://...`` through a real S3 API (the moto server of ``tests/s3_server.py``): fetched
once into the data cache, checked by sha256, the same samples as the local file, one-line errors."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import torch

from nxd_finetune.cli import main
from nxd_finetune.data.datasets import DataSpec, prepare_datasets
from nxd_finetune.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
TRAIN = ROOT / "nxd_finetune" / "assets" / "quickstart" / "train.jsonl"


@pytest.fixture(scope="module")
def s3(moto_s3):
    return boto3.session.Session().client("s3", endpoint_url=moto_s3, region_name="us-east-1")


@pytest.fixture(scope="module")
def tokenizer(quickstart_cache):
    from transformers import AutoTokenizer

    from nxd_finetune.quickstart import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


def spec(train: str, cache: Path) -> DataSpec:
    return DataSpec.of({"train": train, "format": "messages", "max_seq_len": 128, "cache_dir": str(cache)})


def fetched(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "s3").rglob("*") if p.is_file() and not p.name.endswith(".sha256"))


def test_s3_train_file_is_fetched_once_and_gives_the_local_samples(s3, tokenizer, tmp_path):
    s3.put_object(Bucket="nxd-test", Key="data/train.jsonl", Body=TRAIN.read_bytes())
    local, _ = prepare_datasets(spec(str(TRAIN), tmp_path / "local"), tokenizer)
    remote, _ = prepare_datasets(spec("s3://nxd-test/data/train.jsonl", tmp_path / "c"), tokenizer)
    assert len(remote) == len(local) and torch.equal(remote.input_ids, local.input_ids)
    (copy,) = fetched(tmp_path / "c")
    digest = hashlib.sha256(TRAIN.read_bytes()).hexdigest()
    assert copy.read_bytes() == TRAIN.read_bytes()
    assert copy.with_name("train.jsonl.sha256").read_text().split()[0] == digest
    stamp = copy.stat().st_mtime_ns
    prepare_datasets(spec("s3://nxd-test/data/train.jsonl", tmp_path / "c"), tokenizer, use_cache=False)
    assert copy.stat().st_mtime_ns == stamp  # not fetched again
    with open(copy, "r+b") as f:  # a damaged copy: fetched again
        f.truncate(100)
    prepare_datasets(spec("s3://nxd-test/data/train.jsonl", tmp_path / "c"), tokenizer, use_cache=False)
    assert copy.read_bytes() == TRAIN.read_bytes()
    # the object replaced: a new entry with the new bytes
    s3.put_object(Bucket="nxd-test", Key="data/train.jsonl", Body=b"".join(TRAIN.read_bytes().splitlines(True)[:50]))
    changed, _ = prepare_datasets(spec("s3://nxd-test/data/train.jsonl", tmp_path / "c"), tokenizer)
    assert len(fetched(tmp_path / "c")) == 2 and len(changed) < len(local)


def test_a_sha256_the_bytes_do_not_match_is_refused(s3, tokenizer, tmp_path):
    data = TRAIN.read_bytes()
    s3.put_object(Bucket="nxd-test", Key="data/signed.jsonl", Body=data,
                  Metadata={"sha256": hashlib.sha256(data).hexdigest()})
    prepare_datasets(spec("s3://nxd-test/data/signed.jsonl", tmp_path), tokenizer)
    wrong = hashlib.sha256(b"other bytes").hexdigest()
    s3.put_object(Bucket="nxd-test", Key="data/bad.jsonl", Body=data, Metadata={"sha256": wrong})
    with pytest.raises(DataError) as e:
        prepare_datasets(spec("s3://nxd-test/data/bad.jsonl", tmp_path), tokenizer)
    assert str(e.value) == (f"s3://nxd-test/data/bad.jsonl: the fetched bytes have sha256 "
                            f"{hashlib.sha256(data).hexdigest()}, the object says {wrong}")
    assert [p.name for p in fetched(tmp_path)] == ["signed.jsonl"]  # nothing of the bad one kept


def test_s3_data_errors_are_one_line(s3, quickstart_cache, tmp_path, capsys):
    for source, message in (("s3://nxd-test/data/missing.jsonl", "data file not found: s3://nxd-test/data/missing.jsonl"),
                            ("s3://nxd-test", "data source 's3://nxd-test': name an object, s3://BUCKET/KEY")):
        with pytest.raises(SystemExit) as e:
            main(["validate", str(QUICKSTART), f"data.train={source}", f"data.cache_dir={tmp_path}"])
        assert e.value.code == 2
        assert capsys.readouterr().err == f"error: {message}\n"


def test_a_damaged_sha256_record_is_a_missing_one(s3, tmp_path):
    """An empty or non-UTF-8 ``.sha256`` record means the copy is not known complete: fetched again,
    no traceback."""
    from nxd_finetune.storage.fetch import fetch_object

    s3.put_object(Bucket="nxd-test", Key="data/rec.jsonl", Body=TRAIN.read_bytes())
    uri = "s3://nxd-test/data/rec.jsonl"
    copy = fetch_object(uri, tmp_path)
    record = copy.with_name("rec.jsonl.sha256")
    for damaged in (b"", b"\xff\xfe\x00 not utf-8"):
        record.write_bytes(damaged)
        stamp = copy.stat().st_mtime_ns
        assert fetch_object(uri, tmp_path) == copy and copy.read_bytes() == TRAIN.read_bytes()
        assert copy.stat().st_mtime_ns != stamp  # fetched again
        assert record.read_text().split()[0] == hashlib.sha256(TRAIN.read_bytes()).hexdigest()


def _fetch_stopped_midway(uri: str, cache: Path, sig: signal.Signals) -> subprocess.Popen:
    """A real fetch of ``uri`` in another process, sent ``sig`` once its download has bytes on disk."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from nxd_finetune.storage.fetch import fetch_object; "
                             "fetch_object(sys.argv[1], sys.argv[2])", uri, str(cache)])
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if any(p.stat().st_size for p in (cache / "s3").glob("*/.big.jsonl.*part*")):
            proc.send_signal(sig)
            return proc
        time.sleep(0.002)
    proc.kill()
    raise AssertionError(f"the fetch ended (rc {proc.returncode}) before it could be stopped midway")


def test_a_killed_fetch_is_cleaned_by_the_next_and_a_live_one_is_left_to_finish(s3, tmp_path):
    """A fetch killed (SIGKILL) mid-download leaves its temporary files: the next fetch of the object
    removes them. A fetch that is alive (here: stopped, SIGSTOP) keeps its files while another fetch
    runs beside it, and completes when it goes on."""
    from nxd_finetune.storage.fetch import fetch_object

    body = os.urandom(64 << 20)
    s3.put_object(Bucket="nxd-test", Key="data/big.jsonl", Body=body)
    uri = "s3://nxd-test/data/big.jsonl"
    killed = _fetch_stopped_midway(uri, tmp_path, signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    (entry,) = (tmp_path / "s3").iterdir()
    assert [p for p in entry.iterdir() if "part" in p.name]  # what the dead fetch left
    copy = fetch_object(uri, tmp_path)
    assert sorted(p.name for p in entry.iterdir()) == ["big.jsonl", "big.jsonl.sha256"]

    copy.with_name("big.jsonl.sha256").write_bytes(b"")  # fetched again by the next two
    live = _fetch_stopped_midway(uri, tmp_path, signal.SIGSTOP)
    try:
        theirs = [p for p in entry.iterdir() if "part" in p.name]
        assert theirs and fetch_object(uri, tmp_path) == copy and copy.read_bytes() == body
        assert all(p.exists() for p in theirs)  # a live fetch's files are its own
    finally:
        live.send_signal(signal.SIGCONT)
    assert live.wait(timeout=120) == 0 and copy.read_bytes() == body
    assert sorted(p.name for p in entry.iterdir()) == ["big.jsonl", "big.jsonl.sha256"]


def test_a_full_disk_while_fetching_is_one_line_and_leaves_nothing(s3, full_disk):
    from nxd_finetune.storage.fetch import fetch_object

    s3.put_object(Bucket="nxd-test", Key="data/big.jsonl", Body=b"x" * (2 << 20))
    with pytest.raises(DataError) as e:
        fetch_object("s3://nxd-test/data/big.jsonl", full_disk / "cache")
    assert str(e.value).startswith("s3://nxd-test/data/big.jsonl: no space left on the device to fetch it into ")
    assert "\n" not in str(e.value)
    assert list((full_disk / "cache").rglob("*")) == []

"""``data.train: s3://...`` through a real S3 API (the moto server of ``tests/s3_server.py``): fetched
once into the data cache, checked by sha256, the same samples as the local file, one-line errors."""

from __future__ import annotations

import hashlib
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


def test_a_damaged_sha256_record_is_a_missing_one_and_dead_fetches_are_cleaned(s3, tmp_path):
    """An empty or non-UTF-8 ``.sha256`` record means the copy is not known complete: fetched again,
    no traceback. A ``.part`` (and a record being written) that a killed fetch left is removed by the
    next fetch; a live fetch's is not."""
    import subprocess
    import sys

    from nxd_finetune.storage.fetch import fetch_s3

    s3.put_object(Bucket="nxd-test", Key="data/rec.jsonl", Body=TRAIN.read_bytes())
    uri = "s3://nxd-test/data/rec.jsonl"
    copy = fetch_s3(uri, tmp_path)
    record = copy.with_name("rec.jsonl.sha256")
    for damaged in (b"", b"\xff\xfe\x00 not utf-8"):
        record.write_bytes(damaged)
        stamp = copy.stat().st_mtime_ns
        assert fetch_s3(uri, tmp_path) == copy and copy.read_bytes() == TRAIN.read_bytes()
        assert copy.stat().st_mtime_ns != stamp  # fetched again
        assert record.read_text().split()[0] == hashlib.sha256(TRAIN.read_bytes()).hexdigest()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has exited
    left = [copy.parent / f".rec.jsonl.{pid}.part", copy.parent / f".rec.jsonl.{pid}.sha256"]
    live = copy.parent / f".rec.jsonl.{1}.part"  # pid 1 runs
    for p in (*left, live):
        p.write_bytes(b"x" * 1000)
    fetch_s3(uri, tmp_path)
    assert not any(p.exists() for p in left) and live.exists()


def test_a_full_disk_while_fetching_is_one_line_and_leaves_nothing(s3, full_disk):
    from nxd_finetune.storage.fetch import fetch_s3

    s3.put_object(Bucket="nxd-test", Key="data/big.jsonl", Body=b"x" * (2 << 20))
    with pytest.raises(DataError) as e:
        fetch_s3("s3://nxd-test/data/big.jsonl", full_disk / "cache")
    assert str(e.value).startswith("s3://nxd-test/data/big.jsonl: no space left on the device to fetch it into ")
    assert "\n" not in str(e.value)
    assert list((full_disk / "cache").rglob("*")) in ([], [full_disk / "cache" / "s3"])

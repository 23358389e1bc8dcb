"""The scheme registry (``storage/schemes.py``): a scheme defined here, in the test (``mem://``, an
in-memory object store), registered with one call, carries registry push / pull and a data file
fetch (``run``'s data loading and ``validate``) with no other change anywhere."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch

from nxd_finetune.cli import main
from nxd_finetune.data.datasets import DataSpec, prepare_datasets
from nxd_finetune.registry import open_registry, pull, push, show
from nxd_finetune.storage import Scheme, Storage, StorageError, StorageNotFoundError, open_storage, register_scheme
from nxd_finetune.storage.base import Keys, ObjectHead, Progress
from nxd_finetune.storage.schemes import SCHEMES
from tests.registry_helpers import make_adapter, same_files

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
TRAIN = ROOT / "nxd_finetune" / "assets" / "quickstart" / "train.jsonl"

_OBJECTS: dict[str, bytes] = {}  # "bucket/path/key" -> bytes: what every mem:// storage sees
_LOCK = threading.Lock()


class MemStorage(Storage):
    """``mem://BUCKET[/PREFIX]``: objects in this process's memory."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")
        self.root = self.uri.removeprefix("mem://") + "/"

    @classmethod
    def open(cls, uri: str, /, **options: object) -> MemStorage:
        if options:
            raise StorageError(f"mem storage takes no options, got {sorted(options)}")
        return cls(uri)

    def put_file(self, local: str | os.PathLike, key: str, progress: Progress | None = None) -> None:
        self.put_bytes(key, Path(local).read_bytes())

    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False) -> bool:
        with _LOCK:
            if if_none_match and self.root + key in _OBJECTS:
                return False
            _OBJECTS[self.root + key] = data
            return True

    def get_bytes(self, key: str) -> bytes:
        try:
            return _OBJECTS[self.root + key]
        except KeyError:
            raise StorageNotFoundError(f"{self.uri}/{key} does not exist") from None

    def get_file(self, key: str, local: str | os.PathLike) -> None:
        Path(local).write_bytes(self.get_bytes(key))

    def head(self, key: str) -> ObjectHead:
        data = self.get_bytes(key)
        digest = hashlib.sha256(data).hexdigest()
        return ObjectHead(size=len(data), etag=digest[:32], sha256=digest)

    def exists(self, key: str) -> bool:
        return self.root + key in _OBJECTS

    def list(self, prefix: str = "") -> Keys:
        with _LOCK:
            return sorted(k[len(self.root):] for k in _OBJECTS if k.startswith(self.root + prefix))

    def list_dirs(self, prefix: str = "") -> Keys:
        return sorted({k[len(prefix):].split("/", 1)[0] for k in self.list(prefix) if "/" in k[len(prefix):]})

    def delete(self, key: str) -> None:
        with _LOCK:
            _OBJECTS.pop(self.root + key, None)


@pytest.fixture
def mem_scheme():
    register_scheme(Scheme("mem", MemStorage.open, data=True))
    try:
        yield
    finally:
        SCHEMES.pop("mem")
        _OBJECTS.clear()


def test_registry_push_and_pull_through_a_registered_scheme(mem_scheme, tmp_path):
    a, b = make_adapter(tmp_path / "a", seed=1), make_adapter(tmp_path / "b", seed=2)
    assert push(a, "mem://team/reg/bot", tags=["prod"]).version == 1
    assert push(b, "mem://team/reg/bot").version == 2
    assert isinstance(open_storage("mem://team/reg"), MemStorage)
    assert open_registry("mem://team/reg").list_names() == ["bot"]
    assert show("mem://team/reg/bot@prod").version == 1
    pull("mem://team/reg/bot:1", tmp_path / "one")
    pull("mem://team/reg/bot", tmp_path / "latest")
    assert same_files(a, tmp_path / "one") and same_files(b, tmp_path / "latest")
    assert any(k.startswith("team/reg/bot/2/") for k in _OBJECTS)  # stored there, nowhere else


def test_a_data_file_on_a_registered_scheme_is_fetched_for_run_and_validate(mem_scheme, quickstart_cache,
                                                                            tmp_path, capsys):
    from transformers import AutoTokenizer

    from nxd_finetune.quickstart import ensure_tiny_model

    open_storage("mem://team/data").put_bytes("train.jsonl", TRAIN.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())

    def spec(train: str, cache: Path) -> DataSpec:
        return DataSpec.of({"train": train, "format": "messages", "max_seq_len": 128, "cache_dir": str(cache)})

    local, _ = prepare_datasets(spec(str(TRAIN), tmp_path / "local"), tokenizer)
    remote, _ = prepare_datasets(spec("mem://team/data/train.jsonl", tmp_path / "c"), tokenizer)
    assert len(remote) == len(local) and torch.equal(remote.input_ids, local.input_ids)
    (copy,) = (p for p in (tmp_path / "c" / "mem").rglob("train.jsonl") if p.is_file())
    assert copy.read_bytes() == TRAIN.read_bytes()

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["validate", str(QUICKSTART), "data.train=mem://team/data/train.jsonl",
              f"data.cache_dir={tmp_path / 'v'}"])
    out = capsys.readouterr()
    assert e.value.code == 0, out.err
    assert "recipe is valid" in out.out
    assert [p.name for p in (tmp_path / "v" / "mem").rglob("train.jsonl")] == ["train.jsonl"]


def test_an_unregistered_scheme_is_one_line_naming_the_registered_ones(mem_scheme):
    with pytest.raises(StorageError, match=r"unsupported storage URI scheme 'gs' in 'gs://b/x' "
                                           r"\(use a local path, file://, s3:// or mem://\)"):
        open_storage("gs://b/x")
    with pytest.raises(ValueError, match="already registered"):
        register_scheme(Scheme("s3", MemStorage.open))

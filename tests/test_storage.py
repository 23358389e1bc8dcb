"""storage/: the atomic-directory helper and the cache paths (the backends are tested through the
registry in tests/test_registry.py, against a real moto S3 server)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from nxd_finetune.storage.atomic import publish_dir
from nxd_finetune.storage.cache import cache_home, data_cache, models_cache

REPO = Path(__file__).resolve().parents[1]


def test_publish_dir_complete_or_absent(tmp_path):
    dest = tmp_path / "a" / "out"
    with publish_dir(dest) as tmp:
        assert tmp.parent == dest.parent and tmp.name.startswith(".out.partial-") and not dest.exists()
        (tmp / "f.txt").write_text("x")
    assert (dest / "f.txt").read_text() == "x" and stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert sorted(p.name for p in dest.parent.iterdir()) == ["out"]  # no temp left

    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="boom"), publish_dir(failed) as tmp:
        (tmp / "half").write_text("y")
        raise RuntimeError("boom")
    assert not failed.exists() and not list(tmp_path.glob(".failed.partial-*"))

    empty = tmp_path / "empty"
    empty.mkdir()
    with publish_dir(empty) as tmp:
        (tmp / "f").write_text("z")
    assert (empty / "f").read_text() == "z"


def test_publish_dir_lost_race(tmp_path):
    dest = tmp_path / "entry"
    with pytest.raises(OSError), publish_dir(dest) as tmp:  # someone published first: an error...
        (tmp / "mine").write_text("1")
        dest.mkdir()
        (dest / "theirs").write_text("2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"] and (dest / "theirs").is_file()

    with publish_dir(dest, already_published=lambda d: (d / "theirs").is_file()) as tmp:  # ...unless it is complete
        (tmp / "mine").write_text("1")
    assert sorted(p.name for p in dest.iterdir()) == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_cache_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("NXD_FINETUNE_CACHE", str(tmp_path / "c"))
    assert cache_home() == tmp_path / "c"
    assert models_cache() == tmp_path / "c" / "models" and data_cache() == tmp_path / "c" / "data"
    assert cache_home(tmp_path / "o") == tmp_path / "o" and models_cache(tmp_path / "o") == tmp_path / "o" / "models"
    monkeypatch.delenv("NXD_FINETUNE_CACHE")
    assert cache_home() == Path.home() / ".cache" / "nxd-finetune"


def test_storage_imports_no_upper_layer_nor_boto3():
    code = ("import sys, nxd_finetune.storage, nxd_finetune.storage.atomic, nxd_finetune.storage.cache; "
            "print(sorted(m for m in sys.modules if m == 'boto3' or m.startswith(('nxd_finetune.registry', "
            "'nxd_finetune.checkpoint', 'nxd_finetune.sft'))))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env=env)
    assert out.stdout.strip() == "[]"

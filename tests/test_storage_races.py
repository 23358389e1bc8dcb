"""Local storage under concurrent writers: a write into a directory that a concurrent delete prunes
(it emptied it) still lands, and a push's sweep of dead writers' temp files leaves a live writer's
alone. Real second writers (processes, a staged write), no mocks."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from nxd_finetune.registry import open_registry, pull, push
from nxd_finetune.storage import LocalStorage, StorageError
from tests.registry_helpers import make_adapter, same_files

_ROUNDS = 1000


def _write_and_delete(root: str, key: str, how: str, queue: mp.Queue) -> None:
    """Write ``key`` then delete it (which prunes its emptied directory), ``_ROUNDS`` times; put the
    errors met (their messages) on ``queue``."""
    storage = LocalStorage(root)
    src = Path(root).parent / f"src-{how}"
    src.write_bytes(b"payload")
    errors = []
    for i in range(_ROUNDS):
        try:
            if how == "create":
                storage.put_bytes(key, b"x", if_none_match=True)
            elif i % 2:
                storage.put_file(src, key)
            else:
                with storage.staged(key) as tmp:
                    tmp.write_bytes(b"staged")
            storage.delete(key)
        except StorageError as e:
            errors.append(str(e))
    queue.put(errors)


def test_writes_land_while_a_concurrent_delete_prunes_their_directory(tmp_path):
    """Two pushes' claims in one version directory: one deletes its claim (pruning ``bot/1/`` and
    ``bot/`` as they empty) while the other is between making the directory and writing its temp
    file there. Reported as ``cannot write .../bot/1/.nxdtmp-...-.claim-1.json: No such file``."""
    root = tmp_path / "reg"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    writers = [
        ctx.Process(target=_write_and_delete, args=(str(root), "bot/1/.claim-1.json", "create", queue)),
        ctx.Process(target=_write_and_delete, args=(str(root), "bot/1/.claim-2.json", "create", queue)),
        ctx.Process(target=_write_and_delete, args=(str(root), "bot/1/adapter_config.json", "put", queue)),
    ]
    for w in writers:
        w.start()
    errors = [e for _ in writers for e in queue.get(timeout=300)]
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert errors == [], f"{len(errors)} failed writes, the first: {errors[0]}"
    assert LocalStorage(root).list() == [] and not (root / "bot").exists()  # pruned once all are gone


def test_a_push_leaves_a_concurrent_writers_temp_file_alone(tmp_path):
    """A push sweeps the temp files of a dead push it took over from its version directory; a
    live writer's (here: another push mid-way through writing its claim there) is not one of them."""
    reg_uri = str(tmp_path / "reg")
    storage = open_registry(reg_uri).storage
    src = make_adapter(tmp_path / "a")
    with storage.staged("bot/1/.claim-1.json") as tmp:
        tmp.write_bytes(b"{}")
        v = push(src, f"{reg_uri}/bot")
        assert v.version == 1
        assert tmp.exists(), "the push removed a live writer's temp file"
    pull(v.ref, tmp_path / "back")
    assert same_files(src, tmp_path / "back")

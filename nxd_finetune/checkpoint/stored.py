"""A training checkpoint as stored: :class:`CheckpointRef` (its files, checked against the
manifest, downloaded from S3 when needed), the tensor reader that loading uses, and the listing,
deletion and retention of the step directories under a storage root (layout:
:mod:`nxd_finetune.checkpoint.format`)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import warnings
import weakref

import torch
from safetensors import safe_open

from nxd_finetune.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    CheckpointWarning,
    FileEntry,
    Manifest,
    bytes_entry,
    file_entry,
    parse_step_dir,
    step_dir,
)
from nxd_finetune.storage import LocalStorage, Storage, StorageError


@dataclasses.dataclass
class CheckpointRef:
    """One complete checkpoint: ``uri`` of its directory, its ``step`` and parsed ``manifest``.

    Its files are ``storage``'s keys under ``prefix`` (the step directory; empty when ``storage``
    is rooted at the checkpoint itself). S3 files fetched for verification or loading are kept in a
    temporary directory until :meth:`cleanup` (``load`` calls it)."""

    uri: str
    step: int
    manifest: Manifest
    storage: Storage
    prefix: str = ""
    _tmp: str | None = None
    _local: dict[str, str] = dataclasses.field(default_factory=dict)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def local_path(self, name: str, verify: bool) -> str:
        """A local path holding file ``name`` (downloaded from S3 once; checked when ``verify``)."""
        if isinstance(self.storage, LocalStorage):
            path = str(self.storage.root / self.key(name))
            if verify:
                self._check(name, file_entry(path) if os.path.isfile(path) else None)
            return path
        if name not in self._local:
            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="nxd-ckpt-")
                weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)  # if load() never runs
            path = os.path.join(self._tmp, name)
            self.storage.get_file(self.key(name), path)
            self._check(name, file_entry(path))  # downloaded anyway: always checked
            self._local[name] = path
        return self._local[name]

    def read_bytes(self, name: str) -> bytes:
        """The content of a small file, checked against the manifest."""
        with open(self.local_path(name, verify=False), "rb") as f:
            data = f.read()
        self._check(name, bytes_entry(data))
        return data

    def _check(self, name: str, got: FileEntry | None) -> None:
        want = self.manifest["files"].get(name)
        if want is None:
            raise CheckpointError(f"{self.uri}: {name} is not in the manifest")
        if got is None:
            raise CheckpointError(f"{self.uri}/{name} is missing")
        if got["size"] != want["size"]:
            raise CheckpointError(f"{self.uri}/{name} has {got['size']} bytes, the manifest says {want['size']} "
                                  "(truncated or rewritten)")
        if got["sha256"] != want["sha256"]:
            raise CheckpointError(f"{self.uri}/{name}: sha256 differs from the manifest (altered or corrupt)")

    def verify(self) -> None:
        """Check every file of the manifest (size, then sha256); CheckpointError on the first bad one."""
        for name in self.manifest["files"]:
            self.local_path(name, verify=True)

    def cleanup(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp, self._local = None, {}


class CheckpointReader:
    """:class:`.state.TensorReader` over a checkpoint's safetensors files (opened lazily)."""

    def __init__(self, ref: CheckpointRef, verify: bool) -> None:
        self.ref, self.verify = ref, verify
        self.index: dict[str, str] = ref.manifest["tensors"]
        self.keys = set(self.index)
        self._open: dict[str, safe_open] = {}

    def _file(self, key: str) -> safe_open:
        name = self.index[key]
        if name not in self._open:
            self._open[name] = safe_open(self.ref.local_path(name, verify=self.verify), framework="pt")
        return self._open[name]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file(key).get_slice(key).get_shape())

    def read(self, key: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        f = self._file(key)
        return f.get_tensor(key) if index is None else f.get_slice(key)[index]

    def close(self) -> None:
        self._open.clear()


def list_checkpoints(storage: Storage) -> list[tuple[int, bool]]:
    """``(step, complete)`` of every step directory under ``storage``, oldest first."""
    out = []
    for name in storage.list_dirs(""):
        step = parse_step_dir(name)
        if step is not None:
            out.append((step, storage.exists(f"{name}/{MANIFEST}")))
    return sorted(out)


def delete_checkpoint(storage: Storage, step: int) -> None:
    """Remove a checkpoint, its manifest first (so it is never seen half-deleted as complete)."""
    name = step_dir(step)
    storage.delete(f"{name}/{MANIFEST}")
    storage.delete_prefix(f"{name}/")
    for item in storage.leftovers(f"{name}/"):  # unfinished uploads of a killed save (S3)
        storage.drop_leftover(item)


def retain(storage: Storage, keep_last: int) -> list[int]:
    """Keep the ``keep_last`` newest complete checkpoints; delete older complete ones and the
    incomplete ones older than the newest complete one (left by killed saves). Returns the
    deleted steps. Storage errors become a warning: pruning never fails a run."""
    entries = list_checkpoints(storage)
    complete = [s for s, ok in entries if ok]
    if not complete:
        return []
    doomed = complete[:-keep_last] + [s for s, ok in entries if not ok and s < complete[-1]]
    for step in sorted(doomed):
        try:
            delete_checkpoint(storage, step)
        except StorageError as e:
            warnings.warn(f"could not delete old checkpoint {step_dir(step)}: {e}", CheckpointWarning, stacklevel=2)
    try:  # temp files / unfinished uploads of killed saves of steps before the newest complete one
        for item in storage.leftovers(""):
            at = parse_step_dir(item.key.split("/", 1)[0])
            if at is not None and at < complete[-1]:
                storage.drop_leftover(item)
    except StorageError as e:
        warnings.warn(f"could not remove leftovers of killed saves: {e}", CheckpointWarning, stacklevel=2)
    return sorted(doomed)

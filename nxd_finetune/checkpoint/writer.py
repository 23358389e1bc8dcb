"""The storage half of one checkpoint save on one rank (:class:`SaveJob`: stage file, sidecar, and
on global rank 0 ``extra``, the manifest last, then retention; no collectives, so it may run in a
background thread), and the fault-injection points of the kill-and-resume tests."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from nxd_finetune.checkpoint.format import (
    EXTRA_JSON,
    EXTRA_TENSORS,
    MANIFEST,
    CheckpointError,
    FileEntry,
    bytes_entry,
    dumps,
    file_entry,
    make_manifest,
    sidecar_file,
    state_file,
)
from nxd_finetune.checkpoint.state import SavedGroup, StageTensors
from nxd_finetune.checkpoint.stored import retain
from nxd_finetune.jsontypes import JsonObject
from nxd_finetune.safetensors_io import header_bytes, write_tensor
from nxd_finetune.storage import Storage

SIDECAR_TIMEOUT_S = 1800.0
FAILPOINT_ENV = "NXD_FINETUNE_FAILPOINT"


def failpoint(point: str, step: int) -> None:
    """SIGKILL this process when ``NXD_FINETUNE_FAILPOINT`` names ``point`` at ``step`` (fault
    injection for the kill-and-resume tests; see :mod:`.training`).

    The variable is a comma-separated list of ``<point>:<step>[:rank=<r>][:attempt=<n>]``: with
    ``rank`` only that global rank (``RANK``) is killed, with ``attempt`` only in that attempt of an
    elastic run (``TORCHELASTIC_RESTART_COUNT``: 0 the first, 1 after one restart, ...)."""
    spec = os.environ.get(FAILPOINT_ENV)
    if spec and any(_failpoint_matches(entry, point, step) for entry in spec.split(",")):
        os.kill(os.getpid(), signal.SIGKILL)


def _failpoint_matches(entry: str, point: str, step: int) -> bool:
    name, _, rest = entry.strip().partition(":")
    at, *conds = rest.split(":")
    if name != point or at != str(step):
        return False
    now = {"rank": os.environ.get("RANK", "0"), "attempt": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}
    return all(now.get(key) == value for key, _, value in (c.partition("=") for c in conds))


@dataclasses.dataclass
class SaveJob:
    """The storage half of one save on one rank (no collectives: it may run in a thread)."""

    storage: Storage
    name: str
    step: int
    save_id: str
    pp_rank: int
    n_stages: int
    tensors: dict[str, torch.Tensor] | None  # None: this rank writes no stage file (or streams it)
    groups: list[SavedGroup]
    finalize: bool  # global rank 0: extra + manifest + retention
    extra: tuple[JsonObject, dict[str, torch.Tensor]] | None
    layout: JsonObject
    keep_last: int
    stream: StageTensors | None = None  # a synchronous save's stage, gathered while it is written

    def run(self) -> None:
        if self.tensors is not None or self.stream is not None:
            self._write_stage()
        if self.finalize:
            failpoint("before-manifest", self.step)
            self._write_manifest()
            retain(self.storage, self.keep_last)

    def _write_stage(self) -> None:
        streamed = self.stream.tensors(copy=False) if self.stream is not None else None
        # local: written beside its final name and renamed; remote: staged in nxd-finetune's cache
        try:
            with self.storage.staged(f"{self.name}/{state_file(self.pp_rank)}") as tmp:
                if self.stream is not None and streamed is not None:  # (both: for the type checker)
                    keys = write_streamed(str(tmp), self.stream.plan(), streamed)
                else:
                    assert self.tensors is not None  # freed only after this write
                    save_file(self.tensors, str(tmp))
                    keys = list(self.tensors)
                entry = file_entry(str(tmp))
                failpoint("stage-written", self.step)  # killed with the file not yet at its name
        except Exception:
            if streamed is not None:  # the other TP ranks are still gathering: take part to the end
                with contextlib.suppress(Exception):
                    for _ in streamed:
                        pass
            raise
        sidecar = {"save_id": self.save_id, "pp_rank": self.pp_rank, "files": {state_file(self.pp_rank): entry},
                   "tensors": sorted(keys), "param_groups": self.groups}
        self.tensors = None  # free the host copy as soon as it is stored
        self.storage.put_bytes(f"{self.name}/{sidecar_file(self.pp_rank)}", dumps(sidecar))

    def _write_manifest(self) -> None:
        files: dict[str, FileEntry] = {}
        data, tensors = self.extra or ({}, {})
        if tensors:
            blob = _safetensors_bytes(tensors)
            self.storage.put_bytes(f"{self.name}/{EXTRA_TENSORS}", blob)
            files[EXTRA_TENSORS] = bytes_entry(blob)
        blob = dumps(data)
        self.storage.put_bytes(f"{self.name}/{EXTRA_JSON}", blob)
        files[EXTRA_JSON] = bytes_entry(blob)
        index: dict[str, str] = {}
        for pp_rank in range(self.n_stages):
            raw = self._wait_sidecar(pp_rank)
            sidecar = json.loads(raw)
            files[sidecar_file(pp_rank)] = bytes_entry(raw)
            files.update(sidecar["files"])
            for key in sidecar["tensors"]:
                if key in index:
                    raise CheckpointError(f"tensor {key} is written by two pipeline stages")
                index[key] = state_file(pp_rank)
        manifest = make_manifest(self.step, files, index, self.layout)
        self.storage.put_bytes(f"{self.name}/{MANIFEST}", dumps(manifest))

    def _wait_sidecar(self, pp_rank: int) -> bytes:
        """The sidecar of stage ``pp_rank`` written by this save (polled: other ranks write it)."""
        key, delay, deadline = f"{self.name}/{sidecar_file(pp_rank)}", 0.02, time.monotonic() + SIDECAR_TIMEOUT_S
        while True:
            if self.storage.exists(key):
                raw = self.storage.get_bytes(key)
                if json.loads(raw).get("save_id") == self.save_id:
                    return raw
            if time.monotonic() > deadline:
                raise CheckpointError(f"pipeline stage {pp_rank} did not write its part of checkpoint {self.name} "
                                      f"within {SIDECAR_TIMEOUT_S:.0f}s")
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)


def write_streamed(path: str, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                   tensors: Iterator[tuple[str, torch.Tensor | None]]) -> list[str]:
    """Write a safetensors file whose tensors arrive one at a time, in ``plan``'s order
    (``(key, dtype, shape)`` each, known before any arrives): the header first, then each tensor's
    bytes as it comes, so no more than one of them is held here. Returns the keys written.

    Raises CheckpointError when a tensor differs from its plan entry (key, dtype or shape)."""
    try:
        head = header_bytes(plan)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    with open(path, "wb") as f:
        f.write(head)
        for key, dtype, shape in plan:
            got, tensor = next(tensors)
            if got != key or tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                found = "nothing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)}"
                raise CheckpointError(f"checkpoint tensor {key} ({dtype} {tuple(shape)}) came as {got}: {found}")
            write_tensor(f, tensor)
            del tensor
    for _ in tensors:  # the iterator's end: its last collective
        pass
    return [key for key, _, _ in plan]


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)

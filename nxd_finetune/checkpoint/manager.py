"""``CheckpointManager``: save, find, verify, load and prune training checkpoints under one root.

::

    mgr = CheckpointManager("outputs/run/checkpoints", keep_last=2, async_save=False, state=state)
    ref = mgr.resolve("latest")            # newest complete, verified checkpoint, or None
    if ref is not None:
        extra = mgr.load(ref, modules=stages, optimizer=opt)
    ...
    mgr.save(step, modules=stages, optimizer=opt, extra={"scheduler": sched.state_dict(), ...})
    mgr.wait()                             # before exit (also done by the next save and at exit)

The root is a local directory or ``s3://bucket/prefix`` (through ``registry.storage``, the one
storage seam). The format is described in :mod:`nxd_finetune.checkpoint.format`.

Save (collective: every rank calls it with the same step). Rank 0 removes a stale directory of
the same step (left by a killed save) and draws a save id; the state is gathered to one writer
per pipeline stage (:func:`.state.collect`) as CPU copies; each writer uploads its tensor file,
then its JSON sidecar (size, sha256, keys, optimizer group options); rank 0 writes ``extra``,
waits for every stage's sidecar of this save id, and writes ``manifest.json`` last (an atomic
put), then deletes checkpoints beyond ``keep_last`` (manifest first, so a half-deleted checkpoint
is never complete). With ``async_save`` the gathering still happens in ``save`` (the training
step may change the parameters right after), and the serialisation and uploads run in a
background thread; host memory is bounded by one checkpoint per rank, because the next ``save``
first waits for the previous one. The background thread runs no collective.

Resolve (collective when the world has several ranks): rank 0 lists the step directories newest
first, skips those without a manifest, verifies every file's size and sha256 and picks the first
that passes; a corrupt one is skipped with a :class:`CheckpointWarning`. The choice is broadcast.

Load (local): each rank reads only its slices for its current layout; S3 files are downloaded to
a temporary directory first and checked against the manifest.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save_file
from torch import nn

from nxd_finetune.checkpoint import format as F
from nxd_finetune.checkpoint.format import CheckpointError, CheckpointWarning
from nxd_finetune.checkpoint.state import collect, group_options, restore, trainable, unwrap
from nxd_finetune.parallel.zero1 import Zero1Optimizer
from nxd_finetune.registry.errors import StorageError
from nxd_finetune.registry.storage import LocalStorage, Storage, open_storage

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
class CheckpointRef:
    """One complete checkpoint: ``uri`` of its directory, its ``step`` and parsed ``manifest``.

    Its files are ``storage``'s keys under ``prefix`` (the step directory; empty when ``storage``
    is rooted at the checkpoint itself). S3 files fetched for verification or loading are kept in a
    temporary directory until :meth:`cleanup` (``load`` calls it)."""

    uri: str
    step: int
    manifest: dict[str, Any]
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
                self._check(name, F.file_entry(path) if os.path.isfile(path) else None)
            return path
        if name not in self._local:
            if self._tmp is None:
                self._tmp = tempfile.mkdtemp(prefix="nxd-ckpt-")
                weakref.finalize(self, shutil.rmtree, self._tmp, ignore_errors=True)  # if load() never runs
            path = os.path.join(self._tmp, name)
            self.storage.get_file(self.key(name), path)
            self._check(name, F.file_entry(path))  # downloaded anyway: always checked
            self._local[name] = path
        return self._local[name]

    def read_bytes(self, name: str) -> bytes:
        """The content of a small file, checked against the manifest."""
        with open(self.local_path(name, verify=False), "rb") as f:
            data = f.read()
        self._check(name, F.bytes_entry(data))
        return data

    def _check(self, name: str, got: dict[str, Any] | None) -> None:
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


class _Reader:
    """:class:`.state.TensorReader` over a checkpoint's safetensors files (opened lazily)."""

    def __init__(self, ref: CheckpointRef, verify: bool) -> None:
        self.ref, self.verify = ref, verify
        self.index: dict[str, str] = ref.manifest["tensors"]
        self.keys = set(self.index)
        self._open: dict[str, Any] = {}

    def _file(self, key: str) -> Any:
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


@dataclasses.dataclass
class _SaveJob:
    """The storage half of one save on one rank (no collectives: it may run in a thread)."""

    storage: Storage
    name: str
    step: int
    save_id: str
    pp_rank: int
    n_stages: int
    tensors: dict[str, torch.Tensor] | None  # None: this rank writes no stage file
    groups: list[dict[str, Any]]
    finalize: bool  # global rank 0: extra + manifest + retention
    extra: tuple[dict[str, Any], dict[str, torch.Tensor]] | None
    layout: dict[str, Any]
    keep_last: int

    def run(self) -> None:
        if self.tensors is not None:
            self._write_stage()
        if self.finalize:
            failpoint("before-manifest", self.step)
            self._write_manifest()
            retain(self.storage, self.keep_last)

    def _write_stage(self) -> None:
        fd, tmp = tempfile.mkstemp(prefix="nxd-ckpt-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(self.tensors, tmp)
            entry = F.file_entry(tmp)
            self.storage.put_file(tmp, f"{self.name}/{F.state_file(self.pp_rank)}")
        finally:
            os.unlink(tmp)
        sidecar = {"save_id": self.save_id, "pp_rank": self.pp_rank, "files": {F.state_file(self.pp_rank): entry},
                   "tensors": sorted(self.tensors), "param_groups": self.groups}
        self.tensors = None  # free the host copy as soon as it is stored
        self.storage.put_bytes(f"{self.name}/{F.sidecar_file(self.pp_rank)}", F.dumps(sidecar))

    def _write_manifest(self) -> None:
        files: dict[str, dict[str, Any]] = {}
        data, tensors = self.extra or ({}, {})
        if tensors:
            blob = _safetensors_bytes(tensors)
            self.storage.put_bytes(f"{self.name}/{F.EXTRA_TENSORS}", blob)
            files[F.EXTRA_TENSORS] = F.bytes_entry(blob)
        blob = F.dumps(data)
        self.storage.put_bytes(f"{self.name}/{F.EXTRA_JSON}", blob)
        files[F.EXTRA_JSON] = F.bytes_entry(blob)
        index: dict[str, str] = {}
        for pp_rank in range(self.n_stages):
            raw = self._wait_sidecar(pp_rank)
            sidecar = json.loads(raw)
            files[F.sidecar_file(pp_rank)] = F.bytes_entry(raw)
            files.update(sidecar["files"])
            for key in sidecar["tensors"]:
                if key in index:
                    raise CheckpointError(f"tensor {key} is written by two pipeline stages")
                index[key] = F.state_file(pp_rank)
        manifest = F.make_manifest(self.step, files, index, self.layout)
        self.storage.put_bytes(f"{self.name}/{F.MANIFEST}", F.dumps(manifest))

    def _wait_sidecar(self, pp_rank: int) -> bytes:
        """The sidecar of stage ``pp_rank`` written by this save (polled: other ranks write it)."""
        key, delay, deadline = f"{self.name}/{F.sidecar_file(pp_rank)}", 0.02, time.monotonic() + SIDECAR_TIMEOUT_S
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


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def list_checkpoints(storage: Storage) -> list[tuple[int, bool]]:
    """``(step, complete)`` of every step directory under ``storage``, oldest first."""
    out = []
    for name in storage.list_dirs(""):
        step = F.parse_step_dir(name)
        if step is not None:
            out.append((step, storage.exists(f"{name}/{F.MANIFEST}")))
    return sorted(out)


def delete_checkpoint(storage: Storage, step: int) -> None:
    """Remove a checkpoint, its manifest first (so it is never seen half-deleted as complete)."""
    name = F.step_dir(step)
    storage.delete(f"{name}/{F.MANIFEST}")
    storage.delete_prefix(f"{name}/")


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
            warnings.warn(f"could not delete old checkpoint {F.step_dir(step)}: {e}", CheckpointWarning, stacklevel=2)
    return sorted(doomed)


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _wait_all_at_exit() -> None:
    for mgr in list(_LIVE):
        try:
            mgr.wait()
        except CheckpointError as e:
            print(f"error: {e}", flush=True)


class CheckpointManager:
    """Training checkpoints under ``uri`` (a directory or ``s3://bucket/prefix``).

    ``keep_last``: complete checkpoints kept (older ones are deleted after each save).
    ``async_save``: write in a background thread (see the module docstring). ``state``: this
    rank's ``ParallelState``; required in a multi-process world (None: one process). ``group``:
    the world's group for the manager's own collectives on CPU tensors (the save id, rank 0's
    choice of checkpoint, barriers): a gloo group (``Engine.host.world``); None: the default group,
    which must then be gloo. ``storage_options`` go to ``open_storage`` (S3 endpoint, region...).
    Raises CheckpointError for a bad ``keep_last``, a multi-process world without ``state``, or
    without ``group`` when the default backend is not gloo.
    """

    def __init__(self, uri: str | os.PathLike, keep_last: int = 2, async_save: bool = False, state: Any = None,
                 group: Any = None, **storage_options: Any) -> None:
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
            raise CheckpointError(f"checkpoint keep_last must be a positive integer, got {keep_last!r}")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1 and state is None:
            raise CheckpointError(f"CheckpointManager in a world of {world} processes needs state=ParallelState")
        if world > 1 and group is None and dist.get_backend() != "gloo":
            raise CheckpointError(f"CheckpointManager on the {dist.get_backend()} backend needs group= a gloo group "
                                  "for its collectives on CPU tensors (sft.engine.HostGroups.world)")
        self.group = group
        self.uri = os.fspath(uri).rstrip("/")
        self.storage = open_storage(self.uri, **storage_options)
        self.keep_last, self.async_save, self.state = keep_last, async_save, state
        self.rank = state.rank if state is not None else 0
        self._multi = world > 1
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending_step: int | None = None
        _LIVE.add(self)

    # ------------------------------------------------------------------ save

    def save(self, step: int, modules: Sequence[nn.Module] | nn.Module, optimizer: Any = None,
             extra: dict[str, Any] | None = None) -> str:
        """Save the trainable parameters of ``modules`` (the model, or this rank's pipeline-stage
        modules), ``optimizer``'s state and ``extra`` (JSON-able values and tensors, at any depth;
        only rank 0's is stored) as checkpoint ``step``; returns its URI.

        Collective: every rank calls it with the same ``step``. Returns when the checkpoint is
        complete (``async_save=False``) or once the state is copied to host memory (``True``).
        Raises CheckpointError (a previous async save failed, ``extra`` is not storable, the
        optimizer steps parameters outside ``modules``); storage errors propagate.
        """
        self.wait()
        name = F.step_dir(step)
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        params = trainable(modules)
        opt = unwrap(optimizer)
        groups = group_options(opt, params)
        extra_enc = F.encode_extra(extra) if self.rank == 0 else None
        if self.rank == 0 and self.storage.list(f"{name}/"):
            delete_checkpoint(self.storage, step)  # a stale, possibly half-written save of this step
        save_id = self._broadcast_int(secrets.randbits(62) if self.rank == 0 else 0)
        tensors = collect(params, opt, self.state, copy=self.async_save)  # sync: written before the next step
        st = self.state
        job = _SaveJob(
            storage=self.storage, name=name, step=step, save_id=f"{save_id:016x}",
            pp_rank=st.pp_rank if st is not None else 0, n_stages=st.pp_size if st is not None else 1,
            tensors=tensors, groups=groups, finalize=self.rank == 0, extra=extra_enc,
            layout={"tp": st.tp_size if st else 1, "pp": st.pp_size if st else 1, "dp": st.dp_size if st else 1,
                    "zero1": isinstance(opt, Zero1Optimizer)},
            keep_last=self.keep_last)
        self._pending_step = step
        if self.async_save:
            self._thread = threading.Thread(target=self._run, args=(job,), name=f"nxd-checkpoint-{step}")
            self._thread.start()
        else:
            self._run(job)
            self.wait()
            if self._multi:
                dist.barrier(group=self.group)  # every rank returns once the manifest is written
        return f"{self.uri}/{name}"

    def _run(self, job: _SaveJob) -> None:
        try:
            job.run()
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def wait(self) -> None:
        """Wait for an in-flight async save; raise CheckpointError if it failed. Local."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"saving checkpoint {F.step_dir(self._pending_step or 0)} under {self.uri} "
                                  f"failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err

    def _broadcast_int(self, value: int) -> int:
        if not self._multi:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.group)
        return int(t.item())

    # ------------------------------------------------------------------ find

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (with a manifest; not verified), oldest first."""
        return [s for s, ok in list_checkpoints(self.storage) if ok]

    def resolve(self, which: str | os.PathLike | None = "latest") -> CheckpointRef | None:
        """The checkpoint to resume from. ``None`` -> None (start fresh). ``"latest"`` -> the newest
        complete checkpoint whose files all match the manifest (corrupt ones are skipped with a
        :class:`CheckpointWarning`), or None when there is none. A step directory name
        (``step-00000042``) or a path / URI of one checkpoint -> that checkpoint, verified;
        CheckpointError if it is incomplete or corrupt. Collective in a multi-process world:
        rank 0 verifies, the others follow its choice."""
        if which is None:
            return None
        self.wait()
        text = os.fspath(which)
        if text == "latest":
            mine = self._pick_latest() if self.rank == 0 else None  # verified (S3: files already fetched)
            step = self._broadcast_int(-1 if mine is None else mine.step)
            if step < 0:
                return None
            return mine or self._ref(self.storage, f"{self.uri}/{F.step_dir(step)}", F.step_dir(step))
        if F.parse_step_dir(text) is not None:
            storage, uri, prefix = self.storage, f"{self.uri}/{text}", text
        else:
            uri = text.rstrip("/")
            storage, prefix = open_storage(uri), ""
        error, mine = None, None
        if self.rank == 0:
            try:
                mine = self._verified(self._ref(storage, uri, prefix))
            except (CheckpointError, StorageError) as e:
                error = str(e)
        if self._broadcast_int(1 if error else 0):
            raise CheckpointError(error or f"checkpoint {uri} failed verification on rank 0")
        return mine or self._ref(storage, uri, prefix)

    @staticmethod
    def _verified(ref: CheckpointRef) -> CheckpointRef:
        try:
            ref.verify()
        except BaseException:
            ref.cleanup()
            raise
        return ref

    def _pick_latest(self) -> CheckpointRef | None:
        for step, complete in reversed(list_checkpoints(self.storage)):
            if not complete:
                continue
            name = F.step_dir(step)
            try:
                return self._verified(self._ref(self.storage, f"{self.uri}/{name}", name))
            except (CheckpointError, StorageError) as e:
                warnings.warn(f"skipping checkpoint {self.uri}/{name}: {e}; trying an older one",
                              CheckpointWarning, stacklevel=3)
        return None

    @staticmethod
    def _ref(storage: Storage, uri: str, prefix: str) -> CheckpointRef:
        """A ref on the checkpoint under ``prefix`` of ``storage``; reads and checks its manifest."""
        key = f"{prefix}/{F.MANIFEST}" if prefix else F.MANIFEST
        try:
            raw = storage.get_bytes(key)
        except StorageError as e:
            raise CheckpointError(f"{uri} is not a complete checkpoint (no {F.MANIFEST}): {e}") from None
        try:
            manifest = F.check_manifest(json.loads(raw), uri)
        except ValueError:
            raise CheckpointError(f"{uri}/{F.MANIFEST} is not valid JSON") from None
        return CheckpointRef(uri, manifest["step"], manifest, storage, prefix)

    # ------------------------------------------------------------------ load

    def load(self, ref: CheckpointRef, modules: Sequence[nn.Module] | nn.Module, optimizer: Any = None) -> dict:
        """Restore the trainable parameters of ``modules`` and ``optimizer``'s state (ZeRO-1 shards
        included) for this rank's current layout from ``ref``; returns the saved ``extra``.

        Every rank calls it after :meth:`resolve` (no collective inside). Parameters are read as
        this rank's slices; the optimizer gets the saved per-parameter state and group options
        (lr, betas...). Raises CheckpointError for missing or misshapen tensors and for S3 files
        that do not match the manifest."""
        if ref is None:
            raise CheckpointError("load() needs a checkpoint: resolve() returned None")
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        reader = _Reader(ref, verify=False)
        try:
            groups = []
            for name in ref.manifest["files"]:
                if name.startswith("state-pp") and name.endswith(".json"):
                    groups += json.loads(ref.read_bytes(name))["param_groups"]
            states = F.state_keys_by_param(reader.keys)
            restore(trainable(modules), optimizer, reader, states, groups)
            return self._read_extra(ref)
        finally:
            reader.close()
            ref.cleanup()

    @staticmethod
    def _read_extra(ref: CheckpointRef) -> dict[str, Any]:
        data = json.loads(ref.read_bytes(F.EXTRA_JSON))
        tensors = {}
        if F.EXTRA_TENSORS in ref.manifest["files"]:
            tensors = load_safetensors_bytes(ref.read_bytes(F.EXTRA_TENSORS))
        return F.decode_extra(data, tensors)

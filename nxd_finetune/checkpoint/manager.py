"""``CheckpointManager``: save, find, verify, load and prune training checkpoints under one root.

::

    mgr = CheckpointManager("outputs/run/checkpoints", keep_last=2, async_save=False, state=state)
    ref = mgr.resolve("latest")            # newest complete, verified checkpoint, or None
    if ref is not None:
        extra = mgr.load(ref, modules=stages, optimizer=opt)
    ...
    mgr.save(step, modules=stages, optimizer=opt, extra={"scheduler": sched.state_dict(), ...})
    mgr.wait()                             # before exit (also done by the next save and at exit)

The root is a local directory or ``s3://bucket/prefix`` (through :mod:`nxd_finetune.storage`, the one
storage seam). The format is described in :mod:`nxd_finetune.checkpoint.format`.

Save (collective: every rank calls it with the same step). Rank 0 removes a stale directory of
the same step (left by a killed save) and draws a save id; the state is gathered to one writer
per pipeline stage (:func:`.state.collect`) as CPU copies, or, in a synchronous save at tp > 1,
one tensor at a time while the writer streams it into its file (:class:`.state.StageTensors`,
:func:`.writer.write_streamed`: no host copy of the whole stage); each writer uploads its tensor file,
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

What a stored checkpoint is (refs, listing, retention): :mod:`.stored`; the storage half of a save
(run in a thread with ``async_save``): :mod:`.writer`.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors_bytes
from torch import nn
from torch.distributed import ProcessGroup

from nxd_finetune.checkpoint.format import (
    EXTRA_JSON,
    EXTRA_TENSORS,
    MANIFEST,
    CheckpointError,
    CheckpointWarning,
    check_manifest,
    decode_extra,
    encode_extra,
    parse_step_dir,
    state_keys_by_param,
    step_dir,
)
from nxd_finetune.checkpoint.state import StageTensors, collect, group_options, restore, trainable, unwrap
from nxd_finetune.checkpoint.stored import CheckpointReader, CheckpointRef, delete_checkpoint, list_checkpoints
from nxd_finetune.checkpoint.writer import SaveJob
from nxd_finetune.jsontypes import JsonObject
from nxd_finetune.parallel.state import ParallelState
from nxd_finetune.parallel.zero1 import Zero1Optimizer
from nxd_finetune.storage import Storage, StorageError, open_storage

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

    def __init__(self, uri: str | os.PathLike, keep_last: int = 2, async_save: bool = False,
                 state: ParallelState | None = None, group: ProcessGroup | None = None,
                 **storage_options: str | int | None) -> None:
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
            raise CheckpointError(f"checkpoint keep_last must be a positive integer, got {keep_last!r}")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1 and state is None:
            raise CheckpointError(f"CheckpointManager in a world of {world} processes needs state=ParallelState")
        if world > 1 and group is None and dist.get_backend() != "gloo":
            raise CheckpointError(f"CheckpointManager on the {dist.get_backend()} backend needs group= a gloo group "
                                  "for its collectives on CPU tensors (ParallelState.host_group())")
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

    def save(self, step: int, modules: Sequence[nn.Module] | nn.Module, optimizer: torch.optim.Optimizer | None = None,
             extra: Mapping[str, object] | None = None) -> str:
        """Save the trainable parameters of ``modules`` (the model, or this rank's pipeline-stage
        modules), ``optimizer``'s state and ``extra`` (JSON-able values and tensors, at any depth;
        only rank 0's is stored) as checkpoint ``step``; returns its URI.

        Collective: every rank calls it with the same ``step``. Returns when the checkpoint is
        complete (``async_save=False``) or once the state is copied to host memory (``True``).
        Raises CheckpointError (a previous async save failed, ``extra`` is not storable, the
        optimizer steps parameters outside ``modules``); storage errors propagate.
        """
        self.wait()
        name = step_dir(step)
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        params = trainable(modules)
        opt = unwrap(optimizer)
        groups = group_options(opt, params)
        extra_enc = encode_extra(extra) if self.rank == 0 else None
        if self.rank == 0 and (self.storage.list(f"{name}/") or self.storage.leftovers(f"{name}/")):
            delete_checkpoint(self.storage, step)  # a stale, possibly half-written save of this step
        save_id = self._broadcast_int(secrets.randbits(62) if self.rank == 0 else 0)
        st = self.state
        # A synchronous save at tp > 1 gathers one tensor at a time while the writer streams it to
        # its file; otherwise the stage is collected at once (copied for a background write).
        stream = StageTensors(params, opt, st) if not self.async_save and st is not None and st.size("tp") > 1 else None
        tensors = collect(params, opt, st, copy=self.async_save) if stream is None else None
        if stream is not None and not stream.writes:
            for _ in stream.tensors(copy=False):  # the other TP ranks take part in the gathers
                pass
        job = SaveJob(
            storage=self.storage, name=name, step=step, save_id=f"{save_id:016x}",
            pp_rank=st.coord("pp") if st is not None else 0, n_stages=st.size("pp") if st is not None else 1,
            tensors=tensors, groups=groups, finalize=self.rank == 0, extra=extra_enc,
            layout={**{axis: st.size(axis) if st else 1 for axis in ("tp", "pp", "dp")},
                    "zero1": isinstance(opt, Zero1Optimizer)},
            keep_last=self.keep_last, stream=stream if stream is not None and stream.writes else None)
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

    def _run(self, job: SaveJob) -> None:
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
            if self.rank == 0 and self._pending_step is not None:
                self._discard(self._pending_step)
            raise CheckpointError(f"saving checkpoint {step_dir(self._pending_step or 0)} under {self.uri} "
                                  f"failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err

    def _discard(self, step: int) -> None:
        """Remove what a failed save of ``step`` left (it has no manifest, so it never counted);
        best effort: the save's own error is the one reported."""
        try:
            if self.storage.exists(f"{step_dir(step)}/{MANIFEST}"):
                return  # the save completed before failing (e.g. in pruning): keep it
            delete_checkpoint(self.storage, step)
        except (OSError, StorageError):
            pass

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
        :class:`CheckpointWarning`), None when there is none, CheckpointError when there are
        complete checkpoints but none verifies (a silent fresh start would discard them). A step directory name
        (``step-00000042``) or a path / URI of one checkpoint -> that checkpoint, verified;
        CheckpointError if it is incomplete or corrupt. Collective in a multi-process world:
        rank 0 verifies, the others follow its choice."""
        if which is None:
            return None
        self.wait()
        text = os.fspath(which)
        if text == "latest":
            skipped: list[str] = []
            mine = self._pick_latest(skipped) if self.rank == 0 else None  # verified (S3: files already fetched)
            step = self._broadcast_int(-2 if skipped and mine is None else -1 if mine is None else mine.step)
            if step == -2:  # checkpoints there, none usable: starting over would lose them silently
                names = ", ".join(skipped) if skipped else "see rank 0's warnings"
                raise CheckpointError(f"no usable checkpoint in {self.uri}: {names} failed verification; "
                                      "resume one by name (--resume), or start over with --no-resume")
            if step < 0:
                return None
            return mine or self._ref(self.storage, f"{self.uri}/{step_dir(step)}", step_dir(step))
        if parse_step_dir(text) is not None:
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

    def _pick_latest(self, skipped: list[str]) -> CheckpointRef | None:
        """The newest complete checkpoint that verifies; the names of those that did not go to
        ``skipped``."""
        for step, complete in reversed(list_checkpoints(self.storage)):
            if not complete:
                continue
            name = step_dir(step)
            try:
                return self._verified(self._ref(self.storage, f"{self.uri}/{name}", name))
            except (CheckpointError, StorageError) as e:
                skipped.append(name)
                warnings.warn(f"skipping checkpoint {self.uri}/{name}: {e}; trying an older one",
                              CheckpointWarning, stacklevel=3)
        return None

    @staticmethod
    def _ref(storage: Storage, uri: str, prefix: str) -> CheckpointRef:
        """A ref on the checkpoint under ``prefix`` of ``storage``; reads and checks its manifest."""
        key = f"{prefix}/{MANIFEST}" if prefix else MANIFEST
        try:
            raw = storage.get_bytes(key)
        except StorageError as e:
            raise CheckpointError(f"{uri} is not a complete checkpoint (no {MANIFEST}): {e}") from None
        try:
            manifest = check_manifest(json.loads(raw), uri)
        except ValueError:
            raise CheckpointError(f"{uri}/{MANIFEST} is not valid JSON") from None
        return CheckpointRef(uri, manifest["step"], manifest, storage, prefix)

    # ------------------------------------------------------------------ load

    def load(self, ref: CheckpointRef, modules: Sequence[nn.Module] | nn.Module,
             optimizer: torch.optim.Optimizer | None = None) -> dict[str, object]:
        """Restore the trainable parameters of ``modules`` and ``optimizer``'s state (ZeRO-1 shards
        included) for this rank's current layout from ``ref``; returns the saved ``extra``.

        Every rank calls it after :meth:`resolve` (no collective inside). Parameters are read as
        this rank's slices; the optimizer gets the saved per-parameter state and group options
        (lr, betas...). Raises CheckpointError for missing or misshapen tensors and for S3 files
        that do not match the manifest."""
        if ref is None:
            raise CheckpointError("load() needs a checkpoint: resolve() returned None")
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        reader = CheckpointReader(ref, verify=False)
        try:
            groups = []
            for name in ref.manifest["files"]:
                if name.startswith("state-pp") and name.endswith(".json"):
                    groups += json.loads(ref.read_bytes(name))["param_groups"]
            states = state_keys_by_param(reader.keys)
            restore(trainable(modules), optimizer, reader, states, groups)
            return self._read_extra(ref)
        finally:
            reader.close()
            ref.cleanup()

    @staticmethod
    def read_extra_json(ref: CheckpointRef) -> JsonObject:
        """The JSON part of a checkpoint's ``extra`` (its tensors left as stored references), e.g.
        the recipe it was saved under, read before :meth:`load` reads any tensor."""
        data = json.loads(ref.read_bytes(EXTRA_JSON))
        return data if isinstance(data, dict) else {}

    @staticmethod
    def _read_extra(ref: CheckpointRef) -> dict[str, object]:
        data = json.loads(ref.read_bytes(EXTRA_JSON))
        tensors = {}
        if EXTRA_TENSORS in ref.manifest["files"]:
            tensors = load_safetensors_bytes(ref.read_bytes(EXTRA_TENSORS))
        decoded = decode_extra(data, tensors)
        return decoded if isinstance(decoded, dict) else {}

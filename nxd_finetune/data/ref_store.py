"""The reference log-probs stored with the tokenized preference data, and their integrity record.

A store is the directory ``ref-<key>/`` of the data's cache entry (``datasets.cache_entry``; the
key: :func:`nxd_finetune.data.pairs.ref_logps_key` of what decides the values beyond the data),
published atomically with both of its files:

- ``ref_logps.safetensors`` (:data:`REF_FILE`): one float32 tensor per split, sample order;
- ``reference.json`` (:data:`RECORD_FILE`), its integrity record: ``{"key", "file", "bytes",
  "sha256", "reference"}``, the sha256 of the safetensors file's bytes as written, and the
  reference identity the key hashes (for people reading the cache);
- ``parts/`` (:data:`PARTS_DIR`): the values of a split not complete yet, computed step by step
  (:mod:`nxd_finetune.sft.ref_source`): one file per write, ``<split>-<sha256 prefix>.safetensors``
  (:func:`save_part`) holding the sample ids and their values; its name is its integrity record.
  When a split is complete, its values move into ``ref_logps.safetensors`` and its parts go.

``ref_logps.safetensors`` holds the complete splits only (any subset of the data's splits).

Every load checks the record: no record, another key, other bytes (values rewritten, even as a
valid file; truncated; not safetensors), a split of the wrong size, NaN or inf each raise
:class:`RefStoreError`, one line naming the file and what is wrong. The caller
(:func:`nxd_finetune.sft.reference.attach_reference`) then recomputes the values from the
reference model, or refuses where it cannot; stored values are never used unchecked. A part that
fails its checks (:func:`load_parts`) is named the same way and its values computed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from nxd_finetune.errors import DataError
from nxd_finetune.storage.atomic import publish_dir

REF_FILE = "ref_logps.safetensors"
RECORD_FILE = "reference.json"
PARTS_DIR = "parts"


class RefStoreError(DataError):
    """A stored reference log-probs file fails its checks: ``str()`` is one line naming ``path``
    and ``problem``."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"reference log-probs {path}: {problem}")
        self.path, self.problem = path, problem


def store_dir(entry: Path, key: str) -> Path:
    return Path(entry) / f"ref-{key}"


def save_ref_logps(entry: Path, key: str, values: Mapping[str, torch.Tensor],
                   reference: Mapping[str, object] | None = None, *, replace: bool = False) -> Path:
    """Store per-split reference log-probs (sample order) in the cache entry with their integrity
    record, atomically (``ref-<key>/``). Losing a race to the same key keeps the first writer's
    store when it verifies; ``replace``: put these values in place of a store that did not verify.
    ``reference`` (what the key hashes) goes into the record. Returns the directory."""
    target = store_dir(entry, key)
    tensors = {split: torch.as_tensor(v).detach().to("cpu", torch.float32).reshape(-1).contiguous()
               for split, v in values.items()}
    data = save_safetensors(tensors)
    record = {"key": key, "file": REF_FILE, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
              "reference": dict(reference or {})}
    kept = [p for p in _part_files(target) if p.name.rpartition("-")[0] not in tensors]
    with publish_dir(target, already_published=lambda d: _verifies(d, key), replace=replace) as tmp:
        (tmp / REF_FILE).write_bytes(data)
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1, sort_keys=True, default=str))
        for part in kept:
            (tmp / PARTS_DIR).mkdir(exist_ok=True)
            try:
                os.link(part, tmp / PARTS_DIR / part.name)
            except OSError:
                shutil.copyfile(part, tmp / PARTS_DIR / part.name)
    return target


def save_part(entry: Path, key: str, split: str, ids: torch.Tensor, values: torch.Tensor) -> Path:
    """Store the values (float32) of the samples ``ids`` of ``split`` as one part of the store
    ``ref-<key>/`` (created if absent), atomically, named by the digest of its bytes. Returns its path."""
    tensors = {"ids": ids.detach().to("cpu", torch.int64).reshape(-1).contiguous(),
               "values": values.detach().to("cpu", torch.float32).reshape(-1).contiguous()}
    data = save_safetensors(tensors)
    folder = store_dir(entry, key) / PARTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{split}-{hashlib.sha256(data).hexdigest()[:24]}.safetensors"
    if not path.is_file() or path.read_bytes() != data:  # absent, or damaged under its name
        tmp = folder / f".{path.name}.partial-{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


def load_parts(entry: Path, key: str, sizes: Mapping[str, int]) -> tuple[dict[str, torch.Tensor], list[RefStoreError]]:
    """The values of the parts stored under ``key`` for the splits of ``sizes`` (split ->
    sequences): per split a float32 tensor of that size, NaN where no part holds a value; and the
    parts that fail their checks (a digest other than the name's, not safetensors, ids out of the
    split, NaN or inf), whose values are left out."""
    values: dict[str, torch.Tensor] = {}
    damaged: list[RefStoreError] = []
    for path in _part_files(store_dir(entry, key)):
        split, _, digest = path.stem.rpartition("-")
        if split not in sizes:
            continue
        try:
            ids, got = _checked_part(path, digest, sizes[split])
        except RefStoreError as e:
            damaged.append(e)
            continue
        table = values.setdefault(split, torch.full((sizes[split],), float("nan")))
        table[ids] = got
    return values, damaged


def _part_files(target: Path) -> list[Path]:
    folder = target / PARTS_DIR
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def _checked_part(path: Path, digest: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RefStoreError(path, f"unreadable ({e.strerror})") from None
    if hashlib.sha256(data).hexdigest()[:len(digest)] != digest or len(digest) != 24:
        raise RefStoreError(path, "does not match the digest in its name: changed or damaged since it was written")
    try:
        tensors = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise RefStoreError(path, f"not a readable safetensors file ({' '.join(str(e).split())})") from None
    ids, values = tensors.get("ids"), tensors.get("values")
    if (ids is None or values is None or ids.dtype != torch.int64 or values.dtype != torch.float32
            or ids.shape != values.shape or ids.dim() != 1):
        raise RefStoreError(path, "is not a part of reference log-probs (int64 ids, float32 values)")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= size):
        raise RefStoreError(path, f"names samples outside the split's {size}")
    if not torch.isfinite(values).all():
        raise RefStoreError(path, "holds NaN or inf")
    return ids, values


def load_ref_logps(entry: Path, key: str, sizes: Mapping[str, int] | None = None) -> dict[str, torch.Tensor] | None:
    """The reference log-probs stored under ``key`` in the cache entry, checked (see the module
    docstring); None when nothing is stored there. ``sizes`` (split -> sequences): each split
    stored must hold that many values (a split not stored yet is absent from the result; so are
    splits not in ``sizes``). Raises :class:`RefStoreError` for a store that fails a check."""
    target = store_dir(entry, key)
    path = target / REF_FILE
    if not path.is_file():
        if target.is_dir() and (target / RECORD_FILE).is_file():
            raise RefStoreError(path, f"missing (its integrity record {RECORD_FILE} is there)")
        return None
    values = _checked(target, key)
    if sizes is None:
        return values
    values = {split: v for split, v in values.items() if split in sizes}
    for split, got in values.items():
        n = sizes[split]
        if got.dim() != 1 or got.numel() != n:
            raise RefStoreError(path, f"holds {got.numel()} values for the {split} split's {n} sequences")
        if not torch.isfinite(got).all():
            raise RefStoreError(path, f"holds NaN or inf ({split} split)")
    return values


def _checked(target: Path, key: str) -> dict[str, torch.Tensor]:
    path = target / REF_FILE
    record = _record(target / RECORD_FILE)
    if record is None:
        raise RefStoreError(path, f"no integrity record ({RECORD_FILE})")
    if record.get("key") != key:
        raise RefStoreError(path, f"its integrity record is for another key ({record.get('key')!r}, not {key!r})")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RefStoreError(path, f"unreadable ({e.strerror})") from None
    digest, recorded = hashlib.sha256(data).hexdigest(), str(record["sha256"])
    if digest != recorded:
        raise RefStoreError(path, f"does not match its integrity record ({len(data)} bytes with sha256 "
                                  f"{digest[:16]}, stored as {record.get('bytes')} bytes with sha256 "
                                  f"{recorded[:16]}): changed or damaged since it was written")
    try:
        values = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise RefStoreError(path, f"not a readable safetensors file ({' '.join(str(e).split())})") from None
    if any(v.dtype != torch.float32 for v in values.values()):
        raise RefStoreError(path, "holds values that are not float32")
    return values


def _record(path: Path) -> dict[str, object] | None:
    """The integrity record (None: none there, unreadable, or a store written before records)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        return None
    return record


def _verifies(target: Path, key: str) -> bool:
    try:
        _checked(target, key)
    except (RefStoreError, OSError):
        return False
    return True

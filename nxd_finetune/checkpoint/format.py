"""The on-storage format of a training checkpoint: names, the manifest, and the ``extra`` encoding.

A checkpoint is a directory (local) or key prefix (S3) ``<root>/step-<8 digits>/`` holding::

    state-pp00.safetensors   trainable parameters and optimizer states of pipeline rank 0, by global
    state-pp00.json          name and with full (unsharded) shapes; its JSON sidecar: the tensor keys,
    ...                      the optimizer's param-group options, size and sha256 of the file
    extra.json               the caller's ``extra`` dict (tensors in it replaced by references ...)
    extra.safetensors        (... to the tensors stored here); written by global rank 0
    manifest.json            written LAST, atomically: every file with size and sha256, the tensor
                             index (key -> file), the layout it was saved from, the step

Tensor keys: ``param/<name>`` (the parameter, in its dtype) and ``optim/<name>/<state>`` (an
optimizer state shaped like the parameter, e.g. ``exp_avg``, or a 0-dim scalar such as ``step``;
``master`` is a ZeRO-1 fp32 master weight, stored only when the parameter is not fp32). ``<name>``
is the parameter's name in the full model (pipeline stages keep global names), so a checkpoint
loads on any tp / pp / dp layout. Only safetensors and JSON are written; nothing is pickled.

A checkpoint without ``manifest.json`` is incomplete and never loaded; one whose file does not
match the manifest's size or sha256 is corrupt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import TypedDict, cast

import torch

from nxd_finetune.errors import NxdError, NxdWarning
from nxd_finetune.jsontypes import JsonObject, JsonValue
from nxd_finetune.storage.fetch import FileEntry

FORMAT = "nxd-finetune-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
EXTRA_JSON = "extra.json"
EXTRA_TENSORS = "extra.safetensors"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TENSOR_REF = "__tensor__"
_HASH_CHUNK = 1 << 22


class CheckpointError(NxdError):
    """A checkpoint is missing, incomplete, corrupt or does not fit the model / optimizer."""


class CheckpointWarning(NxdWarning):
    """A checkpoint was skipped (corrupt); an older complete one is used instead."""


def step_dir(step: int) -> str:
    """The directory (key prefix, no slash) of the checkpoint of ``step``: ``step-00000042``."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"checkpoint step must be a non-negative integer, got {step!r}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """``step-00000042`` -> 42; None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def state_file(pp_rank: int) -> str:
    return f"state-pp{pp_rank:02d}.safetensors"


def sidecar_file(pp_rank: int) -> str:
    return f"state-pp{pp_rank:02d}.json"


def param_key(name: str) -> str:
    return f"param/{name}"


def optim_key(name: str, state: str) -> str:
    return f"optim/{name}/{state}"


class Manifest(TypedDict):
    """A checkpoint's ``manifest.json``: ``layout`` is the parallel layout it was saved under,
    ``tensors`` maps every tensor key to the file holding it."""

    format: str
    version: int
    step: int
    layout: JsonObject
    files: dict[str, FileEntry]
    tensors: dict[str, str]


class Hasher:
    """sha256 and size of bytes fed in pieces."""

    def __init__(self) -> None:
        self._h, self.size = hashlib.sha256(), 0

    def update(self, data: bytes) -> None:
        self._h.update(data)
        self.size += len(data)

    def entry(self) -> FileEntry:
        return {"size": self.size, "sha256": self._h.hexdigest()}


def file_entry(path: str | os.PathLike[str]) -> FileEntry:
    """``{"size", "sha256"}`` of a local file (read in 4 MiB pieces)."""
    h = Hasher()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.entry()


def bytes_entry(data: bytes) -> FileEntry:
    h = Hasher()
    h.update(data)
    return h.entry()


def dumps(obj: object) -> bytes:
    """Stable JSON bytes (sorted keys) for sidecars and the manifest."""
    return (json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


# ----------------------------------------------------------------------------- extra


def encode_extra(extra: Mapping[str, object] | None) -> tuple[JsonObject, dict[str, torch.Tensor]]:
    """Split ``extra`` into JSON-able data and tensors: every tensor (at any depth of dicts /
    lists / tuples) is replaced by ``{"__tensor__": "<path>"}`` and returned in the tensor dict
    (a CPU copy). Tuples become lists. Raises CheckpointError naming the path of a value that is
    neither JSON-able nor a tensor (or a dict key that is not a string)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: object, path: str) -> JsonValue:
        if torch.is_tensor(value):
            tensors[path] = value.detach().to("cpu", copy=True).contiguous()
            return {_TENSOR_REF: path}
        if isinstance(value, dict):
            if _TENSOR_REF in value:
                raise CheckpointError(f"extra{path}: the key {_TENSOR_REF!r} is reserved")
            out: JsonObject = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"extra{path}: dict key {k!r} is not a string")
                out[k] = walk(v, f"{path}.{k}")
            return out
        if isinstance(value, list | tuple):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, float) and not math.isfinite(value):
            raise CheckpointError(f"extra{path}: {value} cannot be stored in JSON")
        if value is None or isinstance(value, bool | int | float | str):
            return value
        raise CheckpointError(f"extra{path}: a {type(value).__name__} is neither JSON-able nor a tensor")

    encoded = walk(dict(extra or {}), "")
    assert isinstance(encoded, dict)  # a dict walks to a dict
    return encoded, tensors


def decode_extra(data: object, tensors: dict[str, torch.Tensor]) -> object:
    """Inverse of :func:`encode_extra` (tuples come back as lists): ``data`` is its JSON part."""
    if isinstance(data, dict):
        if set(data) == {_TENSOR_REF}:
            return tensors[data[_TENSOR_REF]]
        return {k: decode_extra(v, tensors) for k, v in data.items()}
    if isinstance(data, list):
        return [decode_extra(v, tensors) for v in data]
    return data


# ----------------------------------------------------------------------------- manifest


def make_manifest(step: int, files: dict[str, FileEntry], tensors: dict[str, str], layout: JsonObject) -> Manifest:
    return {"format": FORMAT, "version": VERSION, "step": step, "layout": layout,
            "files": dict(sorted(files.items())), "tensors": dict(sorted(tensors.items()))}


def check_manifest(manifest: object, where: str) -> Manifest:
    """Validate the structure of a parsed manifest; CheckpointError naming ``where`` otherwise."""
    if not (isinstance(manifest, dict) and manifest.get("format") == FORMAT
            and isinstance(manifest.get("files"), dict) and isinstance(manifest.get("tensors"), dict)
            and isinstance(manifest.get("step"), int)):
        raise CheckpointError(f"{where}: not an nxd-finetune checkpoint manifest")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"{where}: checkpoint format version {manifest['version']} is newer than this "
                              f"nxd-finetune reads ({VERSION}); upgrade nxd-finetune")
    for name, entry in manifest["files"].items():
        if "/" in name or not isinstance(entry, dict) or not {"size", "sha256"} <= set(entry):
            raise CheckpointError(f"{where}: malformed file entry {name!r}")
    return cast(Manifest, manifest)  # its structure checked above


def state_keys_by_param(keys: Iterable[str]) -> dict[str, list[str]]:
    """``{param name: [optimizer state names]}`` from the tensor keys of a manifest."""
    out: dict[str, list[str]] = {}
    for key in keys:
        if key.startswith("optim/"):
            name, _, state = key[len("optim/"):].rpartition("/")
            out.setdefault(name, []).append(state)
    return out

"""The identity of an adapter's base model, and the check that an adapter is used on that base.

An adapter written by nxd-finetune records its base in the safetensors header's metadata, where
PEFT does not look (the file stays a plain PEFT adapter):

- ``nxd_config_hash``: :meth:`DecoderConfig.config_hash` (a short hash, also shown by the registry);
- ``nxd_base_config``: the model-defining config fields (:func:`identity_config`) as JSON, so a
  mismatch can name the keys that differ;
- ``nxd_base_weights``: :func:`weights_fingerprint` of the base checkpoint (every byte of every
  tensor; adapters written before it record :func:`sampled_fingerprint`, the first and last 4 KiB
  of each tensor, and are checked that way).

``lora.init_from`` and ``nxd-finetune merge`` call :func:`check_base`: a different base is one
AdapterError line (config keys that differ, or same config but other weights) unless the caller
allows it on purpose; an adapter that records no fingerprint (older files, PEFT's adapters) is one
``warning:`` line (:class:`~nxd_finetune.errors.NxdWarning`) and is used.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, BinaryIO

from safetensors import SafetensorError, safe_open

from nxd_finetune.errors import AdapterError, ModelLoadError, NxdWarning
from nxd_finetune.jsontypes import JsonObject
from nxd_finetune.models import DecoderConfig, check_checkpoint_files

CONFIG_HASH_KEY = "nxd_config_hash"
BASE_CONFIG_KEY = "nxd_base_config"
BASE_WEIGHTS_KEY = "nxd_base_weights"
FINGERPRINT_PREFIX = "sha256-tensors:"  # whole tensors; a bare hex digest is the older sampled form
SAMPLE_BYTES = 4096  # of each tensor's data, from its start and from its end (sampled_fingerprint)
_CHUNK = 1 << 22
_THREADS = 8
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


def identity_config(config: DecoderConfig) -> JsonObject:
    """The fields that define the model (every :class:`DecoderConfig` field and HF's
    ``model_type``), JSON-normalised. Keys such as ``transformers_version`` or the file dtype are
    left out: a base re-saved by another transformers release is the same base."""
    d: dict[str, object] = {k: v for k, v in dataclasses.asdict(config).items() if k != "raw"}
    d["model_type"] = config.to_hf().get("model_type")
    return json.loads(json.dumps(d, sort_keys=True))


def weights_fingerprint(model_dir: str | Path) -> str:
    """``sha256-tensors:<hex>``: sha256 over the base checkpoint's tensors in name order, each
    tensor's name, dtype and shape (from the safetensors headers) and the sha256 of every byte of
    its data. Tensors are hashed on up to :data:`_THREADS` threads (hashlib releases the GIL), each
    read in :data:`_CHUNK` pieces, so memory holds a few chunks, never a tensor.

    The order is by tensor name, so resharding a checkpoint (or other safetensors metadata) keeps
    the fingerprint; another dtype, or any changed value, changes it. Each file's header is
    checked by ``safetensors`` first (:func:`~nxd_finetune.models.loading.open_checkpoint_file`).
    It reads the whole checkpoint once, at hashing speed (the cost is in docs/checkpoints.md). Raises
    ModelLoadError for an unreadable checkpoint."""
    spans = _tensor_spans(model_dir)
    threads = max(1, min(_THREADS, os.cpu_count() or 1, len(spans)))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        digests = list(pool.map(lambda span: _data_digest(*span[2:]), spans))
    h = hashlib.sha256()
    for (name, info, *_), digest in zip(spans, digests, strict=True):
        h.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
        h.update(digest)
    return FINGERPRINT_PREFIX + h.hexdigest()


def _data_digest(path: Path, begin: int, end: int) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(begin)
        left = end - begin
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise ModelLoadError(f"checkpoint file {path} ends inside a tensor's data")
            h.update(chunk)
            left -= len(chunk)
    return h.digest()


def sampled_fingerprint(model_dir: str | Path) -> str:
    """The fingerprint adapters recorded before :func:`weights_fingerprint` hashed whole tensors (a
    bare hex digest): sha256 over each tensor's name, dtype, shape and only the first and last
    :data:`SAMPLE_BYTES` of its data. Still computed to check those adapters, so for them only
    those bytes are compared."""
    h = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        handles: dict[Path, BinaryIO] = {}
        for name, info, path, begin, end in _tensor_spans(model_dir):
            f = handles.get(path) or handles.setdefault(path, stack.enter_context(open(path, "rb")))
            h.update(json.dumps([name, info["dtype"], info["shape"]]).encode())
            spans = [(begin, end)] if end - begin <= 2 * SAMPLE_BYTES else [
                (begin, begin + SAMPLE_BYTES), (end - SAMPLE_BYTES, end)]
            for a, b in spans:
                f.seek(a)
                h.update(f.read(b - a))
    return h.hexdigest()


def fingerprint_matches(recorded: str, model_dir: str | Path) -> bool:
    """Whether ``model_dir`` has the fingerprint an adapter recorded, computed the way it was
    recorded: whole tensors (``sha256-tensors:``) or, for older adapters, samples."""
    if recorded.startswith(FINGERPRINT_PREFIX):
        return recorded == weights_fingerprint(model_dir)
    return recorded == sampled_fingerprint(model_dir)


def _tensor_spans(model_dir: str | Path) -> list[tuple[str, dict[str, Any], Path, int, int]]:
    """``(name, header entry, file, first byte, end byte)`` of every tensor, by name; every file's
    header is checked by safetensors before it is read here."""
    index = check_checkpoint_files(model_dir)
    headers: dict[Path, tuple[int, dict[str, Any]]] = {}
    for path in sorted(set(index.values()), key=lambda p: p.name):
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                headers[path] = (8 + n, json.loads(f.read(n)))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read checkpoint file {path}: {e}") from None
    out = []
    for name in sorted(index):
        path = index[name]
        start_of_data, header = headers[path]
        info = header.get(name)
        if not isinstance(info, dict):
            raise ModelLoadError(f"checkpoint file {path} lacks tensor {name!r} its index names")
        begin, end = (start_of_data + o for o in info["data_offsets"])
        out.append((name, info, path, begin, end))
    return out


def base_identity(config: DecoderConfig, model_dir: str | Path) -> dict[str, str]:
    """The safetensors metadata entries that record ``model_dir`` (with ``config``) as the base."""
    return {
        CONFIG_HASH_KEY: config.config_hash(),
        BASE_CONFIG_KEY: json.dumps(identity_config(config), sort_keys=True, separators=(",", ":")),
        BASE_WEIGHTS_KEY: weights_fingerprint(model_dir),
    }


def _recorded(adapter_dir: Path) -> dict[str, str]:
    try:
        with safe_open(str(adapter_dir / WEIGHTS_NAME), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except (OSError, SafetensorError):
        meta = {}
    if not meta.get(CONFIG_HASH_KEY):  # older adapters kept the hash in adapter_config.json
        try:
            old = json.loads((adapter_dir / CONFIG_NAME).read_text()).get(CONFIG_HASH_KEY)
        except (OSError, ValueError):
            old = None
        if old:
            meta[CONFIG_HASH_KEY] = old
    return meta


def _config_difference(recorded: JsonObject, actual: JsonObject) -> str | None:
    # a field added to DecoderConfig after the adapter was written is absent from what it recorded:
    # its base had the field's default (else the release that wrote it could not have loaded the base)
    defaults = {f.name: f.default for f in dataclasses.fields(DecoderConfig) if f.default is not dataclasses.MISSING}
    recorded = {**{k: v for k, v in json.loads(json.dumps(defaults, default=str)).items() if k in actual}, **recorded}
    keys = sorted(k for k in set(recorded) | set(actual) if recorded.get(k) != actual.get(k))
    if not keys:
        return None
    shown = ", ".join(f"{k} ({recorded.get(k)!r} vs {actual.get(k)!r})" for k in keys[:4])
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return f"config differs in {shown}{more} (adapter's base vs this base)"


def base_difference(adapter_dir: str | Path, config: DecoderConfig, model_dir: str | Path) -> str | None:
    """What differs between the base the adapter records and ``model_dir`` (``config``): the config
    keys, or ``same config but other weights``; None when they are the same base. Raises
    AdapterError when the adapter records no fingerprint (see :func:`check_base`)."""
    meta = _recorded(Path(adapter_dir))
    if not meta.get(BASE_WEIGHTS_KEY) or not meta.get(BASE_CONFIG_KEY):
        raise AdapterError("the adapter records no base fingerprint")
    try:
        recorded_config = json.loads(meta[BASE_CONFIG_KEY])
    except ValueError:
        raise AdapterError(f"the adapter's {BASE_CONFIG_KEY} metadata is not JSON") from None
    diff = _config_difference(recorded_config, identity_config(config))
    if diff is not None:
        return diff
    if not fingerprint_matches(meta[BASE_WEIGHTS_KEY], model_dir):
        return "same config but other weights"
    return None


def base_mismatches(adapter_dir: str | Path, config: DecoderConfig, revision: str | None = None) -> list[str]:
    """The served-base check (:mod:`nxd_finetune.serve.lora_cache`, no checkpoint to fingerprint):
    one line per difference between the config hash / ``revision`` the adapter records and
    ``config``'s / ``revision``. Fields either side leaves empty are not compared."""
    adapter_dir = Path(adapter_dir)
    out = []
    recorded, actual = _recorded(adapter_dir).get(CONFIG_HASH_KEY), config.config_hash()
    if recorded and recorded != actual:
        out.append(f"the adapter was trained on a base with config hash {recorded}, this base has {actual}")
    raw_revision = _recorded_revision(adapter_dir)
    if raw_revision and revision and raw_revision != revision:
        out.append(f"the adapter records base revision {raw_revision!r}, this base is at {revision!r}")
    return out


def _recorded_revision(adapter_dir: Path) -> str | None:
    try:
        return json.loads((adapter_dir / CONFIG_NAME).read_text()).get("revision") or None
    except (OSError, ValueError):
        return None


def check_base(adapter_dir: str | Path, config: DecoderConfig, model_dir: str | Path, *, where: str,
               allow: bool, allow_hint: str, revision: str | None = None, warn: bool = True) -> None:
    """Refuse an adapter trained on another base than ``model_dir``: one AdapterError line
    ``<where>: the adapter was trained on another base than <model_dir>: <difference>; <allow_hint>
    to use it anyway``. With ``allow`` the difference is a warning instead. An adapter without a
    fingerprint, or whose ``revision`` differs from ``revision``, is one ``warning:`` line
    (NxdWarning; only with ``warn``, e.g. on one rank of many)."""
    adapter_dir = Path(adapter_dir)
    notes = []
    meta = _recorded(adapter_dir)
    if not meta.get(BASE_WEIGHTS_KEY):
        note = "the adapter records no base fingerprint (an older or PEFT adapter), so its base is not checked"
        recorded_hash, actual = meta.get(CONFIG_HASH_KEY), config.config_hash()
        if recorded_hash and recorded_hash != actual:
            note += f"; it was trained on a base with config hash {recorded_hash}, this base has {actual}"
        notes.append(note)
    else:
        diff = base_difference(adapter_dir, config, model_dir)
        if diff is not None and not allow:
            raise AdapterError(f"{where}: the adapter was trained on another base than {model_dir}: {diff}; "
                               f"{allow_hint} to use it anyway")
        if diff is not None:
            notes.append(f"the adapter was trained on another base: {diff}")
    raw_revision = _recorded_revision(adapter_dir)
    if raw_revision and revision and raw_revision != revision:
        notes.append(f"the adapter records base revision {raw_revision!r}, this base is at {revision!r}")
    if notes and warn:
        warnings.warn(f"{where}: {'; '.join(notes)}; using it anyway", NxdWarning, stacklevel=2)


__all__ = ["BASE_CONFIG_KEY", "BASE_WEIGHTS_KEY", "FINGERPRINT_PREFIX", "base_difference", "base_identity",
           "base_mismatches", "check_base", "fingerprint_matches", "identity_config", "sampled_fingerprint",
           "weights_fingerprint"]

"""Adapter directories and the ``manifest.json`` that makes a registry version visible.

A pushable directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (HF PEFT
layout) and may hold other ``*.json`` / ``*.safetensors`` files, a ``README.md`` (PEFT writes a
model card) and the tokenizer's non-JSON files (``chat_template.jinja``, ``*.txt`` such as
``merges.txt``, ``tokenizer.model``), which are stored and hashed but never parsed. Anything
else -- notably pickle-based ``.bin``/``.pt``/``.pkl`` -- or any subdirectory is refused, so
nothing a registry hands out is ever unpickled. A ``manifest.json`` found in the directory (one
written by ``pull``) is ignored: the registry writes its own.

A symbolic link in the directory is followed only when it stays inside it: a link to a file
elsewhere (``notes.txt -> ~/.aws/credentials``) is refused, so a push never stores what was not
in the adapter directory.

The adapter is checked by the function ``merge`` and ``lora.init_from`` read it with
(:func:`nxd_finetune.lora.io.read_adapter`: its config, and its tensors through safetensors, which
refuses overlapping or out-of-range offsets), so the registry never stores an adapter they refuse.

Manifest (``format: nxd-adapter-manifest/1``)::

    {"format", "name", "version", "created" (UTC ISO-8601), "tool": {"name", "version"},
     "files": {FILE: {"sha256", "size"}},
     "base_model": {"name_or_path", "revision", ...caller keys such as "config_sha256"},
     "recipe": dict|null, "metrics": dict|null, "parallel": dict|null, "lineage": REF|null,
     "objective": {"name", "loss_type", "reference"}|null}

``objective`` is read from the adapter's safetensors metadata at push (a preference run's
``nxd_objective`` / ``nxd_loss_type`` / ``nxd_reference``); null for SFT and PEFT adapters, absent
in manifests written before it existed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict, cast

import nxd_finetune
from nxd_finetune.errors import AdapterError
from nxd_finetune.jsontypes import JsonObject, json_object
from nxd_finetune.registry.errors import RegistryError
from nxd_finetune.registry.ref import parse_ref
from nxd_finetune.storage.fetch import FileEntry, sha256_file

FORMAT = "nxd-adapter-manifest/1"
MANIFEST = "manifest.json"
REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")
FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}\.(json|safetensors|jinja|txt)|README\.md|tokenizer\.model")
ALLOWED_FILES = "*.json, *.safetensors, README.md and tokenizer files (*.jinja, *.txt, tokenizer.model)"
METADATA_KEYS = ("recipe", "metrics", "parallel", "lineage", "base_model")


class PushMetadata(TypedDict, total=False):
    """What a caller may add to a version's manifest (:func:`check_metadata` validates it)."""

    recipe: JsonObject | None
    metrics: JsonObject | None
    parallel: JsonObject | None
    lineage: str | None
    base_model: JsonObject | None
    objective: JsonObject | None  # not a caller's key: what the adapter records (adapter_objective)


class AdapterManifest(TypedDict):
    """A version's ``manifest.json`` (see the module docstring)."""

    format: str
    name: str
    version: int
    created: str
    tool: dict[str, str]
    files: dict[str, FileEntry]
    base_model: JsonObject
    recipe: JsonObject | None
    metrics: JsonObject | None
    parallel: JsonObject | None
    lineage: str | None
    objective: JsonObject | None  # absent in manifests written before it existed: read it with .get


def check_file_name(name: str) -> str:
    """Names a manifest may list (:data:`FILE_RE`), no paths, no ``..``."""
    if not FILE_RE.fullmatch(name) or ".." in name or name == MANIFEST:
        raise RegistryError(f"file {name!r} is not allowed in an adapter (only {ALLOWED_FILES})")
    return name


def scan_adapter_dir(src: str | Path) -> dict[str, Path]:
    """Validate an adapter directory; return ``{file name: path}`` of the files to push (sorted).

    Raises :class:`RegistryError` naming every offending entry, a link leaving the directory, a
    missing required file, an ``adapter_config.json`` that is not a JSON object, an adapter that
    ``read_adapter`` refuses, or a ``.safetensors`` file whose header does not parse.
    """
    src = Path(src)
    if not src.is_dir():
        raise RegistryError(f"adapter directory {str(src)!r} does not exist or is not a directory")
    check_links(src)
    files: dict[str, Path] = {}
    bad: list[str] = []
    for entry in sorted(src.iterdir()):
        if entry.name == MANIFEST and entry.is_file():
            continue
        if entry.is_dir() or not entry.is_file() or not FILE_RE.fullmatch(entry.name) or ".." in entry.name:
            bad.append(entry.name + ("/" if entry.is_dir() else ""))
        else:
            files[entry.name] = entry
    if bad:
        raise RegistryError(
            f"{src} contains files the registry refuses: {', '.join(bad)} "
            f"(only {ALLOWED_FILES}; pickle-based .bin/.pt are never accepted)"
        )
    missing = [f for f in REQUIRED_FILES if f not in files]
    if missing:
        raise RegistryError(f"{src} is not a PEFT adapter directory: missing {', '.join(missing)}")
    read_adapter_config(files["adapter_config.json"])
    for name, path in files.items():
        if name.endswith(".safetensors"):
            check_safetensors_header(path)
    _check_lora(src)
    return files


def check_links(src: Path) -> None:
    """Refuse an entry of ``src`` that is a symbolic link resolving outside ``src`` (or nowhere)."""
    root = src.resolve()
    outside = []
    for entry in sorted(src.iterdir()):
        if entry.is_symlink():
            target = entry.resolve()
            if not target.is_relative_to(root) or not target.exists():
                outside.append(f"{entry.name} -> {os.readlink(entry)}")
    if outside:
        raise RegistryError(f"{src} holds links to files outside it, which the registry refuses: "
                            f"{', '.join(outside)} (copy the files in instead)")


def _check_lora(src: Path) -> None:
    """What ``run`` (``lora.init_from``) and ``merge`` accept: the function they read an adapter
    with (a LoRA for a causal LM, without the PEFT features we do not implement, whose tensors
    safetensors reads), called before anything is uploaded."""
    from nxd_finetune.lora.io import read_adapter  # lazy: torch and safetensors; the CLI's --help loads this module

    try:
        read_adapter(src)
    except AdapterError as e:
        raise RegistryError(f"{src}: {e}") from None


def read_adapter_config(path: Path) -> JsonObject:
    """``adapter_config.json`` as a dict; not JSON or not an object -> :class:`RegistryError`."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RegistryError(f"{path} is not valid JSON: {e}".replace("\n", " ")) from None
    if not isinstance(cfg, dict):
        raise RegistryError(f"{path} must hold a JSON object")
    return cfg


def check_safetensors_header(path: Path) -> JsonObject:
    """Check the 8-byte length + JSON header of a safetensors file (no tensor data is read) and
    return the header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise RegistryError(f"{path} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RegistryError(f"{path} is not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise RegistryError(f"{path} is not a safetensors file (header is not a JSON object)")
    return header


def file_entries(files: Mapping[str, Path]) -> dict[str, FileEntry]:
    """``{name: {"sha256", "size"}}`` for the given files."""
    return {name: {"sha256": sha256_file(p), "size": p.stat().st_size} for name, p in sorted(files.items())}


def check_metadata(metadata: Mapping[str, object] | None) -> PushMetadata:
    """Validate caller metadata: only :data:`METADATA_KEYS`, JSON-serialisable, right shapes."""
    meta = dict(metadata or {})
    unknown = sorted(set(meta) - set(METADATA_KEYS))
    if unknown:
        raise RegistryError(f"unknown metadata key(s) {unknown}; allowed: {', '.join(METADATA_KEYS)}")
    for key in ("recipe", "metrics", "parallel", "base_model"):
        if meta.get(key) is not None and not isinstance(meta[key], Mapping):
            raise RegistryError(f"metadata {key!r} must be a dict, got {type(meta[key]).__name__}")
    if meta.get("lineage") is not None:
        if not isinstance(meta["lineage"], str):
            raise RegistryError("metadata 'lineage' must be a REF string")
        parse_ref(meta["lineage"])
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise RegistryError(f"metadata is not JSON-serialisable: {e}") from None
    return cast(PushMetadata, meta)  # keys and shapes checked above


def adapter_base(files: Mapping[str, Path]) -> JsonObject:
    """What an adapter directory (:func:`scan_adapter_dir`'s files) says of its base model:
    ``name_or_path`` and ``revision`` from ``adapter_config.json``, and ``config_hash`` where the
    adapter records one (``nxd_config_hash`` in the safetensors metadata, or in the JSON of older
    adapters; PEFT's adapters have none)."""
    cfg = read_adapter_config(files["adapter_config.json"])
    header = check_safetensors_header(files["adapter_model.safetensors"])
    config_hash = json_object(header.get("__metadata__")).get("nxd_config_hash") or cfg.get("nxd_config_hash")
    base = {"name_or_path": cfg.get("base_model_name_or_path"), "revision": cfg.get("revision")}
    return {**base, "config_hash": config_hash} if config_hash else base


def adapter_objective(files: Mapping[str, Path]) -> JsonObject | None:
    """The training objective an adapter directory records in its safetensors metadata
    (``nxd_objective``, ``nxd_loss_type``, ``nxd_reference``, written by preference runs):
    ``{"name", "loss_type", "reference"}``, or None where it records none (SFT, PEFT's adapters)."""
    meta = check_safetensors_header(files["adapter_model.safetensors"]).get("__metadata__") or {}
    if not isinstance(meta, dict) or not meta.get("nxd_objective"):
        return None
    return {"name": meta["nxd_objective"], "loss_type": meta.get("nxd_loss_type"),
            "reference": meta.get("nxd_reference")}


def build_manifest(
    name: str, version: int, base_model: JsonObject, files: dict[str, FileEntry], meta: PushMetadata
) -> AdapterManifest:
    """The manifest dict for ``name:version`` (see the module docstring); ``base_model``: the
    adapter's :func:`adapter_base`, under the caller's ``meta["base_model"]`` keys."""
    base = {**base_model, **(meta.get("base_model") or {})}
    return {
        "format": FORMAT,
        "name": name,
        "version": version,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "tool": {"name": "nxd-finetune", "version": nxd_finetune.__version__},
        "files": files,
        "base_model": base,
        "recipe": meta.get("recipe"),
        "metrics": meta.get("metrics"),
        "parallel": meta.get("parallel"),
        "lineage": meta.get("lineage"),
        "objective": meta.get("objective"),
    }


def parse_manifest(data: bytes, where: str) -> AdapterManifest:
    """Decode and sanity-check a stored manifest; anything off raises :class:`RegistryError`."""
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise RegistryError(f"{where} is not valid JSON") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise RegistryError(f"{where} is not an {FORMAT} manifest")
    for fname, entry in manifest["files"].items():
        check_file_name(fname)
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("sha256"), str)
            or not isinstance(entry.get("size"), int)
        ):
            raise RegistryError(f"{where}: bad entry for {fname!r}")
    return cast(AdapterManifest, manifest)  # format and file entries checked above


def dumps(obj: object) -> bytes:
    """Stable, human-readable JSON bytes (sorted keys, 2-space indent, trailing newline)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()

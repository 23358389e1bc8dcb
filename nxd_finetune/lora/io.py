"""Adapter files in PEFT's format (the save modes are written by :mod:`nxd_finetune.export`).

An adapter directory is what ``peft.PeftModel.save_pretrained`` writes: ``adapter_config.json``
and ``adapter_model.safetensors`` keyed ``base_model.model.<module>.lora_A.weight`` /
``.lora_B.weight`` (no adapter name), ``modules_to_save`` modules under their own keys
(``base_model.model.lm_head.weight``) and, with ``bias`` other than ``none``, the trained biases
under their model names (``...q_proj.base_layer.bias``, ``...k_proj.bias``).

Tensor-parallel models: the files are those of the unsharded model. ``load_adapter`` reads only
this rank's slice of each sharded tensor (the ``placements`` of the model's layers say which);
:func:`gather_adapter_state_dict` and ``save_adapter(..., state=)`` gather the full tensors.

Only JSON and safetensors are read; nothing is unpickled (``adapter_model.bin`` is refused).
Files are written under temporary names and renamed, so a crash never leaves a half file under
the final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save
from torch import nn

from nxd_finetune.errors import AdapterError
from nxd_finetune.jsontypes import JsonObject, JsonValue
from nxd_finetune.lora.config import ALL_LINEAR, LoraConfig
from nxd_finetune.lora.dora import MAGNITUDE, DoraLinear
from nxd_finetune.lora.identity import CONFIG_HASH_KEY, base_identity
from nxd_finetune.lora.inject import (
    OUTPUT_LAYER,
    inject_lora,
    lora_modules,
    lora_target_names,
    saved_modules,
)
from nxd_finetune.models.config import LANGUAGE_MODEL_PREFIX, DecoderConfig, text_model_name
from nxd_finetune.parallel.placement import Placement, gather_full, iter_placements

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nxd_finetune.parallel.state import ParallelState

PEFT_PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def _owner(key: str, owners: Mapping[str, nn.Module]) -> tuple[str, str] | None:
    """Split ``key`` into (owner module name, rest) for the innermost owner holding it."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in owners:
            return prefix, ".".join(parts[i:])
    return None


def lora_state_dict(model: nn.Module, bias: str = "none") -> dict[str, torch.Tensor]:
    """The adapter's tensors under the model's own parameter names (for training checkpoints).

    LoRA factors, ``modules_to_save`` copies (``<name>.modules_to_save.<param>``) and, per ``bias``
    (``none|all|lora_only``, PEFT's selection), biases. Tensors are detached, not copied.
    """
    sd = model.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for name, m in lora_modules(model):
        out[f"{name}.lora_A.weight"] = m.lora_A.weight
        out[f"{name}.lora_B.weight"] = m.lora_B.weight
        magnitude = m._parameters.get(MAGNITUDE)
        if magnitude is not None:  # DoRA's, under PEFT's file key
            out[f"{name}.{MAGNITUDE}"] = magnitude
        if bias == "lora_only" and m.bias is not None:
            out[f"{name}.base_layer.bias"] = m.bias
    wrappers = dict(saved_modules(model))
    for name, w in wrappers.items():
        for k in w.modules_to_save.state_dict():
            out[f"{name}.modules_to_save.{k}"] = sd[f"{name}.modules_to_save.{k}"]
    if bias == "all":
        for k, t in sd.items():
            if k.endswith(".bias") and _owner(k, wrappers) is None:
                out[k] = t
    return {k: v.detach() for k, v in out.items()}


def adapter_state_dict(model: nn.Module, bias: str = "none") -> dict[str, torch.Tensor]:
    """:func:`lora_state_dict` under PEFT's file keys: ``base_model.model.`` prefix, and
    ``modules_to_save`` copies under the module's own name (``lm_head.weight``). On a
    tensor-parallel model these are this rank's shards (see :func:`gather_adapter_state_dict`)."""
    return _peft_keys(model, lora_state_dict(model, bias))


def gather_adapter_state_dict(model: nn.Module, state: ParallelState, bias: str = "none") -> dict[str, torch.Tensor]:
    """:func:`adapter_state_dict` of a tensor-parallel model with every sharded tensor gathered: the
    keys, shapes and values of a tp=1 model with the same adapter, on every TP rank (rank 0 writes).

    Collective over the axes each tensor is sharded on (one all-gather per sharded tensor and axis,
    in module order): every rank calls it. Replicated tensors are the local copy. DP replicas get
    equal dicts. Pipeline parallel: each stage's dict holds only its layers' keys; union the stages'
    dicts before writing.
    """
    placements = {name: placement for name, _, _, placement in iter_placements(model)}
    local = lora_state_dict(model, bias)
    full = {k: gather_full(t, placements[k], state) if k in placements else t for k, t in local.items()}
    return _peft_keys(model, full)


def _peft_keys(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's file keys: the prefix, ``modules_to_save`` copies under the module's name, and a
    multimodal model's names for its language model (:meth:`DecoderConfig.module_name`)."""
    wrappers = dict(saved_modules(model))
    config = getattr(model, "config", None)
    out = {}
    for k, t in tensors.items():
        owner = _owner(k, wrappers)
        if owner is not None:
            k = f"{owner[0]}.{owner[1].removeprefix('modules_to_save.')}"
        out[PEFT_PREFIX + (config.module_name(k) if isinstance(config, DecoderConfig) else k)] = t
    return out


def _resolved_targets(cfg: LoraConfig, names: list[str], multimodal: bool = False) -> list[str] | str:
    """``target_modules`` for ``adapter_config.json``. A multimodal model's: a regex naming exactly
    the wrapped language-model modules, so PEFT (which matches short names anywhere) and vLLM
    leave the vision tower alone."""
    if multimodal:
        return language_model_regex(names)
    if cfg.target_modules != ALL_LINEAR:
        return cfg.target_modules
    return sorted({name.rpartition(".")[2] for name in names})


def language_model_regex(names: list[str]) -> str:
    r"""A regex that ``re.fullmatch``-es the transformers names of exactly our modules ``names``
    in a multimodal model: ``model\.language_model\.layers\.(?:0|1)\.(?:mlp\.down_proj|...)``
    when every listed layer holds the same modules, else the names one by one."""
    parsed = [re.fullmatch(r"model\.layers\.(\d+)\.(.+)", n) for n in names]
    pairs = {(m.group(1), m.group(2)) for m in parsed if m}
    layers = sorted({int(layer) for layer, _ in pairs})
    suffixes = sorted({suffix for _, suffix in pairs})
    if all(parsed) and len(pairs) == len(layers) * len(suffixes):
        return (re.escape(LANGUAGE_MODEL_PREFIX) + r"layers\.(?:" + "|".join(map(str, layers)) + r")\.(?:"
                + "|".join(re.escape(s) for s in suffixes) + ")")
    hf = [(LANGUAGE_MODEL_PREFIX + n.removeprefix("model.")) if n.startswith("model.") else n for n in names]
    return "(?:" + "|".join(re.escape(n) for n in sorted(hf)) + ")"


def _write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` into ``<path>.tmp``, then rename it to ``path``. A failed write (a full disk)
    removes the temp file and names ``path`` in the OSError (a failed ``write(2)`` names none)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    os.replace(tmp, path)


def save_adapter(
    model: nn.Module,
    cfg: LoraConfig,
    out_dir: str | Path,
    base_model_name_or_path: str | None,
    extra_config: Mapping[str, JsonValue] | None = None,
    revision: str | None = None,
    config_hash: str | None = None,
    *,
    state: ParallelState | None = None,
    base_dir: str | Path | None = None,
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT does.

    ``"all-linear"`` is written as the sorted short names of the wrapped modules (PEFT also writes
    the resolved names). ``config_hash`` (a hash of the base model's config; defaults to
    ``model.config.config_hash()`` when the model has one) goes into the safetensors header's
    metadata under ``nxd_config_hash``, where PEFT does not look (:func:`adapter_config_hash` reads
    it), so ``adapter_config.json`` holds PEFT's keys only. ``extra_config`` keys are added to the
    JSON (PEFT warns about keys it does not know). ``base_dir``: the checkpoint the model was
    loaded from; its identity (:func:`nxd_finetune.lora.identity.base_identity`) is recorded too,
    so ``lora.init_from`` and ``merge`` can refuse another base. Returns the
    directory. Raises AdapterError when the model holds no LoRA layer.

    ``state``: the ``ParallelState`` of a tensor-parallel model. The tensors are gathered
    (:func:`gather_adapter_state_dict`, collective: every rank of the TP group calls this) and
    only TP rank 0 of data-parallel rank 0 writes, so the files equal a tp=1 run's; other ranks
    return without writing (a caller that reads the files on them barriers first). Raises
    AdapterError with ``state.size("pp") > 1`` (a stage holds only part of the adapter). The files
    are written by :func:`write_adapter_files`, the exporter's writer (full tensors in, files out).
    """
    if next(lora_modules(model), None) is None:
        raise AdapterError("the model has no LoRA layers to save; call inject_lora first")
    if state is not None and state.size("pp") > 1:
        raise AdapterError(
            "save_adapter with pipeline parallel: union the stages' gather_adapter_state_dict before writing"
        )
    config = getattr(model, "config", None)
    if config_hash is None and config is not None and hasattr(config, "config_hash"):
        config_hash = config.config_hash()
    sd = adapter_state_dict(model, cfg.bias) if state is None else gather_adapter_state_dict(model, state, cfg.bias)
    names = lora_target_names(model)  # all-linear's names; expert wrappers are in target_parameters
    if not _is_writer(state):
        _adapter_config(cfg, base_model_name_or_path, revision, names, extra_config)  # same errors on every rank
        return Path(out_dir)
    identity = base_identity(config, base_dir) if base_dir is not None and config is not None else None
    return write_adapter_files(out_dir, cfg, sd, names, base_model_name_or_path, revision=revision,
                               config_hash=config_hash, extra_config=extra_config, identity=identity)


def _adapter_config(cfg: LoraConfig, base_model_name_or_path: str | None, revision: str | None,
                    target_names: list[str], extra_config: Mapping[str, JsonValue] | None,
                    multimodal: bool = False) -> JsonObject:
    d = cfg.to_peft_dict(base_model_name_or_path, revision=revision)
    targets = _resolved_targets(cfg, target_names, multimodal)
    d["target_modules"] = targets if isinstance(targets, str) else list(targets)
    clash = sorted(set(extra_config or {}) & set(d))
    if clash:
        raise AdapterError(f"extra_config key {clash[0]!r} would overwrite an adapter_config.json key")
    d.update(extra_config or {})
    return d


def write_adapter_files(
    out_dir: str | Path,
    cfg: LoraConfig,
    tensors: dict[str, torch.Tensor],
    target_names: list[str],
    base_model_name_or_path: str | None,
    *,
    revision: str | None = None,
    config_hash: str | None = None,
    extra_config: Mapping[str, JsonValue] | None = None,
    identity: dict[str, str] | None = None,
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` from full tensors under PEFT
    file keys (no model needed): what :func:`save_adapter` and the run's exporter write.
    ``target_names``: the wrapped modules of the whole model (resolves ``all-linear``).
    ``identity``: the base's :func:`~nxd_finetune.lora.identity.base_identity`, written into the
    safetensors metadata (with ``config_hash``) where PEFT does not look."""
    out = Path(out_dir)
    multimodal = any(k.startswith(PEFT_PREFIX + LANGUAGE_MODEL_PREFIX) for k in tensors)
    d = _adapter_config(cfg, base_model_name_or_path, revision, target_names, extra_config, multimodal)
    cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **(identity or {}), **({CONFIG_HASH_KEY: config_hash} if config_hash else {})}
    _write_atomic(out / WEIGHTS_NAME, lambda p: p.write_bytes(_safetensors_bytes(cpu, metadata)))
    _write_atomic(out / CONFIG_NAME, lambda p: p.write_text(json.dumps(d, indent=2, sort_keys=True)))
    return out


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """``safetensors.torch.save`` with the metadata keys in sorted order: safetensors keeps the
    metadata in a hash map whose order changes from process to process, and the same adapter must
    be the same bytes (resume and registry pushes compare files byte for byte). Only the order of
    keys inside ``__metadata__`` changes, so the header keeps its length and padding."""
    blob = save(tensors, metadata=metadata)
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > n:  # not the compact JSON safetensors writes: keep its bytes
        return blob
    return blob[:8] + text.ljust(n) + blob[8 + n:]


def adapter_config_hash(adapter_dir: str | Path) -> str | None:
    """The base-config hash an adapter was saved with: ``nxd_config_hash`` in the safetensors
    metadata, or in ``adapter_config.json`` (where older adapters kept it); None for
    PEFT's adapters and unreadable files."""
    d = Path(adapter_dir)
    try:
        with safe_open(d / WEIGHTS_NAME, framework="pt") as f:
            recorded = (f.metadata() or {}).get(CONFIG_HASH_KEY)
        if recorded:
            return recorded
        return json.loads((d / CONFIG_NAME).read_text()).get(CONFIG_HASH_KEY) or None
    except (OSError, ValueError, SafetensorError):
        return None


def _is_writer(state: ParallelState | None) -> bool:
    return state is None or (state.coord("tp") == 0 and state.coord("dp") == 0)


def read_adapter(adapter_dir: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """Read an adapter directory (ours or PEFT's): its config and its tensors, keyed by module
    path with the ``base_model.model.`` prefix removed. Raises AdapterError for a missing or
    unreadable file, a pickle-only adapter, an unsupported config or DoRA magnitudes present
    where the config has no ``use_dora`` (or the reverse)."""
    cfg, weights = _adapter_files(adapter_dir)
    tensors = _read_tensors(weights)
    _check_dora(cfg, tensors, weights)
    return cfg, tensors


def _adapter_files(adapter_dir: str | Path) -> tuple[LoraConfig, Path]:
    """The adapter's config and the path of its safetensors file (checked to exist)."""
    d = Path(adapter_dir)
    cfg_path, weights = d / CONFIG_NAME, d / WEIGHTS_NAME
    if not cfg_path.is_file():
        raise AdapterError(f"no {CONFIG_NAME} in {d}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{cfg_path} is not valid JSON: {e}") from None
    try:
        cfg = LoraConfig.from_peft_dict(raw)
    except AdapterError as e:
        raise AdapterError(f"{cfg_path}: {e}") from None
    if not weights.is_file():
        if (d / "adapter_model.bin").is_file():
            raise AdapterError(
                f"{d} holds only adapter_model.bin (pickle), which is not loaded; re-save it as safetensors"
            )
        raise AdapterError(f"no {WEIGHTS_NAME} in {d}")
    return cfg, weights


def check_adapter_files(adapter_dir: str | Path) -> LoraConfig:
    """The checks every command that reads an adapter makes before using it, without reading
    tensor data: ``adapter_config.json`` is a JSON object that :meth:`LoraConfig.from_peft_dict`
    accepts (types, values, no unsupported PEFT feature), and ``adapter_model.safetensors`` has a
    header that ``safetensors`` accepts (tensors inside the file, contiguous, not overlapping,
    sizes that fit their shapes) and holds DoRA magnitudes exactly when the config says ``use_dora``.
    Returns the config; raises AdapterError with one line.
    ``merge`` and ``lora.init_from`` make them through :func:`read_adapter` / :func:`load_adapter`,
    ``generate`` / ``chat`` call this before handing the directory to PEFT."""
    cfg, weights = _adapter_files(adapter_dir)
    with _open_weights(weights) as f:
        _check_dora(cfg, f.keys(), weights)
    return cfg


def _check_dora(cfg: LoraConfig, keys: Iterable[str], weights: Path) -> None:
    """AdapterError unless the file holds DoRA magnitudes exactly when the config says ``use_dora``."""
    dora = any(k.endswith("." + MAGNITUDE) for k in keys)
    if dora != cfg.use_dora:
        raise AdapterError(f"{weights}: adapter_config.json has use_dora={cfg.use_dora} but the file holds "
                           f"{'' if dora else 'no '}{MAGNITUDE} tensors")


@contextlib.contextmanager
def _open_weights(path: Path) -> Iterator[Any]:
    """``safe_open(path)``, whose refusal of the file (header, offsets, sizes) is an AdapterError."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"cannot read {path}: {e}") from None
    with handle as f:
        yield f


def _read_tensors(
    path: Path, select: Callable[[str, tuple[int, ...]], Placement | None] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, keyed without the ``base_model.model.`` prefix.
    ``select(key, shape)`` returns the placement of the part to read (a rank's shard) or None for all of
    it; it may raise AdapterError."""
    out = {}
    try:
        with _open_weights(path) as f:
            for raw in f.keys():
                key = text_model_name(raw.removeprefix(PEFT_PREFIX))
                part = f.get_slice(raw)
                index = select(key, tuple(part.get_shape())) if select else None
                out[key] = index.take(part) if index is not None else f.get_tensor(raw)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"cannot read {path}: {e}") from None
    return out


def load_adapter(model: nn.Module, adapter_dir: str | Path, inject: bool = True) -> LoraConfig:
    """Load an adapter (ours or PEFT's) into ``model``; returns the adapter's config.

    ``inject=True``: wrap the model as the adapter's config says, then load. ``inject=False``: the
    model already holds LoRA layers (e.g. injected from a recipe); their scaling must equal the
    adapter's. Every tensor is checked before any is copied: a key the model lacks, a tensor the
    adapter lacks, or a shape that differs raises AdapterError naming the tensor (and both shapes).
    Values are cast to each parameter's dtype and device. After an error with ``inject=True`` the
    model stays injected, with fresh (zero-B, output-preserving) adapters.

    A tensor-parallel model (layers with ``placements``) takes the unsharded file: each rank
    checks the full shape and reads only its slice. No collective.
    """
    cfg, weights = _adapter_files(adapter_dir)
    if inject:
        inject_lora(model, cfg)
    else:
        modules = list(lora_modules(model))
        if not modules:
            raise AdapterError("the model has no LoRA layers; load with inject=True")
        for name, m in modules:
            if abs(m.scaling - cfg.scaling) > 1e-9 * max(1.0, abs(cfg.scaling)):
                raise AdapterError(f"adapter scaling {cfg.scaling:g} differs from {name}'s {m.scaling:g}")
            if isinstance(m, DoraLinear) != cfg.use_dora:
                raise AdapterError(f"adapter has use_dora={cfg.use_dora} but {name} is "
                                   f"{'a DoRA' if isinstance(m, DoraLinear) else 'a plain LoRA'} layer")
    params = dict(model.named_parameters(remove_duplicate=False))
    wrappers = dict(saved_modules(model))
    # any bias may come along (PEFT loads them whatever the bias mode); base weights may not
    allowed = set(lora_state_dict(model, "all")) | {n for n in params if n.endswith(".bias")}
    specs = {n: placement for n, _, _, placement in iter_placements(model) if placement.sharded}
    names: dict[str, str] = {}  # adapter key -> parameter name

    def select(key: str, shape: tuple[int, ...]) -> Placement | None:
        name = key
        if name not in allowed:
            owner = _owner(key, wrappers)
            name = f"{owner[0]}.modules_to_save.{owner[1]}" if owner else key
        if name not in allowed:
            raise AdapterError(f"adapter tensor {key!r} has no counterpart among the model's adapter parameters")
        spec = specs.get(name)
        want = spec.full_shape if spec else tuple(params[name].shape)
        if shape != want:
            raise AdapterError(f"adapter tensor {key!r} has shape {shape}, the model expects {want}")
        names[key] = name
        return spec

    targets = {names[k]: (k, t) for k, t in _read_tensors(weights, select).items()}
    missing = sorted(set(lora_state_dict(model, cfg.bias)) - set(targets))
    if missing:
        raise AdapterError(f"adapter {adapter_dir} lacks tensor {missing[0]!r} ({len(missing)} missing)")
    merged = [m for _, m in lora_modules(model) if m.merged]
    for m in merged:
        m.unmerge()
    with torch.no_grad():
        for name, (_, tensor) in targets.items():
            p = params[name]
            p.copy_(tensor.to(device=p.device, dtype=p.dtype))
    for _, m in lora_modules(model):
        if isinstance(m, DoraLinear):
            m.magnitude_pending = False  # loaded
    for m in merged:
        m.merge()
    return cfg


# ----------------------------------------------------------------------------- save modes


def _needs_untie(model: nn.Module, config: DecoderConfig) -> bool:
    changed = {n for n, _ in lora_modules(model)} | {n for n, _ in saved_modules(model)}
    return bool(config.tie_word_embeddings) and any(n == OUTPUT_LAYER or n.endswith(".embed_tokens") for n in changed)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase | str | Path | None, out_dir: str | Path) -> None:
    """Write tokenizer files to ``out_dir``: ``tokenizer`` is a directory (its tokenizer files are
    copied), an object with ``save_pretrained``, or None (nothing is written)."""
    if tokenizer is None:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(out))
        return
    src = Path(tokenizer)
    files = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not files:
        raise AdapterError(f"no tokenizer files in {src}")
    for f in files:
        shutil.copyfile(f, out / f.name)

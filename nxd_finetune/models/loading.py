"""Reading and writing HF checkpoints (safetensors, single file or sharded with an index).

The model is built on the meta device and materialised tensor by tensor, so at no point are two
copies of a weight in memory. ``materialize`` takes a ``reader`` hook: the default reads whole
tensors; the parallel code passes one that reads only this rank's slice through
``safe_open(...).get_slice``, so no rank ever holds the full model.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nxd_finetune.errors import ModelLoadError
from nxd_finetune.models.config import DecoderConfig
from nxd_finetune.models.llama import DecoderForCausalLM
from nxd_finetune.models.moe import Experts
from nxd_finetune.safetensors_io import Entry, FileTensors, header_bytes, write_tensor

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}



class TensorSlice(Protocol):
    """A tensor of a safetensors file not read yet (``safe_open(...).get_slice(name)``): its shape,
    and the part an index selects, read when indexed."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: slice | tuple[slice, ...]) -> torch.Tensor: ...


# reader(name, safe_slice, target_param) -> tensor of target_param's shape
Reader = Callable[[str, TensorSlice, torch.Tensor], torch.Tensor]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return DTYPES[dtype]


@contextlib.contextmanager
def open_checkpoint_file(path: str | Path) -> Iterator[safe_open]:
    """``safe_open(path)`` whose failure (a truncated or damaged file, not safetensors, missing) is
    one ModelLoadError line naming the file instead of safetensors' own error."""
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ModelLoadError(f"cannot read checkpoint file {path}: {reason} (truncated, damaged or not "
                             "safetensors?)") from None
    with handle as f:
        yield f


class CheckpointFile(Protocol):
    """An open safetensors file as :func:`materialize` reads it: ``safe_open``'s, or :class:`FileTensors`."""

    def get_slice(self, key: str) -> TensorSlice: ...


@contextlib.contextmanager
def open_unmapped_file(path: str | Path) -> Iterator[FileTensors]:
    """:func:`open_checkpoint_file` without a memory map (:class:`FileTensors`: each tensor read into
    memory of its own by plain file reads), with the same one ModelLoadError line for a bad file."""
    try:
        handle = FileTensors(path)
    except (ValueError, OSError) as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ModelLoadError(f"cannot read checkpoint file {path}: {reason} (truncated, damaged or not "
                             "safetensors?)") from None
    try:
        yield handle
    finally:
        handle.close()


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of an HF checkpoint directory to the safetensors file holding it."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return {str(name): model_dir / fname for name, fname in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a safetensors index (a weight_map of tensor -> file): "
                                 f"{type(e).__name__}") from None
    if single.is_file():
        with open_checkpoint_file(single) as f:
            return {name: single for name in f.keys()}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pth")):
        raise ModelLoadError(f"{model_dir} holds only pickle checkpoints; convert them to safetensors")
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def check_checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """:func:`checkpoint_index` with every file it names opened by ``safetensors``, which checks
    each header (tensors inside the file, contiguous, not overlapping, sizes that fit their
    shapes) without reading tensor data; returns the index. A refused file is one ModelLoadError
    line (:func:`open_checkpoint_file`), as ``merge`` and the trainer's loader report it; ``generate``
    and ``chat`` call this before handing the directory to ``transformers``."""
    index = checkpoint_index(model_dir)
    for path in sorted(set(index.values())):
        with open_checkpoint_file(path):
            pass
    return index


def _read_full(name: str, safe_slice: TensorSlice, target: torch.Tensor) -> torch.Tensor:
    return safe_slice[:]


def checkpoint_key(config: DecoderConfig, name: str, index: Mapping[str, object]) -> str:
    """The key of our tensor ``name`` in a checkpoint whose keys are ``index``: the first of
    :meth:`DecoderConfig.checkpoint_keys` it holds (the first one when it holds none)."""
    keys = config.checkpoint_keys(name)
    return next((k for k in keys if k in index), keys[0])


def materialize(
    model: nn.Module,
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    reader: Reader = _read_full,
    name_map: Callable[[str], str] | None = None,
    on_loaded: Callable[[nn.Module, str], None] | None = None,
    mapped: bool = True,
) -> nn.Module:
    """Replace every meta parameter of ``model`` with its tensor from the checkpoint.
    ``on_loaded(module, attr)``: called right after each tensor is set (a quantized base quantizes
    a linear there, so the file's dtype is held one tensor at a time). ``mapped``: read through
    safetensors' memory map (unsharded tensors are zero-copy views of it, paged in when first
    used); False: every tensor read into memory of its own by plain file reads
    (:func:`open_unmapped_file`), so no page a read touched stays resident in the process once the
    tensor is dropped, as a quantized base drops each linear's weight in the file's dtype.

    ``name_map`` turns a module parameter name into a checkpoint key (LoRA-wrapped models map
    ``...q_proj.base_layer.weight`` to ``...q_proj.weight``), which :func:`checkpoint_key` turns
    into the multimodal checkpoint's key when the model's config is one (other tensors there, the
    vision tower's, are not read). Parameters the checkpoint lacks but
    that are tied (``lm_head.weight`` with tied embeddings) are re-tied afterwards; any other
    missing tensor or a shape mismatch raises ModelLoadError naming the tensor.
    """
    index = checkpoint_index(model_dir)
    config = getattr(model, "config", None)
    tied = getattr(config, "tie_word_embeddings", False)
    by_file: dict[Path, list[tuple[str, str, nn.Module, str]]] = {}
    experts: list[tuple[nn.Module, str, tuple[tuple[str, ...], ...]]] = []
    # tied: tie_weights shares the embedding, so a checkpoint's own lm_head.weight is not read (as
    # transformers ignores it); a pipeline stage without the embedding reads the head
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    for full_name, param in list(model.named_parameters(remove_duplicate=False)):
        if tied and full_name == "lm_head.weight" and embedding is not None:
            continue
        name = name_map(full_name) if name_map else full_name
        key = checkpoint_key(config, name, index) if isinstance(config, DecoderConfig) else name
        module_name, _, attr = full_name.rpartition(".")
        module = model.get_submodule(module_name)
        parts = config.expert_keys(name) if isinstance(config, DecoderConfig) and key not in index else None
        if parts is not None and all(k in index for group in parts for k in group):
            held = module.held if isinstance(module, Experts) else range(len(parts[0]))  # expert parallel: its own
            experts.append((module, attr, tuple(tuple(group[e] for e in held) for group in parts)))
            continue
        if key not in index:
            if tied and name == "lm_head.weight":
                continue
            if param.device.type != "meta":
                continue  # built fresh (e.g. LoRA matrices), not a checkpoint tensor
            raise ModelLoadError(f"checkpoint {model_dir} is missing tensor {key!r}")
        by_file.setdefault(index[key], []).append((full_name, key, module, attr))
    used: set[str] = set()
    for path, entries in by_file.items():
        opened: contextlib.AbstractContextManager[CheckpointFile] = (
            open_checkpoint_file(path) if mapped else open_unmapped_file(path))
        with opened as f:
            for _, key, module, attr in entries:
                target = getattr(module, attr)
                tensor = reader(key, f.get_slice(key), target)
                if key in used:  # two parameters from one key (a module_to_save copy): never alias
                    tensor = tensor.clone()
                used.add(key)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ModelLoadError(
                        f"tensor {key!r} has shape {tuple(tensor.shape)} in the checkpoint, "
                        f"the model expects {tuple(target.shape)}"
                    )
                setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=dtype),
                                                  requires_grad=target.requires_grad))
                if on_loaded is not None:
                    on_loaded(module, attr)
    for module, attr, parts in experts:
        target = getattr(module, attr)
        tensor = _read_experts(index, parts, model_dir)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelLoadError(f"experts {parts[0][0]!r}... make shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(target.shape)}")
        setattr(module, attr, nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=target.requires_grad))
    tie_weights = getattr(model, "tie_weights", None)
    if tie_weights is not None:
        tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise ModelLoadError(f"checkpoint {model_dir} is missing tensor {leftover[0]!r}")
    return model


def _read_experts(index: Mapping[str, Path], parts: tuple[tuple[str, ...], ...], model_dir: str | Path) -> torch.Tensor:
    """A fused expert tensor from its per-expert checkpoint tensors (:meth:`DecoderConfig.expert_keys`):
    each group's experts stacked, the groups (gate, up) concatenated along dim 1. ``parts`` name the
    experts this rank holds only (under expert parallel), so no rank reads another's."""
    by_file: dict[Path, list[str]] = {}
    for key in (k for group in parts for k in group):
        by_file.setdefault(index[key], []).append(key)
    read: dict[str, torch.Tensor] = {}
    for path, keys in by_file.items():
        with open_checkpoint_file(path) as f:
            read.update((key, f.get_tensor(key)) for key in keys)
    shapes = {tuple(t.shape) for t in read.values()}
    if len(shapes) != 1:
        raise ModelLoadError(f"checkpoint {model_dir}: the tensors of experts {parts[0][0]!r}... differ in shape "
                             f"({sorted(shapes)})")
    return torch.cat([torch.stack([read[k] for k in group]) for group in parts], dim=1)


def checkpoint_shapes(config: DecoderConfig, name: str, shape: Iterable[int],
                      index: Mapping[str, object]) -> dict[str, list[int]]:
    """The checkpoint keys our tensor ``name`` (of ``shape``) is read from, with each one's shape: its
    :func:`checkpoint_key`, or a fused expert tensor's per-expert keys when the checkpoint holds those
    (what ``validate`` checks in the headers)."""
    shape = list(shape)
    key = checkpoint_key(config, name, index)
    parts = config.expert_keys(name) if key not in index else None
    if parts is None:
        return {key: shape}
    part = [shape[1] // len(parts), *shape[2:]]
    return {k: part for group in parts for k in group}


def split_experts(config: DecoderConfig, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Our tensor ``name`` as the checkpoint keys transformers writes: a fused expert tensor one
    tensor per expert (the inverse of :func:`_read_experts`), the router under the family's block
    name; any other tensor itself."""
    parts = config.expert_keys(name)
    if parts is None:
        return [(config.checkpoint_keys(name)[-1] if config.num_experts else name, tensor)]
    halves = tensor.chunk(len(parts), dim=1)
    return [(key, half[e]) for group, half in zip(parts, halves, strict=True) for e, key in enumerate(group)]


def build_model(config: DecoderConfig, device: str | torch.device = "meta") -> DecoderForCausalLM:
    """Construct the model; on the meta device by default (no memory, shapes only)."""
    with torch.device(device):
        return DecoderForCausalLM(config)


def load_pretrained(
    model_dir: str | Path, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DecoderForCausalLM:
    """Load an HF checkpoint directory into :class:`DecoderForCausalLM`."""
    config = DecoderConfig.from_hf(model_dir)
    model = build_model(config)
    materialize(model, model_dir, resolve_dtype(dtype), device)
    return model


COPY_CHUNK = 8 * 2**20


@contextlib.contextmanager
def _temporary(data: Path, shards: list[tuple[Path, list[str]]]) -> Iterator[None]:
    """Remove the data file on leaving, and the shards written so far if the block fails."""
    try:
        yield
    except BaseException:
        for tmp, _ in shards:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        data.unlink(missing_ok=True)


def save_pretrained(
    config: DecoderConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Write an HF checkpoint: ``config.json`` plus safetensors shards (with an index when more
    than one). ``tensors`` may be a generator, and is consumed as it is written: each tensor's bytes
    go to a temporary data file as it arrives, and a shard is assembled (its header, then those
    bytes, copied in 8 MiB pieces) once it is full, so peak memory is one tensor (plus what the
    generator holds), never a shard or the model. Shards are written under temporary names and
    renamed once their count is known; an error removes them, so none is left named as a complete one.
    ``lm_head.weight`` is skipped for tied-embedding configs, as HF does; a mixture-of-experts model's
    fused expert tensors and router are written under the per-expert keys transformers writes
    (:func:`split_experts`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[tuple[Path, list[str]]] = []  # (temp file, tensor names) per shard
    entries: list[Entry] = []
    size = total = 0
    data_path = out / ".shard-data.tmp"

    with _temporary(data_path, written), open(data_path, "w+b") as data:

        def flush() -> None:
            tmp = out / f".shard-{len(written):05d}.safetensors.tmp"
            data.flush()
            with open(tmp, "wb") as f:
                f.write(header_bytes(entries, {"format": "pt"}))
                data.seek(0)
                shutil.copyfileobj(data, f, COPY_CHUNK)
            written.append((tmp, [key for key, _, _ in entries]))
            data.seek(0)
            data.truncate()

        for name, t in ((key, part) for n, full in tensors for key, part in split_experts(config, n, full)):
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue
            t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
            nbytes = t.numel() * t.element_size()
            if entries and size + nbytes > max_shard_bytes:
                flush()
                entries, size = [], 0
            write_tensor(data, t)
            entries.append((name, t.dtype, tuple(t.shape)))
            size += nbytes
            total += nbytes
            del t
        if entries or not written:
            flush()
    n = len(written)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    for fname, (tmp, keys) in zip(names, written, strict=True):
        os.replace(tmp, out / fname)
        weight_map.update(dict.fromkeys(keys, fname))
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = config.to_hf()
    if dtype is not None:  # the source's key (transformers 5 writes "dtype", 4.x "torch_dtype")
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["torch_dtype"]
        cfg.update(dict.fromkeys(keys, name))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


GENERATION_CONFIG = "generation_config.json"


def copy_generation_config(source_dir: str | Path, out_dir: str | Path) -> None:
    """Copy the source checkpoint's ``generation_config.json`` (eos ids, sampling defaults) into an
    HF checkpoint written from it, byte for byte; nothing when the source has none."""
    src = Path(source_dir) / GENERATION_CONFIG
    if src.is_file():
        shutil.copyfile(src, Path(out_dir) / GENERATION_CONFIG)

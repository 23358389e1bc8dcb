"""Finding and reading NxD's sharded checkpoints, as ``neuronx_distributed/trainer/checkpoint.py``
writes them::

    <dir>/<tag>/checkpoint                          marker: a checkpoint directory
    <dir>/<tag>/done                                marker: the save completed
    <dir>/<tag>/model/dp_rank_00_tp_rank_YY_pp_rank_ZZ.pt        one per tp x pp rank
    <dir>/<tag>/model/dp_rank_00_tp_rank_YY_pp_rank_ZZ.pt.tensors/tensor_N.pt   (save_xser only)
    <dir>/<tag>/model/dp_rank_00_ep_rank_XX_tp_rank_YY_pp_rank_ZZ.pt  expert parallel: one per ep x tp x pp
    <dir>/<tag>/optim/..., scheduler.pt, user_content.pt         (not read)

A ``.pt`` file is read with ``torch.load(weights_only=True)`` only. With ``save_xser`` the model
file holds ``torch_xla``'s ``TensorReference(tid)`` objects in place of tensors, each tensor in
``<file>.tensors/tensor_<tid>.pt``: the one class allowed beyond tensors and containers is a
stand-in with that class's name, which holds the id and nothing else. Anything else that needs
a full unpickler is refused with one line. Under expert parallel (``expert_model_parallel_size``
> 1) every ep rank's model file names every tensor, but with ``save_xser`` only ep rank 0 writes
the tensors that are not its experts' (``_xser_save_data``); NxD's ``_xser_load_data`` reads
those from ep rank 0's ``.tensors`` folder, and so does :func:`read_shard`.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nxd_finetune.errors import ModelLoadError

# the ``lora_config`` dict NxD's LoRA pickles beside an adapter (NxD's keys and values, unchecked)
SavedLoraConfig = dict[str, Any]

SHARD = re.compile(r"^dp_rank_(\d+)(?:_ep_rank_(\d+))?_tp_rank_(\d+)_pp_rank_(\d+)\.pt$")
DONE, MARKER = "done", "checkpoint"


class TensorReference:
    """Stand-in for ``torch_xla.utils.serialization.TensorReference``: the id of a tensor that
    ``xser.save`` wrote to ``tensor_<tid>.pt``. Allowed by name in the weights-only unpickler."""

    tid: int


TensorReference.__module__ = "torch_xla.utils.serialization"


def find_tag(path: str | Path) -> Path:
    """The checkpoint (tag) directory for ``path``: a tag directory, its ``model/`` directory, or
    a checkpoint root holding tags (the newest complete one, as NxD's ``load_checkpoint`` picks).
    Raises ModelLoadError when there is none or the tag has no ``done`` marker."""
    p = Path(path)
    if not p.is_dir():
        raise ModelLoadError(f"NxD checkpoint directory not found: {p}")
    if p.name == "model" and any(SHARD.match(f.name) for f in p.iterdir()):
        p = p.parent
    if not (p / "model").is_dir():
        tags = [d for d in p.iterdir() if d.is_dir() and (d / "model").is_dir()]
        done = sorted((d for d in tags if (d / DONE).is_file()), key=lambda d: ((d / DONE).stat().st_mtime, d.name))
        if not done:
            what = f"{len(tags)} checkpoint(s) without a 'done' marker" if tags else "no <tag>/model/ directory"
            raise ModelLoadError(f"{p} holds no complete NxD checkpoint ({what})")
        p = done[-1]
    if not (p / DONE).is_file():
        raise ModelLoadError(f"{p} is an incomplete NxD checkpoint: no 'done' marker (the save did not finish)")
    return p


def shard_files(tag: Path) -> dict[tuple[int, int], tuple[Path, ...]]:
    """(tp_rank, pp_rank) -> the model files of ``tag`` for that rank, one per expert-parallel rank
    in ep order (one file where the checkpoint has no ep ranks); every rank of the ep x tp x pp
    grid must be there, and no file may be a symlink leading out of ``tag``."""
    found: dict[tuple[int, int, int], Path] = {}
    plain = expert = False
    for f in sorted((tag / "model").iterdir()):
        m = SHARD.match(f.name)
        if not m or int(m.group(1)) != 0:
            continue  # model files are written by dp rank 0
        expert = expert or m.group(2) is not None
        plain = plain or m.group(2) is None
        found[(int(m.group(2) or 0), int(m.group(3)), int(m.group(4)))] = inside(f, tag)
    if not found:
        raise ModelLoadError(f"{tag / 'model'} holds no dp_rank_00_tp_rank_XX_pp_rank_YY.pt file")
    if plain and expert:
        raise ModelLoadError(f"{tag / 'model'} holds files with and without ep_rank in their names: two "
                             "checkpoints in one directory")
    ep, tp, pp = (1 + max(r[i] for r in found) for i in range(3))
    missing = [(e, t, p) for e in range(ep) for t in range(tp) for p in range(pp) if (e, t, p) not in found]
    if missing:
        e, t, p = missing[0]
        first = f"ep_rank_{e:02d}_" * expert + f"tp_rank_{t:02d}_pp_rank_{p:02d}"
        grid_ = f"{ep}x{tp}x{pp}" if expert else f"{tp}x{pp}"
        raise ModelLoadError(f"{tag / 'model'} misses {len(missing)} of its {grid_} shards, first {first}")
    return {(t, p): tuple(found[(e, t, p)] for e in range(ep)) for t in range(tp) for p in range(pp)}


def grid(files: Mapping[tuple[int, int], Sequence[Path]]) -> tuple[int, int, int]:
    """(ep, tp, pp) sizes of a complete shard grid."""
    return len(next(iter(files.values()))), 1 + max(t for t, _ in files), 1 + max(p for _, p in files)


def _load(file: Path) -> Any:
    try:
        with open(file, "rb") as f:
            pickled = f.read(1) == b"\x80"  # a legacy torch.save (pickle protocol 2+)
        if not (pickled or zipfile.is_zipfile(file)):
            raise ModelLoadError(f"{file}: not a PyTorch checkpoint (neither torch.save's zip archive nor a pickle)")
        with torch.serialization.safe_globals([TensorReference]):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "Unsupported" in ln or "WeightsUnpickler" in ln), None)
        if first is None:
            raise ModelLoadError(f"{file}: unreadable ({' '.join(lines)[:200]})") from None
        raise ModelLoadError(f"{file}: needs a full unpickler, which is never used on checkpoints "
                             f"(only tensors and plain containers are read): {first}") from None
    except ModelLoadError:
        raise
    except Exception as e:  # a damaged file: the weights-only unpickler's errors are of many types
        raise ModelLoadError(f"{file}: unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def inside(file: Path, root: Path) -> Path:
    """``file`` if it, symlinks followed, lies under ``root``; ModelLoadError where a symlink
    leads out of the checkpoint (a file elsewhere is never read as one of its shards)."""
    if not file.resolve().is_relative_to(root.resolve()):
        raise ModelLoadError(f"{file.name} is a symlink leading out of the checkpoint {root} "
                             f"(to {file.resolve()}): refused")
    return file


def _resolve_refs(obj: Any, folders: Sequence[Path], root: Path) -> Any:
    if isinstance(obj, TensorReference):
        file = next((f / f"tensor_{obj.tid}.pt" for f in folders if (f / f"tensor_{obj.tid}.pt").exists()),
                    folders[0] / f"tensor_{obj.tid}.pt")
        t = _load(inside(file, root))
        if not isinstance(t, torch.Tensor):
            raise ModelLoadError(f"{file} does not hold a tensor")
        return t
    if isinstance(obj, dict):
        return {k: _resolve_refs(v, folders, root) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_resolve_refs(v, folders, root) for v in obj)
    return obj


def read_shard(file: Path, shared: Path | None = None) -> tuple[dict[str, torch.Tensor], SavedLoraConfig | None]:
    """One rank's model file: (tensors by NxD name, the ``lora_config`` dict NxD's LoRA saves
    beside an adapter, or None). A file written with ``save_xser`` has its tensors read from the
    ``.tensors`` folder beside it; ``shared``: ep rank 0's file of the same tp / pp rank, whose
    folder holds the tensors an ep rank > 0 did not write. A state dict nested under ``model``
    (the converter's ``--model_key``) is unwrapped."""
    obj = _load(file)
    folder = file.with_name(file.name + ".tensors")
    if folder.is_dir():
        folders = [folder]
        if shared is not None and shared != file:
            folders.append(shared.with_name(shared.name + ".tensors"))
        obj = _resolve_refs(obj, folders, file.parent)
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict) and not any(
            isinstance(v, torch.Tensor) for v in obj.values()):
        obj = obj["model"]
    if not isinstance(obj, dict):
        raise ModelLoadError(f"{file}: expected a state dict, found {type(obj).__name__}")
    lora_config = obj.pop("lora_config", None)
    tensors: dict[str, torch.Tensor] = {}
    for k, v in obj.items():
        if not isinstance(v, torch.Tensor):
            raise ModelLoadError(f"{file}: entry {k!r} is a {type(v).__name__}, not a tensor")
        tensors[str(k)] = v
    if lora_config is not None and not isinstance(lora_config, dict):
        raise ModelLoadError(f"{file}: lora_config is a {type(lora_config).__name__}, not a mapping")
    return tensors, lora_config

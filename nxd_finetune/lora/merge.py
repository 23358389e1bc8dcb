"""Folding an adapter into an HF checkpoint on disk, one tensor at a time (``nxd-finetune merge``).

Nothing builds the model. The base checkpoint's safetensors headers give names and shapes; each
tensor is then read alone (``safe_open``), changed if the adapter touches it, cast, and handed to
:func:`nxd_finetune.models.save_pretrained`, which writes every shard as soon as it is full. Peak
memory is therefore one output shard, plus a few copies of the largest tensor, plus the adapter.

What changes (PEFT's ``merge_and_unload`` semantics):

- a LoRA target ``<m>.weight`` becomes ``W + scaling * B @ A``, computed in fp32; with DoRA
  (``use_dora``) ``(m / n) * (W + scaling * B @ A)``, ``n`` that sum's row norms (PEFT's merge);
- a fused expert tensor under ``target_parameters`` becomes ``W_e + scaling * B_e @ A_e`` per expert
  (:mod:`nxd_finetune.lora.experts`), in the checkpoint's layout: the fused tensor, or transformers'
  one tensor per expert (and per gate / up half);
- ``modules_to_save`` tensors and trained biases are taken from the adapter as they are;
- a tied ``lm_head`` that the adapter changes (LoRA on ``lm_head``, ``modules_to_save`` on
  ``lm_head`` or ``embed_tokens``) is written untied, with ``tie_word_embeddings: false``.

Fit checks use a meta-device model built from the base's ``config.json`` with the adapter's
config injected, so target matching and expected tensor names are those of ``inject_lora`` /
``save_adapter``; any mismatch raises a one-line :class:`AdapterError`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from nxd_finetune.errors import AdapterError, ModelLoadError, NxdError
from nxd_finetune.lora.config import LoraConfig
from nxd_finetune.lora.dora import MAGNITUDE, dora_fold
from nxd_finetune.lora.experts import ExpertLora
from nxd_finetune.lora.identity import check_base
from nxd_finetune.lora.inject import base_param_name, inject_lora, lora_modules, untied_config
from nxd_finetune.lora.io import (
    PEFT_PREFIX,
    TOKENIZER_FILES,
    _needs_untie,
    adapter_state_dict,
    read_adapter,
    save_tokenizer,
)
from nxd_finetune.models import (
    DecoderConfig,
    build_model,
    checkpoint_index,
    copy_generation_config,
    resolve_dtype,
    save_pretrained,
)
from nxd_finetune.models.loading import checkpoint_key, open_checkpoint_file
from nxd_finetune.storage.atomic import publish_dir

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's "5GB"
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclasses.dataclass
class MergePlan:
    """What a merge writes. ``lora``: base weight key -> (A ``[r, in]``, B ``[out, r]``; or a fused
    expert tensor's ``[E, r, in]``, ``[E, out, r]``);
    ``replace``: base key -> adapter tensor; ``sources``: output key -> base key it starts from
    (``lm_head.weight`` reads the embeddings when a tied head is untied); ``config``: the output
    config (untied when needed)."""

    scaling: float
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]]
    replace: dict[str, torch.Tensor]
    sources: dict[str, str]
    config: DecoderConfig
    magnitude: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # DoRA's, by base key


def _base_shapes(index: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key: (shape, safetensors dtype)}`` from the headers only (no tensor data is read)."""
    by_file: dict[Path, list[str]] = {}
    for key, path in index.items():
        by_file.setdefault(path, []).append(key)
    out = {}
    for path, keys in by_file.items():
        with open_checkpoint_file(path) as f:
            for key in keys:
                s = f.get_slice(key)
                out[key] = (tuple(s.get_shape()), s.get_dtype())
    return out


def plan_merge(
    cfg: LoraConfig,
    tensors: dict[str, torch.Tensor],
    config: DecoderConfig,
    base_shapes: dict[str, tuple[tuple[int, ...], str]],
) -> MergePlan:
    """Check that the adapter (``cfg`` + ``tensors`` from :func:`read_adapter`) fits the base and
    say what to change. Raises AdapterError when a target module does not exist, a tensor has no
    counterpart, is missing or has the wrong shape; ModelLoadError when the base checkpoint lacks a
    tensor its config implies or holds it in another shape."""
    with torch.device("meta"):
        model = build_model(config)
    for p in model.parameters():
        p.requires_grad_(False)
    inject_lora(model, cfg)  # raises when target_modules / modules_to_save match nothing

    # the adapter keys a model with this config saves; PEFT loads any bias an adapter carries
    allowed = {k.removeprefix(PEFT_PREFIX): tuple(t.shape) for k, t in adapter_state_dict(model, "all").items()}
    required = {k.removeprefix(PEFT_PREFIX) for k in adapter_state_dict(model, cfg.bias)}
    untie = _needs_untie(model, config)
    experts = {name: m for name, m in lora_modules(model) if isinstance(m, ExpertLora)}
    del model  # its LoRA factors are real (CPU) tensors: free them before streaming
    for key, t in tensors.items():
        if key not in allowed:
            raise AdapterError(f"adapter tensor {key!r} has no counterpart in the base model")
        if tuple(t.shape) != allowed[key]:
            raise AdapterError(
                f"adapter tensor {key!r} has shape {tuple(t.shape)}, the base model expects {allowed[key]}"
            )
    missing = sorted(set(required) - set(tensors))
    if missing:
        raise AdapterError(f"adapter lacks tensor {missing[0]!r} ({len(missing)} missing)")

    sources = {k: k for k in base_shapes}
    if untie:
        config = untied_config(config)
        sources.setdefault("lm_head.weight", "model.embed_tokens.weight")
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    replace: dict[str, torch.Tensor] = {}
    magnitude = {f"{k.removesuffix(MAGNITUDE)}weight": t for k, t in tensors.items() if k.endswith("." + MAGNITUDE)}
    for key, t in tensors.items():
        wrapper = experts.get(key.removesuffix(".lora_A.weight"))
        if key.endswith(".lora_A.weight") and wrapper is not None:
            module = key.removesuffix(".lora_A.weight")
            _plan_experts(wrapper, module, t, tensors[f"{module}.lora_B.weight"], config, sources, base_shapes, lora)
            continue
        if key.endswith(".lora_A.weight"):
            module = key.removesuffix(".lora_A.weight")
            target = f"{module}.weight"
            lora[target] = (t, tensors[f"{module}.lora_B.weight"])
            want: tuple[int, ...] = (lora[target][1].shape[0], t.shape[1])
        elif key.endswith((".lora_B.weight", "." + MAGNITUDE)):
            continue
        else:
            target = checkpoint_key(config, base_param_name(key), sources)
            replace[target] = t
            want = tuple(t.shape)
        if target not in sources:
            raise ModelLoadError(f"base checkpoint lacks tensor {target!r}, which the adapter changes")
        shape = base_shapes[sources[target]][0]
        if tuple(shape) != tuple(want):
            raise ModelLoadError(f"base tensor {target!r} has shape {tuple(shape)}, its config implies {tuple(want)}")
    return MergePlan(cfg.scaling, lora, replace, sources, config, magnitude)


def _plan_experts(wrapper: ExpertLora, module: str, a: torch.Tensor, b: torch.Tensor, config: DecoderConfig,
                  sources: dict[str, str], base_shapes: dict[str, tuple[tuple[int, ...], str]],
                  lora: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add a fused expert tensor's per-expert factors to ``lora``, keyed as the base checkpoint
    holds the tensor: fused (``[E, r, in]``, ``[E, out, r]``), or one 2D pair per expert and part
    (the gate / up rows of ``gate_up_proj``) under transformers' per-expert keys."""
    e, r = wrapper.num_experts, wrapper.r
    a_e = a.reshape(e, r, a.shape[-1])
    b_e = b.reshape(b.shape[0], r, e).permute(2, 0, 1)
    fused = re.sub(r"(\.base_layer)+$", "", module) + "." + wrapper.parameter_name
    parts = config.expert_keys(fused)
    if fused in sources or parts is None:
        pieces = [(fused, a_e, b_e)]
    else:
        rows = b_e.shape[1] // len(parts)
        pieces = [(k, a_e[i], b_e[i, p * rows:(p + 1) * rows]) for p, group in enumerate(parts)
                  for i, k in enumerate(group)]
    for target, pa, pb in pieces:
        if target not in sources:
            raise ModelLoadError(f"base checkpoint lacks tensor {target!r}, which the adapter changes")
        want = (*pb.shape[:-1], pa.shape[-1])
        shape = base_shapes[sources[target]][0]
        if tuple(shape) != want:
            raise ModelLoadError(f"base tensor {target!r} has shape {tuple(shape)}, its config implies {want}")
        lora[target] = (pa, pb)


def _merged_tensors(
    plan: MergePlan, index: dict[str, Path], dtypes: dict[str, str], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Output tensors one at a time, base files in order; each base tensor is read when needed and
    dropped once yielded (the writer keeps it only until its shard is written)."""
    by_file: dict[Path, list[str]] = {}
    for out_key, src in plan.sources.items():
        by_file.setdefault(index[src], []).append(out_key)
    for path, keys in by_file.items():
        with open_checkpoint_file(path) as f:
            for key in keys:
                out_dtype = dtype or _ST_DTYPES.get(dtypes[plan.sources[key]])
                if key in plan.replace:
                    t = plan.replace[key]
                    yield key, t.to(out_dtype or t.dtype)
                    continue
                w = f.get_tensor(plan.sources[key])
                if key in plan.lora:
                    a, b = plan.lora[key]
                    merged = w.float() + (b.float() @ a.float()) * plan.scaling
                    if key in plan.magnitude:
                        merged = dora_fold(merged, plan.magnitude[key])
                    w = merged.to(out_dtype or w.dtype)
                elif out_dtype is not None:
                    w = w.to(out_dtype)
                yield key, w
                del w


def _with_progress(items: Iterator[tuple[str, torch.Tensor]], total: int, show: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (
        TextColumn("merging"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=console, transient=True, disable=not (show and console.is_terminal)) as bar:
        task = bar.add_task("", total=total)
        for key, t in items:
            bar.update(task, description=key)
            yield key, t
            bar.advance(task)


def merge_adapter(
    adapter_dir: str | Path,
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    base_revision: str | None = None,
    progress: bool = False,
    allow_other_base: bool = False,
) -> Path:
    """Write ``base_dir`` + the adapter in ``adapter_dir`` as a merged HF checkpoint in ``out_dir``.

    ``out_dir`` must not exist or be empty; the checkpoint is written to a temporary sibling and
    renamed, so ``out_dir`` is complete or absent. Output: the base's ``config.json`` (untied when
    needed, its dtype key set to ``dtype``) and ``generation_config.json``, ``model.safetensors`` or
    shards of at most ``max_shard_bytes`` (one larger tensor gets a shard alone) with
    ``model.safetensors.index.json``, and the base's tokenizer files when present. ``dtype``
    (``fp32|bf16|fp16`` or a torch dtype): of every tensor (default: each base tensor's own).
    An adapter trained on another base (:func:`nxd_finetune.lora.identity.check_base`: other
    config keys, or the same config with other weights) raises AdapterError unless
    ``allow_other_base``; a missing fingerprint or another ``base_revision`` is a warning.
    Raises AdapterError / ModelLoadError (see :func:`plan_merge`).
    """
    base_dir, out = Path(base_dir), Path(out_dir)
    out_dtype = resolve_dtype(dtype) if dtype is not None else None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NxdError(f"output directory {out} already exists and is not empty")
    config = DecoderConfig.from_hf(base_dir)
    if config.multimodal:
        archs = config.raw.get("architectures")
        name = archs[0] if isinstance(archs, list) and archs else "checkpoint"
        raise NxdError(f"merge supports text models only; {base_dir} is a multimodal "
                       f"{name} (load the adapter onto it with peft)")
    cfg, tensors = read_adapter(adapter_dir)
    index = checkpoint_index(base_dir)
    shapes = _base_shapes(index)
    try:
        plan = plan_merge(cfg, tensors, config, shapes)
    except (AdapterError, ModelLoadError) as e:
        raise type(e)(f"adapter {adapter_dir} does not fit base {base_dir}: {e}") from None
    check_base(adapter_dir, config, base_dir, where="merge", allow=allow_other_base,
               allow_hint="pass --allow-other-base", revision=base_revision)
    dtypes = {k: d for k, (_, d) in shapes.items()}
    with publish_dir(out) as tmp:
        stream = _with_progress(_merged_tensors(plan, index, dtypes, out_dtype), len(plan.sources), progress)
        save_pretrained(plan.config, stream, tmp, out_dtype, max_shard_bytes)
        copy_generation_config(base_dir, tmp)
        if any((base_dir / f).is_file() for f in TOKENIZER_FILES):
            save_tokenizer(base_dir, tmp)
    return out


def parse_size(text: str | int) -> int:
    """``"5GB"`` (10^9), ``"500MiB"`` (2^20), ``"20KB"``, ``"1000"`` -> bytes, as HF's
    ``max_shard_size``. Raises NxdError for anything else."""
    if isinstance(text, int):
        return text
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    s = str(text).strip().upper()
    number = s.rstrip("KMGTIB")
    unit = s[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value <= 0:
        raise NxdError(f"invalid size {text!r}; use e.g. 5GB, 500MB, 2GiB or a number of bytes")
    return int(value * units[unit])


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "MergePlan", "merge_adapter", "parse_size", "plan_merge"]

"""``nxd-finetune import nxdt-checkpoint``: an NxD checkpoint directory -> HF checkpoint and/or
PEFT adapter, published atomically at ``out``.

What the checkpoint holds decides what is written:

- base weights only (a model trained in full, or ``merge_lora``): an HF checkpoint at ``out``;
- LoRA tensors only: a PEFT adapter at ``out`` whose ``base_model_name_or_path`` is ``base``
  (default: the directory of the model's ``config.json``), with the base's identity recorded where
  that directory holds the weights (what ``lora.init_from`` and ``merge`` check);
- both (``save_lora_base``): ``out/base`` (HF) and ``out/adapter`` (PEFT, on ``out/base``), as
  the ``base_and_adapter`` save mode lays them out.

Under expert parallel each tp / pp rank's files of every ep rank are first made one
(:func:`nxd_finetune.nxdt.experts.unite_ep`), then united over tp and pp as without it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nxd_finetune.errors import ModelLoadError, NxdError
from nxd_finetune.lora import save_tokenizer, write_adapter_files
from nxd_finetune.lora.identity import base_identity
from nxd_finetune.models import DecoderConfig, checkpoint_index, copy_generation_config, save_pretrained
from nxd_finetune.nxdt.checkpoint import find_tag, grid, read_shard, shard_files
from nxd_finetune.nxdt.config import flatten, resolve_config
from nxd_finetune.nxdt.experts import unite_ep
from nxd_finetune.nxdt.layout import KvLayout, Tensors, unite_model
from nxd_finetune.nxdt.lora import lora_config_from, o_proj_order, split_base, unite_adapter
from nxd_finetune.nxdt.walk import KeyWalk
from nxd_finetune.storage.atomic import publish_dir, write_error


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the model's definition comes from: its HF ``config.json`` (``config_dir`` also gives
    ``generation_config.json``), the kv_replicator and tokenizer an NxDT YAML names."""

    config: DecoderConfig
    config_dir: Path
    kv_replicator: int | None = None
    tokenizer: Path | None = None


def model_source(path: str | Path) -> ModelSource:
    """``path``: an HF ``config.json``, a directory holding one, or the NxDT YAML config that
    trained the checkpoint (its ``model.model_config``, ``distributed_strategy.kv_replicator``
    and ``data.tokenizer.type`` are read)."""
    p = Path(path)
    if p.suffix in (".yaml", ".yml"):
        walk = KeyWalk(flat=flatten(resolve_config(p)), base=Path.cwd())
        model_cfg = walk.text("model.model_config")
        if not model_cfg:
            raise NxdError(f"{p}: model.model_config is not set; pass the HF config.json with --config")
        kv = walk.integer("distributed_strategy.kv_replicator", 0)
        tok = walk.text("data.tokenizer.type")
        json_path = Path(model_cfg).expanduser()
        return ModelSource(DecoderConfig.from_hf(json_path), json_path.parent,
                           kv or None, Path(tok) if tok and Path(tok).is_dir() else None)
    cfg_file = p / "config.json" if p.is_dir() else p
    return ModelSource(DecoderConfig.from_hf(cfg_file), cfg_file.parent)


def _write_base(tensors: Tensors, out: Path, src: ModelSource, tokenizer: Path | None) -> None:
    dtypes = {t.dtype for t in tensors.values()}
    # config.json's dtype follows the tensors (NxD's bf16 checkpoints of an fp32 config.json)
    save_pretrained(src.config, tensors.items(), out, dtypes.pop() if len(dtypes) == 1 else None)
    copy_generation_config(src.config_dir, out)
    save_tokenizer(tokenizer, out)


def _has_weights(model_dir: Path) -> bool:
    try:
        checkpoint_index(model_dir)
    except NxdError:
        return False
    return True


def import_checkpoint(directory: str | Path, out: str | Path, source: ModelSource, *, tokenizer: Path | None = None,
                      kv_layout: KvLayout = "auto", base: str | None = None) -> str:
    """Convert the NxD checkpoint at ``directory`` (a tag, its ``model/`` or a root of tags) and
    publish the result at ``out`` (absent or empty). Returns a one-line summary."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NxdError(f"--out {out} exists and is not empty")
    tag = find_tag(directory)
    files = shard_files(tag)
    ep, tp, pp = grid(files)
    where = f"{tag.name} ({f'ep={ep}, ' if ep > 1 else ''}tp={tp}, pp={pp})"
    base_shards: dict[tuple[int, int], Tensors] = {}
    lora_shards: dict[tuple[int, int], Tensors] = {}
    lora_saved = None
    for rank, by_ep in files.items():
        read = [read_shard(file, shared=by_ep[0]) for file in by_ep]
        tensors = read[0][0] if ep == 1 else unite_ep([t for t, _ in read], f"tp rank {rank[0]}, pp rank {rank[1]}")
        base_shards[rank], lora_shards[rank] = split_base(tensors)
        lora_saved = lora_saved or read[0][1]
    has_base = any(base_shards.values())
    has_lora = any(lora_shards.values())
    if not has_base and not has_lora:
        raise ModelLoadError(f"{tag}: the model files hold no tensors")
    tokenizer = tokenizer or source.tokenizer
    try:
        with publish_dir(out) as tmp:
            base_dir = out / "base" if has_lora else out
            if has_base:
                _write_base(unite_model(base_shards, source.config, kv_layout), tmp / "base" if has_lora else tmp,
                            source, tokenizer)
            if not has_lora:
                return f"imported the model of {where} -> {out} (HF checkpoint)"
            tensors, targets = unite_adapter(lora_shards, source.config, kv_layout,
                                             o_proj_order(source.config, tp, source.kv_replicator, kv_layout))
            cfg = lora_config_from(lora_saved, tensors)
            cfg.target_modules = sorted({t.rsplit(".", 1)[-1] for t in targets})
            adapter_out = tmp / "adapter" if has_base else tmp
            identity_dir = tmp / "base" if has_base else Path(base) if base else source.config_dir
            base_name = str(base_dir) if has_base else base or str(source.config_dir)
            identity = base_identity(source.config, identity_dir) if _has_weights(identity_dir) else None
            write_adapter_files(adapter_out, cfg, tensors, targets, base_name,
                                config_hash=source.config.config_hash(), identity=identity)
            if has_base:
                return f"imported {where}: base -> {out / 'base'}, LoRA adapter -> {out / 'adapter'}"
    except OSError as e:  # a full disk (named), or an --out that cannot be written
        raise write_error(e, out) from None
    return f"imported the LoRA adapter of {where} -> {out} (PEFT, {len(targets)} modules)"

"""The one exporter: a run's final artefact, the same files whatever the parallel layout.

Two steps, for every world size:

1. :func:`gather_to_writer` -- the full tensors on global rank 0 (a no-op at world size 1): the
   adapter under PEFT file keys (LoRA), or every model tensor under HF keys (full SFT), gathered
   over tensor parallel and united over the pipeline stages (full SFT at tp > 1 and pp = 1 streams
   instead: each tensor is gathered when the writer's shard needs it, :func:`export_model`);
2. :func:`write_final` -- rank 0 writes the save mode into a temporary sibling of the output
   directory and renames it into place (complete or absent); a previous run's directory there is
   swapped for it in one step (``renameat2`` exchange on Linux), so at every instant it is the
   old artefact or the new one, then removed (fault-injection points ``final-written:0`` and
   ``final-swapped:0`` of ``NXD_FINETUNE_FAILPOINT`` kill the writer around the swap):

   - ``adapter``: a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``, whose
     metadata records the base's identity, :mod:`nxd_finetune.lora.identity`) and the tokenizer
     files;
   - ``base_and_adapter``: ``base/`` = the source checkpoint as it is (its ``config.json``,
     ``generation_config.json``, safetensors and index, byte for byte) + tokenizer, ``adapter/``
     as above. Trained biases (``lora.bias``) travel in the adapter, which PEFT loads over the base;
   - ``merged``: the adapter folded into the source checkpoint tensor by tensor
     (:func:`nxd_finetune.lora.merge.merge_adapter`, as ``nxd-finetune merge``) in ``dtype``;
   - ``full`` (full SFT): the trained tensors in ``dtype`` as an HF checkpoint.

   Written HF checkpoints keep the source's ``config.json`` (only its dtype key set to the written
   dtype; ``tie_word_embeddings`` false when a merge unties the head) and its
   ``generation_config.json``.

Every rank calls :func:`export_model` (collective); only global rank 0 writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from nxd_finetune.checkpoint.writer import failpoint
from nxd_finetune.lora import (
    LoraConfig,
    gather_adapter_state_dict,
    save_tokenizer,
    write_adapter_files,
)
from nxd_finetune.lora.identity import base_identity
from nxd_finetune.lora.merge import merge_adapter
from nxd_finetune.models import DecoderConfig, copy_generation_config, save_pretrained
from nxd_finetune.parallel.parallelize import RankModel
from nxd_finetune.parallel.placement import gather_full, iter_placements
from nxd_finetune.storage.atomic import publish_dir, remove_leftovers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SaveMode = Literal["adapter", "base_and_adapter", "merged", "full"]
SAVE_MODES: tuple[str, ...] = ("adapter", "base_and_adapter", "merged")  # LoRA's; full SFT writes "full"
BASE_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
Tensors = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ExportSpec:
    """What to write. ``source_dir``: the HF checkpoint the run started from; ``base_name``: the
    adapter's ``base_model_name_or_path`` (a directory or hub id peft / vLLM can resolve);
    ``dtype``: of merged / full-SFT tensors; ``tokenizer``: an object with ``save_pretrained`` or a
    directory of tokenizer files (None: none written). ``metadata``: more string entries for the
    adapter's safetensors metadata (e.g. the preference objective and its reference model)."""

    mode: SaveMode
    source_dir: Path
    base_name: str
    dtype: torch.dtype = torch.float32
    revision: str | None = None
    tokenizer: PreTrainedTokenizerBase | str | Path | None = None
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)


def _unite_stages(rank_model: RankModel, pp_group: dist.ProcessGroup | None, local: Tensors) -> Tensors | None:
    """``local`` (this rank's stages, already gathered over TP) united over the pipeline ranks on
    global rank 0; None elsewhere. Only the rank at coordinate 0 on every other axis of each stage
    sends, as pickled CPU tensors over ``pp_group`` (a gloo group: the host groups' ``pp``)."""
    state = rank_model.state
    if state.size("pp") == 1:
        return local if state.rank == 0 else None
    if any(state.coord(a) != 0 for a in state.layout.names if state.layout.kind(a) != "stage"):
        return None
    parts: list[Any] | None = [None] * state.size("pp") if state.coord("pp") == 0 else None
    dist.gather_object({k: v.cpu() for k, v in local.items()}, parts, dst=state.ranks("pp")[0], group=pp_group)
    if parts is None:
        return None
    return {k: v for part in parts for k, v in part.items()}


def gather_to_writer(rank_model: RankModel, lora: LoraConfig | None,
                     pp_group: dist.ProcessGroup | None = None) -> Tensors | None:
    """The full tensors on global rank 0 (None on other ranks): the adapter under PEFT file keys
    with ``lora``, else every model tensor under HF keys. Collective over tp and pp."""
    state = rank_model.state
    if lora is None:
        return _unite_stages(rank_model, pp_group, dict(_streamed_model(rank_model)))
    local: Tensors = {}
    for m in rank_model.modules:
        local.update(gather_adapter_state_dict(m, state, lora.bias))  # sharded over tp or ep: gathered
    return _unite_stages(rank_model, pp_group, local)


def _copy_base(source: Path, out: Path) -> None:
    """The source checkpoint's model files, byte for byte."""
    out.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.is_file() and (f.suffix == ".safetensors" or f.name in BASE_FILES):
            shutil.copyfile(f, out / f.name)


def write_final(tensors: Tensors | Iterator[tuple[str, torch.Tensor]], out_dir: Path, spec: ExportSpec, *,
                config: DecoderConfig, lora: LoraConfig | None, lora_targets: list[str] | None = None) -> Path:
    """Write the save mode into ``out_dir`` (replaced if it exists) from the full ``tensors``
    (:func:`gather_to_writer`; for full SFT also ``(name, tensor)`` pairs consumed as they are
    written); the directory appears complete or not at all. One process."""
    out_dir = Path(out_dir)

    def adapter(out: Path) -> None:
        assert lora is not None and isinstance(tensors, dict)
        write_adapter_files(out, lora, tensors, list(lora_targets or []), spec.base_name,
                            revision=spec.revision, config_hash=config.config_hash(),
                            identity={**base_identity(config, spec.source_dir), **spec.metadata})

    # a previous run's artefact here is swapped for the new one in one step (never removed first);
    # what a killed writer of this directory left beside it goes first
    remove_leftovers(out_dir)
    with publish_dir(out_dir, replace=True, before_swap=functools.partial(failpoint, "final-written", 0),
                     after_swap=functools.partial(failpoint, "final-swapped", 0)) as tmp:
        if lora is None:
            save_pretrained(config, tensors.items() if isinstance(tensors, dict) else tensors, tmp, spec.dtype)
            copy_generation_config(spec.source_dir, tmp)
        elif spec.mode == "adapter":
            adapter(tmp)
        elif spec.mode == "base_and_adapter":
            adapter(tmp / "adapter")
            save_tokenizer(spec.tokenizer, tmp / "adapter")
            _copy_base(spec.source_dir, tmp / "base")
        elif spec.mode == "merged":  # from the files, as `nxd-finetune merge` does
            with tempfile.TemporaryDirectory(prefix=".nxd-adapter-", dir=out_dir.parent) as files:
                adapter(Path(files))
                merge_adapter(files, spec.source_dir, tmp, dtype=spec.dtype, base_revision=spec.revision)
        else:
            raise ValueError(f"unknown save mode {spec.mode!r}; use one of {', '.join(SAVE_MODES)}")
        save_tokenizer(spec.tokenizer, tmp / "base" if lora is not None and spec.mode == "base_and_adapter" else tmp)
    return out_dir


def _streamed_model(rank_model: RankModel) -> Iterator[tuple[str, torch.Tensor]]:
    """Every model tensor of this rank's stages under its HF key, each gathered over the axes its
    placement shards it on as it is asked for (full SFT). Collective over those axes: every rank
    must consume it to the end."""
    state = rank_model.state
    for m in rank_model.modules:
        placements = {name: placement for name, _, _, placement in iter_placements(m)}
        for name, t in m.state_dict().items():
            yield name, gather_full(t, placements[name], state) if name in placements else t.detach()


def export_model(rank_model: RankModel, out_dir: Path, spec: ExportSpec, *, config: DecoderConfig,
                 lora: LoraConfig | None, lora_targets: list[str] | None = None,
                 pp_group: dist.ProcessGroup | None = None) -> Path | None:
    """Gather to global rank 0, which writes ``out_dir`` (see the module docstring); returns it
    there, None on other ranks. Collective: every rank calls it.

    Full SFT at tp > 1 and pp = 1 streams instead: each tensor is gathered when the writer's
    current shard asks for it, so no rank holds the whole gathered model."""
    state = rank_model.state
    if lora is None and state.size("tp") > 1 and state.size("pp") == 1:
        stream = _streamed_model(rank_model)
        if state.rank != 0:
            for _ in stream:  # the other TP ranks take part in the gathers
                pass
            return None
        try:
            return write_final(stream, out_dir, spec, config=config, lora=lora, lora_targets=lora_targets)
        except Exception:
            with contextlib.suppress(Exception):  # the other TP ranks are still gathering
                for _ in stream:
                    pass
            raise
    tensors = gather_to_writer(rank_model, lora, pp_group)
    if tensors is None:
        return None
    return write_final(tensors, out_dir, spec, config=config, lora=lora, lora_targets=lora_targets)

"""The end-of-run artefact, whatever the parallel layout: files equal to a single-process run's.

- LoRA: the adapter is gathered over TP (``gather_adapter_state_dict``), the pipeline stages' parts
  are united on global rank 0, which writes it in the recipe's save mode: ``adapter``;
  ``base_and_adapter`` (the base checkpoint as HF files beside the adapter); ``merged`` (the base
  with the adapter folded in, streamed tensor by tensor from the files by ``lora.merge``).
- Full SFT: every tensor gathered over TP, the stages' parts united on rank 0, an HF checkpoint.

World size 1 takes the same functions with no collective. Every rank calls :func:`save_final`
(collective); only global rank 0 writes.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nxd_finetune.errors import NxdError


def _unite_stages(state: Any, pp_group: Any, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """``local`` (this rank's stages, already gathered over TP) united over the pipeline ranks on
    global rank 0; None elsewhere. Only the (dp 0, tp 0) rank of every stage sends, as pickled CPU
    tensors over ``pp_group``: this rank's pipeline group on CPU objects (``Engine.host.pp``, gloo)."""
    if state.pp_size == 1:
        return local if state.rank == 0 else None
    if state.dp_rank != 0 or state.tp_rank != 0:
        return None
    parts: list[Any] | None = [None] * state.pp_size if state.pp_rank == 0 else None
    dist.gather_object({k: v.cpu() for k, v in local.items()}, parts, dst=state.pp_ranks[0], group=pp_group)
    if parts is None:
        return None
    return {k: v for part in parts for k, v in part.items()}


def gathered_adapter(engine: Any) -> dict[str, torch.Tensor] | None:
    """The whole adapter under PEFT file keys on global rank 0 (None on other ranks). Collective."""
    from nxd_finetune.lora import adapter_state_dict, gather_adapter_state_dict

    bias = engine.lora_config.bias
    local: dict[str, torch.Tensor] = {}
    for m in engine.modules:
        local.update(adapter_state_dict(m, bias) if engine.state.tp_size == 1
                     else gather_adapter_state_dict(m, engine.state, bias))
    return _unite_stages(engine.state, engine.host.pp, local)


def gathered_model(engine: Any) -> dict[str, torch.Tensor] | None:
    """Every tensor of the model, unsharded, under HF keys on global rank 0. Collective."""
    from nxd_finetune.parallel.layers import gather_shards, iter_shard_specs

    local: dict[str, torch.Tensor] = {}
    for m in engine.modules:
        specs = {name: spec for name, _, _, spec in iter_shard_specs(m)}
        for name, t in m.state_dict().items():
            local[name] = gather_shards(t, specs[name], engine.state.tp_group) if name in specs else t.detach()
    return _unite_stages(engine.state, engine.host.pp, local)


def check_save_mode(recipe: Any) -> None:
    """Refuse, before training, what a multi-process run cannot save exactly."""
    if (recipe.parallel.nproc > 1 and recipe.lora is not None and recipe.lora.bias != "none"
            and recipe.checkpoint.save_mode == "base_and_adapter"):
        raise NxdError("checkpoint.save_mode=base_and_adapter with lora.bias other than none needs parallel.nproc=1 "
                       "(the base would carry the trained biases); use save_mode adapter or merged")


def save_final(engine: Any, recipe: Any, tokenizer: Any, model_dir: Path, final_dir: Path) -> None:
    """Write the run's final artefact into ``final_dir`` (see the module docstring). Collective."""
    if engine.lora_config is None:
        tensors = gathered_model(engine)
        if tensors is not None:
            from nxd_finetune.models import save_pretrained

            save_pretrained(engine.config, tensors.items(), final_dir)
            tokenizer.save_pretrained(final_dir)
        return
    if engine.state.world_size == 1:
        from nxd_finetune.lora import save_model

        save_model(engine.model, engine.lora_config, final_dir, recipe.checkpoint.save_mode,
                   base_model_name_or_path=recipe.model.path, base_config=engine.config,
                   tokenizer=tokenizer, revision=recipe.model.revision)
        return
    tensors = gathered_adapter(engine)
    if tensors is not None:
        _write_lora(engine, recipe, tensors, tokenizer, model_dir, final_dir)


def _write_lora(engine: Any, recipe: Any, tensors: dict[str, torch.Tensor], tokenizer: Any, model_dir: Path,
                final_dir: Path) -> None:
    from nxd_finetune.lora import save_adapter, save_tokenizer
    from nxd_finetune.lora.merge import merge_adapter

    mode = recipe.checkpoint.save_mode

    def write_adapter(out: Path) -> None:
        save_adapter(engine.modules[0], engine.lora_config, out, recipe.model.path, revision=recipe.model.revision,
                     config_hash=engine.config.config_hash(), tensors=tensors, target_names=engine.lora_targets)
        save_tokenizer(tokenizer, out)

    if mode == "adapter":
        write_adapter(final_dir)
    elif mode == "base_and_adapter":
        write_adapter(final_dir / "adapter")
        base = final_dir / "base"
        base.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            if f.is_file() and (f.suffix in (".safetensors", ".json") and f.name != "adapter_config.json"):
                shutil.copyfile(f, base / f.name)
        save_tokenizer(tokenizer, base)
    else:  # merged: from the files, as `nxd-finetune merge` does
        with tempfile.TemporaryDirectory(prefix="nxd-adapter-", dir=final_dir.parent) as tmp:
            write_adapter(Path(tmp))
            if final_dir.exists():
                shutil.rmtree(final_dir)
            dtype = "bf16" if recipe.training.precision == "bf16" else recipe.model.dtype
            merge_adapter(tmp, model_dir, final_dir, dtype=dtype)
            save_tokenizer(tokenizer, final_dir)

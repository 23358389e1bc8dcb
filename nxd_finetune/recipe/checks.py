"""Recipe rules that need the model's shape (checked by ``validate`` and before training)."""

from __future__ import annotations

from typing import Protocol

from nxd_finetune.errors import RecipeError
from nxd_finetune.recipe.sections import Recipe


class ModelShape(Protocol):
    """The model sizes the rules read, under HF config attribute names (``num_key_value_heads`` and
    ``intermediate_size`` are read when the object has them)."""

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


def check_against_model(recipe: Recipe, config: ModelShape) -> None:
    """Rules that need the model's shape; ``config`` has HF attribute names (``num_attention_heads``,
    ``num_key_value_heads``, ``num_hidden_layers``, ``vocab_size``, optionally
    ``intermediate_size``), e.g. ``nxd_finetune.models.DecoderConfig``.

    - attention heads, vocab and MLP width split evenly over tp;
    - key/value heads: tp divides them, or is a multiple of them (kv heads are then replicated);
    - layers split evenly over ``pp * virtual_stages`` stages unless ``parallel.pp_cuts`` places the
      cuts, which must then lie inside ``1 .. num_hidden_layers-1``;
    - a multimodal checkpoint (``config.multimodal``: its language model is trained, text only)
      takes LoRA with an ``adapter`` or ``base_and_adapter`` artefact: full SFT and ``merged`` would
      write a checkpoint without its vision tower;
    - ``parallel.ep`` > 1 needs a mixture-of-experts model (``config.num_experts``) whose expert
      count it divides; such a model trains on every layout but sequence parallel (its router and
      experts see whole rows), and its base is not quantized (``model.quantization``);
    - ``model.quantization.embeddings`` needs a hidden size that its ``block_size`` divides;
    Raises RecipeError with the numbers.
    """
    experts = getattr(config, "num_experts", 0)
    ep = recipe.parallel.ep
    if ep > 1 and not experts:
        raise RecipeError(f"parallel.ep={ep} splits the experts of a mixture-of-experts model; this model has none "
                          "(set parallel.ep=1)")
    if experts and experts % ep:
        raise RecipeError(f"parallel.ep={ep} does not divide the model's {experts} experts")
    if experts and recipe.parallel.sequence_parallel:
        raise RecipeError(f"parallel.sequence_parallel on a mixture-of-experts model ({experts} experts) is not "
                          "supported: its router and experts run on whole rows; set it false")
    if experts and recipe.model.quantization is not None:
        raise RecipeError(f"model.quantization on a mixture-of-experts model ({experts} experts) is not supported: "
                          "bitsandbytes quantizes linear layers, not the fused expert tensors; remove it")
    quant = recipe.model.quantization
    hidden = getattr(config, "hidden_size", 0)
    if quant is not None and quant.embeddings and hidden % quant.block_size:
        raise RecipeError(f"model.quantization.embeddings: the hidden size {hidden} does not divide by "
                          f"block_size {quant.block_size} (an embedding row must be whole blocks); use a block_size "
                          "that divides it")
    if getattr(config, "multimodal", False):
        what = ("full fine-tuning" if recipe.lora is None else
                "checkpoint.save_mode=merged" if recipe.checkpoint.save_mode == "merged" else None)
        if what:
            raise RecipeError(f"{what} of a multimodal checkpoint is not supported: it trains the language model "
                              "with LoRA only (save_mode adapter or base_and_adapter)")
    par = recipe.parallel
    tp, stages = par.tp, par.num_stages
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    if heads % tp:
        raise RecipeError(f"parallel.tp={tp} does not divide the model's num_attention_heads={heads}")
    if kv % tp and tp % kv:
        raise RecipeError(f"parallel.tp={tp} must divide the model's num_key_value_heads={kv} "
                          "or be a multiple of it")
    if config.vocab_size % tp:
        raise RecipeError(f"parallel.tp={tp} does not divide the model's vocab_size={config.vocab_size}")
    inter = getattr(config, "intermediate_size", None)
    if inter is not None and inter % tp:
        raise RecipeError(f"parallel.tp={tp} does not divide the model's intermediate_size={inter}")
    if par.pp_cuts is not None:
        if par.pp_cuts[-1] >= layers:
            raise RecipeError(f"parallel.pp_cuts={par.pp_cuts} must lie below the model's "
                              f"num_hidden_layers={layers}")
    elif layers % stages:
        raise RecipeError(f"the model's num_hidden_layers={layers} is not divisible by "
                          f"pp*virtual_stages={par.pp}*{par.virtual_stages}={stages}; set parallel.pp_cuts")

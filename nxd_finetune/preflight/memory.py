"""The per-rank memory estimate of ``validate`` (weights, gradients, optimizer, activations)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nxd_finetune.recipe import Recipe


def estimate_memory(recipe: Recipe, config: Any, total: int, trainable: int) -> dict[str, float]:
    """Approximate bytes per rank on the busiest rank: weights, grads, optimizer, activations.

    - weights: frozen params in their load dtype (bf16 when ``precision=bf16``, else ``model.dtype``)
      + trainable params in fp32 (bf16 under pure ``bf16``); divided by ``tp*pp``.
    - gradients: one per trainable param, in the trainable dtype; divided by ``tp*pp``.
    - optimizer: AdamW's two fp32 states per trainable param, plus an fp32 master copy when the
      trainable params are bf16; divided by ``tp*pp``, and by ``dp`` under ``zero1``.
    - activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", bytes per layer
      for 16-bit activations, s=max_seq_len, b=micro_batch_size, h=hidden, a=heads, t=tp):
      none: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` (``34/t`` instead of ``10 + 24/t`` with
      sequence_parallel); selective drops the ``5*a*s/(h*t)`` attention-score term; full keeps
      ``2*s*b*h`` (``/t`` with sequence_parallel) per layer plus one layer's full activations for
      the recompute. Doubled for fp32. Times ``ceil(layers/pp)`` layers and the micro-batches a
      stage holds at once (1 without pp, ``min(pp, grad_accum)`` for 1F1B, ``grad_accum`` for
      GPipe), plus fp32 logits and their gradient, ``8*b*s*vocab/t``, on the last stage.
    """
    par, tr = recipe.parallel, recipe.training
    t, pp = par.tp, par.pp
    pure_bf16 = tr.precision == "bf16"
    load_bytes = 2 if pure_bf16 or recipe.model.dtype != "fp32" else 4
    train_bytes = 2 if pure_bf16 else 4
    shard = t * pp
    frozen = total - trainable
    weights = (frozen * load_bytes + trainable * train_bytes) / shard
    grads = trainable * train_bytes / shard
    optimizer = trainable * (8 + (4 if train_bytes == 2 else 0)) / shard / (par.dp if par.zero1 else 1)

    s, b, h, a = recipe.data.max_seq_len, tr.micro_batch_size, config.hidden_size, config.num_attention_heads
    linear = 34 / t if par.sequence_parallel else 10 + 24 / t
    scores = 5 * a * s / (h * t)
    full_layer = s * b * h * (linear + scores)
    per_layer = {"none": full_layer, "selective": s * b * h * linear,
                 "full": 2 * s * b * h / (t if par.sequence_parallel else 1)}[par.activation_checkpointing]
    scale = 1 if tr.precision in ("bf16", "bf16-mixed") else 2
    layers = math.ceil(config.num_hidden_layers / pp)
    accum = tr.grad_accum_steps(par.dp)
    in_flight = 1 if pp == 1 else (accum if par.pp_schedule == "gpipe" else min(pp, accum))
    extra = full_layer if par.activation_checkpointing == "full" else 0
    logits = 8 * b * s * config.vocab_size / t
    first = (per_layer * layers * in_flight + extra) * scale
    last = (per_layer * layers + extra) * scale + logits
    activations = first + logits if pp == 1 else max(first, last)
    return {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": activations}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"

"""The per-rank memory estimate of ``validate``: what the busiest rank holds at its peak (the start
of a micro-batch's backward), part by part.

It models this implementation, not a textbook transformer, and is checked against measured peak
resident memory of real runs (``bench/bench_scale.py``, a Llama-3.2-1B shape from 512 to 8192
tokens, every layout and checkpointing mode). It models a run's first step (two micro-batches):
against 1-2 step runs it was within 10% in 13 of the 15 rows and within 13% in all. On the CPU the
peak then grows over the next steps, as micro-batches of other shapes fragment glibc's heap: after
8 steps (3 at 8192 tokens) 11 rows are within 10%, and the estimate is 13-18% under the peaks of
the 2,048-token rows and of 8,192 tokens with selective checkpointing (``bench/README.md``). With
the ``allocator cache`` part at one process's widths, the tp2 rows went from 7.6-7.8% under to
0.6% over (bf16-mixed, an AMX Xeon) and 2.2% over (fp32, an AVX2 EPYC).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from nxd_finetune.loss import TARGET_ROWS_MULTIPLE, chunk_rows
from nxd_finetune.parallel.launch import resolve_device_name
from nxd_finetune.preflight.model import expert_parameters

if TYPE_CHECKING:
    from nxd_finetune.models import DecoderConfig
    from nxd_finetune.recipe import Recipe

MiB = 2**20
RUNTIME_BYTES = 420 * MiB
"""Measured per process before the model: Python, torch, transformers, the tokenizer, the data
pipeline, the process groups and the allocator's own overhead (``bench/bench_scale.py``)."""
HEAP_TENSOR_LIMIT = 32 * MiB
"""glibc's largest mmap threshold: bigger tensors get their own mapping, returned on free; smaller
ones come from the heap, which keeps them when freed (see ``allocator cache``)."""
LOSS_COPIES = 3
"""fp32 ``[rows, vocab]`` tensors alive in the loss's backward: the log-probabilities, their
gradient, and the 16-bit copy the head's matmul takes."""


def _loss_rows(recipe: Recipe, vocab_local: int, tokens: int, targets: int | None) -> int:
    """Rows of logits the loss holds at once: the micro-batch's target positions padded to a
    multiple of ``loss.TARGET_ROWS_MULTIPLE`` (every position when ``targets`` is None), or one
    chunk of ``training.loss_chunk_tokens`` of them (also on a pipeline's last stage). Sequence
    parallel takes the logits of every position, and so does a pipeline's last stage without
    chunks (its output layer runs before the loss sees the targets)."""
    rows = chunk_rows(vocab_local, recipe.training.loss_chunk_tokens)
    if recipe.parallel.sequence_parallel or (rows is None and recipe.parallel.pp > 1):
        return tokens  # every position's logits (unchunked, a pipeline's last stage runs the head on all)
    if targets is not None:
        tokens = min(tokens, -(-targets // TARGET_ROWS_MULTIPLE) * TARGET_ROWS_MULTIPLE)
    return tokens if rows is None else min(tokens, rows)


def estimate_memory(recipe: Recipe, config: DecoderConfig, total: int, trainable: int,
                    targets: int | None = None) -> dict[str, float]:
    """Approximate bytes on the busiest rank, by part:

    - ``runtime``: :data:`RUNTIME_BYTES`, measured.
    - ``weights``: frozen parameters in their load dtype (``model.dtype``; bf16 under pure ``bf16``)
      plus trainable ones in fp32 (bf16 under pure ``bf16``), divided by ``tp * pp``; under bf16
      autocast, plus the 16-bit copies of fp32 trainable weights autocast keeps for the step. With
      ``pp > 1`` a stage holds its share of the layers and a whole vocabulary matrix (the first
      the embedding, the last the output layer, a copy of the embedding when they are tied).
      With ``model.quantization`` the decoder layers' linear weights count at bitsandbytes'
      storage instead (:func:`quantized_bytes_per_element`); embeddings, norms, biases and
      ``lm_head`` stay in the load dtype (the embedding and ``lm_head`` quantized too with
      ``model.quantization.embeddings``).
    - ``gradients``: one per trainable parameter in its dtype, ``/ (tp * pp)``.
      A mixture-of-experts model's expert tensors are whole on every tp rank and split over
      ``ep``: their weights, gradients and states count ``/ (pp * ep)`` (ZeRO-1: ``/ (dp / ep)``).
    - ``optimizer``: AdamW's two fp32 states per trainable parameter (plus an fp32 master copy of
      bf16 ones), ``/ (tp * pp)``, and ``/ dp`` under ZeRO-1.
    - ``activations``: what a micro-batch keeps for backward, per token and decoder layer, with
      ``m`` bytes for the residual stream (the model dtype), ``c`` for matmul outputs (2 under bf16
      autocast), ``h`` hidden, ``q`` = heads x head_dim, ``k`` = kv heads x head_dim, ``f`` ffn, over
      ``t`` = tp (plus the families' extra tensors, :func:`_family_tensors`): the two norms' inputs
      ``2*m*h``; the projections' inputs ``2*c*h`` (q/k/v share
      one, gate/up another; ``5*c*h`` when the norm output is cast to the compute dtype per
      projection); attention ``c*(3q + 2k)/t`` (q, k, v, its output and ``o_proj``'s input); the
      MLP ``3*c*f/t`` (gate, up, the product). ``selective`` recomputes the MLP (keeping its
      input, ``m*h``), ``full`` every layer (keeping its input, ``m*h``), each plus one recomputed
      module's activations. Sequence parallel divides the ``h`` terms by ``t`` too. Full SFT in
      fp32 adds ``2*m*h`` (trainable norms keep their output). Outside the layers: the final
      norm's input and the rotary tables, ``m*(h + 2*head_dim)``. Times ``ceil(layers / pp)``
      layers and the micro-batches a pipeline stage holds (``min(pp, grad_accum)`` for 1F1B,
      ``grad_accum`` for GPipe).
    - ``loss``: :data:`LOSS_COPIES` fp32 ``[rows, vocab / tp]`` tensors, rows being the most
      ``targets`` a micro-batch holds (``validate`` counts them in the tokenized data:
      :func:`.data.micro_batch_targets`; every position when None) padded to a multiple of 64, or
      one chunk of ``training.loss_chunk_tokens`` of them (every position under sequence
      parallel). With ``pp > 1``: the first stage's activations or the last stage's activations
      and loss, whichever is larger.
    - ``vocabulary gradient`` (full SFT): temporaries of the ``[vocab / tp, hidden]`` gradient in
      backward: the output layer's weight gradient in the compute dtype and its fp32 cast, ``2 + 4``
      bytes per element under bf16 autocast (4 in fp32). Measured on the Llama-3.2-1B widths (4
      layers, bf16-mixed, 512 tokens): each micro-batch's backward adds 2.8 GB to its forward's
      peak, against 1.0 GB of activations and loss.
    - ``allocator cache`` (training on the CPU, ``training.device`` cpu or auto): the activations
      of one micro-batch held in tensors under :data:`HEAP_TENSOR_LIMIT`
      (:func:`heap_activation_bytes`). glibc serves those from its heap and keeps them when freed;
      the next micro-batch's tensors (and a forward's temporaries) are placed around what is still
      live, so about as much stays resident but free at the peak. Measured with ``mallinfo2`` on
      the Llama-3.2-1B shape (2 micro-batches): 1.1-1.2 GB free at the peak at 2,048 tokens without
      and with selective checkpointing (1.0 GB counted), 0.34 GB at 512 tokens (0.66 GB counted
      without checkpointing, 0.28 selective); at 8,192 tokens most tensors are 32 MiB or more and
      are unmapped when freed. Counted at one process's widths, whatever ``tp`` and sequence
      parallel (a measured rule, not a per-tensor account): the free space is left by the
      forward's and backward's temporaries, and at tp > 1 many of them stay full-width on every
      rank (the row-parallel layers' all-reduced outputs and their gradients; under sequence
      parallel the gathered inputs). Measured on the 1B shape in
      fp32 at 512 tokens: 1,415 MiB free at the peak in 1 process, 1,126-1,174 at tp2 (0.81x,
      while the sharded activations are 0.61x). Not counted: the growth over a run's next steps,
      as micro-batches of other shapes fragment the heap further (8 steps at 2,048 tokens: 0.8-1.6
      GiB more).
    - ``optimizer step`` / ``checkpoint save``: between steps, AdamW's temporaries (about two fp32
      copies of the largest trainable tensor) or a save's tensors (the whole stage gathered on the
      writing rank under ZeRO-1 or copied for ``checkpoint.async_save``; at tp > 1 otherwise one
      tensor at a time, streamed to the file, so two fp32 copies of the largest one), whichever is
      larger, counted where it exceeds the activations and loss it replaces.
    """
    par, tr = recipe.parallel, recipe.training
    t, pp = par.tp, par.pp
    pure_bf16 = tr.precision == "bf16"
    m, c = _widths(recipe)
    train_bytes = 2 if pure_bf16 else 4
    shard = t * pp
    frozen = total - trainable
    quant = recipe.model.quantization
    quantized = quantized_elements(config, quant.embeddings) if quant is not None else 0
    frozen_bytes = (frozen - quantized) * m + quantized * quantized_bytes_per_element(recipe)
    weights = (frozen_bytes + trainable * train_bytes) / shard
    if pp > 1:  # the embedding (first stage) and the output layer (last stage; a copy when tied)
        vocab_params = config.vocab_size * config.hidden_size
        n_vocab = vocab_params * (1 if getattr(config, "tie_word_embeddings", False) else 2)
        vocab_bytes = (quantized_bytes_per_element(recipe) if quant is not None and quant.embeddings
                       else m if recipe.lora is not None else train_bytes)
        weights += (vocab_params - n_vocab / pp) * vocab_bytes / t
    if c == 2 and train_bytes == 4:
        weights += trainable * 2 / shard  # autocast's cached bf16 copies
    grads = trainable * train_bytes / shard
    optimizer = trainable * (8 + (4 if train_bytes == 2 else 0)) / shard / (par.dp if par.zero1 else 1)
    experts = expert_parameters(config)[0] if getattr(config, "num_experts", 0) else 0
    if experts:  # whole on every tp rank, split over ep (ZeRO-1: over the dp / ep ranks holding the same ones)
        moved = experts / (pp * par.ep) - experts / shard
        weights += moved * (m if recipe.lora is not None else train_bytes)
        if recipe.lora is None:
            grads += moved * train_bytes
            k = 8 + (4 if train_bytes == 2 else 0)
            optimizer += experts * k * (1 / (pp * par.ep * (par.dp // par.ep if par.zero1 else 1))
                                        - 1 / (shard * (par.dp if par.zero1 else 1)))

    per_token, recompute = activation_bytes_per_token(recipe, config)
    layers = config.num_hidden_layers
    tokens = recipe.data.max_seq_len * tr.micro_batch_size
    stage_layers = math.ceil(layers / pp)
    accum = tr.grad_accum_steps(par.dp)
    in_flight = 1 if pp == 1 else (accum if par.pp_schedule == "gpipe" else min(pp, accum))
    outside = model_bytes_per_token(recipe, config)
    activations = tokens * ((per_token * stage_layers + outside) * in_flight + recompute)
    vocab_local = math.ceil(config.vocab_size / t)
    loss = LOSS_COPIES * 4 * _loss_rows(recipe, vocab_local, tokens, targets) * vocab_local
    if pp > 1:  # the first stage holds the most micro-batches, the last one the loss: the larger
        last = tokens * (per_token * stage_layers + outside + recompute)
        if activations > last + loss:
            loss = 0
        else:
            activations = last
    # Full SFT: the vocabulary matrix's gradient passes through temporaries in backward (the output
    # layer's weight gradient in the compute dtype, its fp32 cast, the embedding's dense fp32 one)
    vocab_matrix = config.vocab_size * config.hidden_size if recipe.lora is None else 0
    vocab_grad = (4 + (2 if c == 2 else 0)) * vocab_matrix / t
    # Host memory (CPU training): glibc keeps freed heap tensors for reuse, and they fragment
    heap = heap_activation_bytes(recipe, config, stage_layers) if tr.device in ("cpu", "auto") else 0.0
    parts = {"runtime": float(RUNTIME_BYTES), "weights": weights, "gradients": grads, "optimizer": optimizer,
             "activations": activations, "loss": float(loss), "vocabulary gradient": float(vocab_grad),
             "allocator cache": heap}
    # Between steps the activations are gone, and two things can need more: AdamW's per-tensor
    # temporaries (CPU steps one tensor at a time: about two fp32 copies of the largest one, the
    # vocabulary matrix in full SFT; ZeRO-1 steps in 4M-element chunks) and a checkpoint save, which
    # gathers the stage's trainable tensors and optimizer states whole on its writing rank (ZeRO-1),
    # copies them for a background write, or at tp > 1 streams them one gathered tensor at a time.
    step_temp = 2 * 4 * vocab_matrix / t if not par.zero1 else 0
    if recipe.checkpoint.async_save or (par.zero1 and par.dp > 1):  # the whole stage, gathered or copied
        save = trainable / pp * (train_bytes + 8 + (4 if train_bytes == 2 else 0))
    else:  # streamed at tp > 1: one tensor gathered at a time, on every TP rank (the gather's output and
        save = 2 * 4 * vocab_matrix if t > 1 else 0.0  # its reordered copy); written in place at tp = 1
    during = activations + loss + vocab_grad
    parts["optimizer step"] = max(0.0, step_temp - during) if step_temp >= save else 0.0
    parts["checkpoint save"] = max(0.0, save - during) if save > step_temp else 0.0
    return parts


def quantized_elements(config: DecoderConfig, embeddings: bool = False) -> int:
    """Weight elements ``model.quantization`` quantizes: the decoder layers' linear weights (q, k,
    v, o and the gated MLP's three); with ``embeddings`` (``model.quantization.embeddings``) the
    input embedding and ``lm_head`` too (one matrix when tied), else they stay in full precision."""
    h, f, hd = config.hidden_size, config.intermediate_size, _head_dim(config)
    q, kv = config.num_attention_heads * hd, (config.num_key_value_heads or config.num_attention_heads) * hd
    vocab = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return config.num_hidden_layers * (2 * h * q + 2 * h * kv + 3 * h * f) + (vocab if embeddings else 0)


def quantized_bytes_per_element(recipe: Recipe) -> float:
    """Bytes per quantized weight element as bitsandbytes stores it: 4-bit, half a byte plus an fp32
    absmax per ``block_size`` elements, or with ``double_quant`` one byte per block plus an fp32
    scale per 256 blocks; int8, one byte (its fp32 scale per row not counted). 0 without quantization."""
    quant = recipe.model.quantization
    if quant is None:
        return 0.0
    if quant.method == "int8":
        return 1.0
    block = quant.block_size
    return 0.5 + (1 / block + 4 / (256 * block) if quant.double_quant else 4 / block)


def _widths(recipe: Recipe) -> tuple[int, int]:
    """``(m, c)``: bytes per element of the residual stream (the model dtype; 2 under pure bf16)
    and of matmul outputs (2 under bf16 / bf16-mixed)."""
    tr = recipe.training
    m = 2 if tr.precision == "bf16" or recipe.model.dtype != "fp32" else 4
    return m, 2 if tr.precision in ("bf16", "bf16-mixed") else 4


def _head_dim(config: DecoderConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_tensors(recipe: Recipe, config: DecoderConfig) -> list[float]:
    """Bytes per token of each tensor kept outside the decoder layers: the final norm's input and
    the rotary cos/sin tables (in the residual stream's dtype)."""
    m, _ = _widths(recipe)
    return [m * config.hidden_size, m * _head_dim(config), m * _head_dim(config)]


def model_bytes_per_token(recipe: Recipe, config: DecoderConfig) -> float:
    """Bytes per token kept outside the decoder layers (:func:`model_tensors`)."""
    return float(sum(model_tensors(recipe, config)))


def activation_bytes_per_token(recipe: Recipe, config: DecoderConfig) -> tuple[float, float]:
    """``(kept, recompute)``: bytes per token one decoder layer keeps for backward on a rank, and
    the bytes per token of the module that activation checkpointing recomputes at a time (0 without
    it). The terms are listed in :func:`estimate_memory`."""
    kept, recompute = layer_tensors(recipe, config)
    return float(sum(kept)), float(sum(recompute))


def layer_tensors(recipe: Recipe, config: DecoderConfig, unsharded: bool = False) -> tuple[list[float], list[float]]:
    """The tensors behind :func:`activation_bytes_per_token`, as bytes per token each: those one
    decoder layer keeps for backward, and those of the module checkpointing recomputes at a time.
    ``unsharded``: at the widths of one process (as if ``tp`` were 1, without sequence parallel)."""
    par = recipe.parallel
    t = 1 if unsharded else par.tp
    m, c = _widths(recipe)
    h, f = config.hidden_size, config.intermediate_size
    d = _head_dim(config)
    q = config.num_attention_heads * d
    k = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * d
    sp = t if par.sequence_parallel else 1  # 1 when unsharded (t = 1)
    shared = m == c  # the norm output is already in the compute dtype: q/k/v (gate/up) share it
    attention = [m * h / sp] * 2 + [c * h / sp] * (1 if shared else 3) + [c * q / t] * 3 + [c * k / t] * 2
    mlp = [c * h / sp] * (1 if shared else 2) + [c * f / t] * 3
    if getattr(config, "num_experts", 0):  # a config-like namespace of dense fields counts as dense
        mlp = _moe_mlp(config, mlp, c, sp)
    if recipe.lora is None and m == 4:
        attention += [m * h / sp] * 2  # trainable fp32 norms also keep their normalised output
    attention += _family_tensors(recipe, config, m, c, t, sp)
    kept = {"none": attention + mlp, "selective": attention + [m * h / sp],
            "full": [m * h / sp]}[par.activation_checkpointing]
    recompute = {"none": [], "selective": mlp, "full": attention + mlp}[par.activation_checkpointing]
    return kept, recompute


def _moe_mlp(config: DecoderConfig, dense: list[float], c: int, sp: int) -> list[float]:
    """The MLP tensors per token of a mixture-of-experts model, averaged over its layers (dense
    ``mlp_only_layers`` keep ``dense``): an MoE layer keeps its input ``c*h``, the router logits and
    their fp32 softmax ``(c + 4)*E``, and per routed copy of the token (``k`` =
    ``num_experts_per_tok``) the gathered input ``c*h``, gate, up and their product ``3*c*I_moe``
    and the expert's output ``c*h``: the experts run the routed tokens only, never all ``E``."""
    layers = config.num_hidden_layers
    share = sum(config.is_moe_layer(i) for i in range(layers)) / layers
    h, e, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
    i = config.moe_intermediate_size or config.intermediate_size
    moe = [c * h / sp, (c + 4) * e] + [c * h, 3 * c * i, c * h] * k
    return [w * share for w in moe] + [w * (1 - share) for w in dense]


def _family_tensors(recipe: Recipe, config: DecoderConfig, m: int, c: int, t: int, sp: int) -> list[float]:
    """Per-token tensors a layer keeps beyond Llama's: Gemma's two extra norms (``sandwich_norms``:
    their inputs, ``2*m*h``), per-head q/k norms (``qk_norm``: their inputs, ``c*(q + k)/t``), and
    soft-capped attention (``attn_logit_softcapping``) where SDPA runs it, unfused: the scores, their
    cap and the fp32 softmax of every query against ``max_seq_len`` keys, ``(2c + 4 + c) * T * heads / t``
    (FlexAttention, ``model.attention`` flex, or auto on CUDA, caps them inside its kernel: none)."""
    h, d = config.hidden_size, _head_dim(config)
    out: list[float] = []
    if getattr(config, "sandwich_norms", False):
        out += [m * h / sp] * 2
    if getattr(config, "qk_norm", False):
        out += [c * config.num_attention_heads * d / t, c * (config.num_key_value_heads or 1) * d / t]
    flex = recipe.model.attention == "flex" or (
        recipe.model.attention == "auto" and resolve_device_name(recipe.training.device) == "cuda")
    if getattr(config, "attn_logit_softcapping", None) is not None and not flex:
        out += [(3 * c + 4) * recipe.data.max_seq_len * config.num_attention_heads / t]
    return out


def heap_activation_bytes(recipe: Recipe, config: DecoderConfig, stage_layers: int) -> float:
    """The ``allocator cache`` part: the bytes of one micro-batch's activations held in tensors
    below :data:`HEAP_TENSOR_LIMIT` (a pipeline stage's layers, the recomputed module, the final
    norm's input and the rotary tables), at one process's widths: tensor and sequence parallel do
    not shrink the heap's free space the way they shrink the activations
    (:func:`estimate_memory`)."""
    tokens = recipe.data.max_seq_len * recipe.training.micro_batch_size
    kept, recompute = layer_tensors(recipe, config, unsharded=True)

    def small(widths: list[float]) -> float:
        return sum(w * tokens for w in widths if w * tokens < HEAP_TENSOR_LIMIT)

    return small(kept) * stage_layers + small(recompute) + small(model_tensors(recipe, config))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"

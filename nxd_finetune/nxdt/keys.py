"""The NxDT config keys and what becomes of each: the rules of ``nxd-finetune import nxdt-config``.

Each ``_section`` function reads the resolved, flattened NxDT config through a :class:`KeyWalk`:
``put`` sets a recipe key from NxDT keys (a *mapped* line), ``keep`` records a key that needs no
recipe key of its own (a *mapped* line with a note), ``drop`` lists a key as *not carried over*
with the reason. Keys no rule touched are listed as not carried over too ("not a documented NxDT
key"), so every key of the input appears once in the report.

The keys are those of NxDT's config overview (``docs/general/config_overview.rst``) and its SFT /
LoRA / DPO tutorials.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from nxd_finetune.errors import RecipeError
from nxd_finetune.nxdt.moe_keys import translate_moe
from nxd_finetune.nxdt.walk import KeyWalk, shown

# NxD's fused LoRA targets -> HF's module names
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
SCHEDULERS = {"LinearAnnealingWithWarmUp": "linear", "CosineAnnealing": "cosine", "WarmupPolicy": "constant",
              "ConstantLR": "constant"}
# NxDT precision.type -> (training.precision, neuron.precision, neuron.stochastic_rounding or None)
PRECISIONS: dict[str, tuple[str, str, bool | None]] = {
    "fp32": ("fp32", "fp32", None),
    "bf16SR": ("bf16", "bf16-sr", None),
    "mixed_precision": ("bf16", "bf16-master", None),
    "mixed_precisionSR": ("bf16", "bf16-master", True),
    "autocast": ("bf16-mixed", "autocast", None),
}
RUNTIME_ENV = {  # top-level keys NxDT's training_orchestrator.py turns into environment variables
    "aync_exec_max_inflight_requests": "NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS",
    "bucket_size_collectives": "BUCKET_CAP_MB",
    "neuron_rt_exec_timeout": "NEURON_RT_EXEC_TIMEOUT",
    "neuron_experimental_compress_rg": "NEURON_EXPERIMENTAL_COMPRESS_RG",
}

def translate(walk: KeyWalk, model_path: str | None) -> None:
    """Apply every section's rules, then list the keys no rule knew."""
    source = walk.text("model_source", "hf")
    if source != "hf":
        raise RecipeError(f"model_source={source!r}: only NxDT's HF models (model_source: hf) can be imported; "
                          "a Megatron model has no HF checkpoint to train from")
    walk.keep("model_source", "HF model (model.path)")
    walk.keep("name", "output.dir (with exp_manager)")
    if walk.has("seed"):
        walk.put("training.seed", walk.integer("seed"), "seed")
    _distributed(walk)
    _trainer(walk)
    _exp_manager(walk)
    _data(walk)
    _model(walk, model_path)
    _alignment(walk)
    _precision(walk)
    _neuron(walk)
    for key in sorted(k for k in walk.flat if k not in walk.used):
        walk.drop(key, "not a documented NxDT key")


def _distributed(walk: KeyWalk) -> None:
    p = "distributed_strategy."
    tp = walk.integer(p + "tensor_model_parallel_size", 1)
    pp = walk.integer(p + "pipeline_model_parallel_size", 1)
    vpp = walk.integer(p + "virtual_pipeline_model_parallel_size", 1)
    walk.put("parallel.tp", tp, p + "tensor_model_parallel_size")
    walk.put("parallel.pp", pp, p + "pipeline_model_parallel_size")
    walk.put("parallel.virtual_stages", vpp, p + "virtual_pipeline_model_parallel_size")
    if vpp > 1:
        walk.put("parallel.pp_schedule", "interleaved_1f1b")
    walk.put("parallel.zero1", walk.flag(p + "zero1"), p + "zero1")
    if walk.flag(p + "sequence_parallel") and tp == 1:
        walk.drop(p + "sequence_parallel", "sequence parallelism needs tp > 1 (tp=1 here)")
    else:
        walk.put("parallel.sequence_parallel", walk.flag(p + "sequence_parallel"), p + "sequence_parallel")
    walk.keep(p + "kv_replicator", "not needed: nxd-finetune replicates KV heads itself when tp exceeds them "
                                   "(nxdt-checkpoint reads the replicated shards)")
    if walk.integer(p + "context_parallel_size", 1) > 1:
        walk.drop(p + "context_parallel_size", "nxd-finetune has no context parallelism (ring attention)")
    else:
        walk.keep(p + "context_parallel_size", "1: no context parallelism, as nxd-finetune")


def _trainer(walk: KeyWalk) -> None:
    p = "trainer."
    devices = walk.integer(p + "devices", 1)
    nodes = walk.integer(p + "num_nodes", 1)
    walk.put("parallel.nproc", devices * nodes, p + "devices", p + "num_nodes")
    steps, epochs = walk.integer(p + "max_steps", -1), walk.integer(p + "max_epochs", -1)
    if steps > 0:
        walk.put("training.max_steps", steps, p + "max_steps")
        walk.keep(p + "max_epochs", "max_steps governs (as in Lightning when it is reached first)")
    elif epochs > 0:
        walk.put("training.epochs", float(epochs), p + "max_epochs", p + "max_steps")
    walk.put("logging.every_n_steps", walk.integer(p + "log_every_n_steps", 1), p + "log_every_n_steps")
    clip = walk.number(p + "gradient_clip_val")
    walk.put("training.grad_clip", clip or None, p + "gradient_clip_val")
    has_val = walk.has("data.val_dir")
    limit = walk.get(p + "limit_val_batches", 1.0)
    interval = walk.get(p + "val_check_interval")
    if not has_val or limit == 0:
        why = "no data.val_dir" if not has_val else "limit_val_batches=0 turns validation off"
        walk.drop(p + "val_check_interval", f"no evaluation is carried over ({why})")
        walk.drop(p + "limit_val_batches", f"no evaluation is carried over ({why})")
        walk.put("eval.before", False)
    else:
        if isinstance(interval, int) and interval >= 1:
            walk.put("eval.every_n_steps", interval, p + "val_check_interval")
        else:
            walk.drop(p + "val_check_interval", "a fraction of an epoch has no counterpart; eval.every_n_steps "
                                                "counts optimizer steps")
        if isinstance(limit, int) and limit >= 1:
            walk.put("eval.max_batches", limit, p + "limit_val_batches")
        else:
            walk.keep(p + "limit_val_batches", "all validation batches (eval.max_batches unset)")
    walk.drop(p + "check_val_every_n_epoch", "evaluation is scheduled in steps (eval.every_n_steps)")
    walk.drop(p + "num_sanity_val_steps", "Lightning's sanity check; eval.before evaluates once before step 1")
    walk.drop(p + "limit_test_batches", "nxd-finetune has no test loop")
    walk.drop(p + "lnc", "Trainium's logical NeuronCore setting is the machine's (NEURON_LOGICAL_NC_CONFIG), "
                         "not the recipe's")
    walk.drop(p + "sequential_move_factor", "NxD's staged weight initialisation; nxd-finetune loads each rank's "
                                            "shard straight from the HF checkpoint")


def _exp_manager(walk: KeyWalk) -> None:
    p = "exp_manager."
    out, where = walk.text(p + "explicit_log_dir"), p + "explicit_log_dir"
    if not out:
        name = walk.text(p + "name") or walk.text("name") or "run"
        out, where = str(Path(walk.text(p + "exp_dir") or "outputs") / name), f"{p}exp_dir/{p}name"
    walk.put("output.dir", walk.path(out, where), p + "explicit_log_dir", p + "exp_dir", p + "name", "name")
    walk.put("logging.tensorboard", walk.flag(p + "create_tensorboard_logger"), p + "create_tensorboard_logger")
    if walk.flag(p + "resume_if_exists"):
        walk.put("checkpoint.resume", "latest", p + "resume_if_exists", p + "resume_ignore_no_checkpoint")
    else:
        walk.put("checkpoint.resume", None, p + "resume_if_exists")
        walk.keep(p + "resume_ignore_no_checkpoint", "no resume (resume_if_exists is false)")
    cb = p + "checkpoint_callback_params."
    if walk.flag(p + "create_checkpoint_callback", True) and walk.has(cb + "every_n_train_steps"):
        walk.put("checkpoint.every_n_steps", walk.integer(cb + "every_n_train_steps"),
                 cb + "every_n_train_steps", p + "create_checkpoint_callback")
    else:
        walk.put("checkpoint.every_n_steps", None, p + "create_checkpoint_callback", cb + "every_n_train_steps")
    top_k = walk.integer(cb + "save_top_k", 1)
    if top_k >= 1:
        walk.put("checkpoint.keep_last", top_k, cb + "save_top_k")
    else:
        walk.drop(cb + "save_top_k", f"save_top_k={top_k} has no counterpart; checkpoint.keep_last keeps the newest N")
    for key in ("monitor", "mode", "save_last", "filename", "model_parallel_size"):
        walk.drop(cb + key, "Lightning ModelCheckpoint naming/ranking; nxd-finetune keeps the newest checkpoints "
                            "by step under checkpoint.dir")
    walk.drop(cb + "use_master_weights_in_ckpt", "checkpoints hold what the run trains; fp32 master weights of "
                                                 "ZeRO-1 are saved with the optimizer state")
    walk.put("checkpoint.async_save", walk.flag(p + "async_checkpointing"), p + "async_checkpointing")
    for key in ("save_xser", "load_xser", "save_bf16", "ckpt_ptl_version"):
        walk.drop(p + key, "NxD checkpoint file format; nxd-finetune writes safetensors")
    walk.drop(p + "log_local_rank_0_only", "nxd-finetune logs from global rank 0 only")
    walk.drop(p + "log_parameter_norm", "the parameter norm is not logged (the gradient norm is, every logged step)")
    walk.keep(p + "log_gradient_norm", "logged on every logged step (grad_norm)")
    walk.drop(p + "enable_recovery_time_instrumentation", "no recovery-time instrumentation")
    if not walk.has(p + "resume_from_checkpoint"):
        walk.keep(p + "resume_from_checkpoint", "null: the run starts from model.path")
    else:
        walk.drop(p + "resume_from_checkpoint",
                  "an NxD checkpoint: convert it with `nxd-finetune import nxdt-checkpoint DIR --out OUT`, then "
                  "use OUT as model.path (base weights) or lora.init_from (adapter)")


def _data(walk: KeyWalk) -> None:
    p = "data."
    walk.put("training.micro_batch_size", walk.integer(p + "micro_batch_size", 1), p + "micro_batch_size")
    if walk.has(p + "global_batch_size"):
        walk.put("training.global_batch_size", walk.integer(p + "global_batch_size"), p + "global_batch_size")
    if walk.has(p + "train_dir"):
        walk.put("data.train", walk.path(walk.text(p + "train_dir"), p + "train_dir"), p + "train_dir")
    if walk.has(p + "val_dir") and walk.recipe.get("eval", {}).get("before") is not False:
        walk.put("data.eval", walk.path(walk.text(p + "val_dir"), p + "val_dir"), p + "val_dir")
    else:
        walk.drop(p + "val_dir", "validation is off in this config (limit_val_batches=0)")
    if walk.has(p + "dev_choose_samples"):
        walk.put("data.max_samples", walk.integer(p + "dev_choose_samples"), p + "dev_choose_samples")
    seq_key = p + "seq_length" if walk.has(p + "seq_length") else "model.encoder_seq_length"
    if walk.has(seq_key):
        walk.put("data.max_seq_len", walk.integer(seq_key), p + "seq_length")
    if walk.has(p + "tokenizer.type"):
        tokenizer = walk.path(walk.text(p + "tokenizer.type"), p + "tokenizer.type")
        walk.put("model.tokenizer", tokenizer, p + "tokenizer.type")
    for key in ("dataset_name", "subset_name", "prompt_name"):
        walk.drop(p + key, "promptsource templates are not applied; put the prompt text into the data")


def _model(walk: KeyWalk, model_path: str | None) -> None:
    p = "model."
    if model_path is not None:  # its config.json defines the model: model.model_config names another machine's
        model_dir = Path(walk.path(model_path, "--model"))
        config_file = model_dir / "config.json"
        hf = _read_json(config_file, f"--model {model_path}")
        walk.put("model.path", str(model_dir))
        walk.keep(p + "model_config", f"--model {model_path} (its config.json) takes its place")
    else:
        if not walk.has(p + "model_config"):
            raise RecipeError("model.model_config is not set: pass --model DIR, the HF checkpoint to train")
        config_file = Path(walk.path(walk.text(p + "model_config"), p + "model_config"))
        hf = _read_json(config_file, p + "model_config")
        walk.put("model.path", str(config_file.parent), p + "model_config")
    same = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
            "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
            "num_attention_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "ffn_hidden_size": "intermediate_size"}
    for key, hf_key in same.items():
        if not walk.has(p + key):
            continue
        ours, theirs = walk.number(p + key), hf.get(hf_key, (hf.get("rope_parameters") or {}).get(hf_key))
        if isinstance(theirs, int | float) and ours == float(theirs):
            walk.keep(p + key, f"matches {config_file.name}'s {hf_key}")
        else:
            walk.drop(p + key, f"overrides {config_file.name}'s {hf_key}={theirs} with {walk.get(p + key)}: "
                               "nxd-finetune takes the architecture from the HF checkpoint it trains")
    seq = walk.integer(p + "encoder_seq_length", 0)
    if seq and walk.has("data.seq_length") and seq != walk.integer("data.seq_length"):
        walk.drop(p + "encoder_seq_length", f"data.seq_length={walk.get('data.seq_length')} sets the sequence length")
    else:
        walk.keep(p + "encoder_seq_length", "data.max_seq_len")
    for key in ("qkv_linear", "fuse_qkv", "transpose_nki_inputs"):
        walk.drop(p + key, "NxD's Neuron layer layout; nxd-finetune keeps HF's q/k/v and gate/up projections "
                           "(nxdt-checkpoint splits NxD's fused ones)")
    walk.drop(p + "use_cpu_initialization", "weights come from the HF checkpoint, shard by shard")
    walk.keep(p + "weight_init_only", "an imported checkpoint starts a run with weights only")
    if walk.has(p + "pipeline_cuts"):
        cuts = [name.rsplit(".", 1)[-1] for name in walk.names(p + "pipeline_cuts", [])]
        if not all(c.isdigit() for c in cuts):
            raise RecipeError(f"{p}pipeline_cuts: expected layer names (model.layers.K), found "
                              f"{shown(walk.get(p + 'pipeline_cuts'))}")
        walk.put("parallel.pp_cuts", [int(c) + 1 for c in cuts], p + "pipeline_cuts")
    gran = walk.text(p + "activations_checkpoint_granularity")
    walk.put("parallel.activation_checkpointing", {"selective": "selective", "full": "full"}.get(gran, "none"),
             p + "activations_checkpoint_granularity")
    recompute = walk.names(p + "activations_checkpoint_recompute", [])
    if recompute and gran == "selective":
        names = {"CoreAttention": "Attention"}
        if all(r in names for r in recompute):
            walk.put("parallel.checkpoint_modules", sorted({names[r] for r in recompute}),
                     p + "activations_checkpoint_recompute")
        else:
            walk.drop(p + "activations_checkpoint_recompute", f"modules {recompute} have no counterpart; "
                      "parallel.checkpoint_modules takes DecoderLayer, Attention, MLP or RMSNorm")
    else:
        walk.keep(p + "activations_checkpoint_recompute", "only used with selective checkpointing")
    fusions = {"softmax": "NxD's fused softmax kernel", "flash_attention": "NxD's NKI flash-attention kernel",
               "ring_attention": "ring attention (context parallelism)"}
    for key, what in fusions.items():
        if walk.flag(p + "fusions." + key):
            walk.drop(p + "fusions." + key, f"{what} has no counterpart; nxd-finetune runs PyTorch's attention")
        else:
            walk.keep(p + "fusions." + key, f"off: {what} is not used, as in nxd-finetune")
    for key in (p + "do_layer_norm_weight_decay", p + "fusions.do_layer_norm_weight_decay"):
        if walk.flag(key):
            walk.drop(key, "nxd-finetune never decays norm weights or biases (1-d parameters)")
        else:
            walk.keep(key, "no weight decay on norm weights, as nxd-finetune")
    translate_moe(walk, hf, config_file.name)
    _optim(walk)
    for key in sorted(k for k in walk.flat if k.startswith(p) and k not in walk.used):
        walk.drop(key, "Megatron/NeMo model setting; the HF config.json defines the model")


def _optim(walk: KeyWalk) -> None:
    p = "model.optim."
    name = walk.text(p + "name", "adamw")
    if name in ("adamw", "adamw_fp32OptState"):
        walk.keep(p + "name", "AdamW (its state in fp32 unless the whole run is bf16)")
    else:
        walk.drop(p + "name", f"optimizer {name!r} has no counterpart; nxd-finetune trains with AdamW")
    if walk.has(p + "lr"):
        walk.put("training.lr", walk.number(p + "lr"), p + "lr")
    if walk.has(p + "weight_decay"):
        walk.put("training.weight_decay", walk.number(p + "weight_decay"), p + "weight_decay")
    if walk.has(p + "betas"):
        walk.put("training.betas", walk.numbers(p + "betas"), p + "betas")
    if walk.has(p + "eps"):
        walk.put("training.eps", walk.number(p + "eps"), p + "eps")
    walk.drop(p + "capturable", "a CUDA-graph option of torch's AdamW; nothing to capture here")
    s = p + "sched."
    sched = walk.text(s + "name")
    if sched in SCHEDULERS:
        walk.put("training.scheduler", SCHEDULERS[sched], s + "name")
    elif sched:
        walk.drop(s + "name", f"scheduler {sched!r} has no counterpart (linear, cosine or constant)")
    steps = walk.integer("trainer.max_steps", -1)
    if walk.has(s + "warmup_steps"):
        walk.put("training.warmup_steps", walk.integer(s + "warmup_steps"), s + "warmup_steps")
    elif walk.has(s + "warmup_ratio") and steps > 0:
        walk.put("training.warmup_steps", round(walk.number(s + "warmup_ratio") * steps), s + "warmup_ratio")
    if walk.has(s + "max_steps") and (decay := walk.integer(s + "max_steps")) == steps:
        walk.keep(s + "max_steps", "the schedule ends at training.max_steps")
    elif walk.has(s + "max_steps"):
        walk.drop(s + "max_steps", f"the schedule ends at training.max_steps ({steps}), not at {decay}")
    if walk.has(s + "min_lr") and walk.number(p + "lr") > 0:
        walk.put("training.min_lr_ratio", walk.number(s + "min_lr") / walk.number(p + "lr"), s + "min_lr")
    else:
        walk.drop(s + "min_lr", "training.min_lr_ratio is min_lr / lr, and lr is not set above 0")
    if walk.integer(s + "constant_steps", 0) == 0:
        walk.keep(s + "constant_steps", "0: no constant phase, as nxd-finetune")
    else:
        walk.drop(s + "constant_steps", "no constant phase between warmup and decay")


def _preference(walk: KeyWalk, p: str) -> None:
    """``model_alignment_strategy.dpo`` / ``.orpo`` -> ``objective`` and the ``preference`` section
    (NxDT's DPO / ORPO data: jsonl rows with ``prompt``, ``chosen``, ``rejected``)."""
    given = [k for k in ("dpo", "orpo") if any(key.startswith(f"{p}{k}.") for key in walk.flat)]
    if not given:
        return
    kind = given[0]
    if len(given) > 1:
        walk.drop(p + "orpo", "the config also sets dpo, which was taken (one objective per run)")
    s = f"{p}{kind}."
    walk.put("objective", kind)
    walk.put("data.format", "preference")
    walk.recipe.get("data", {}).pop("fields", None)  # NxDT's preference rows use the format's own names
    beta = s + ("kl_beta" if kind == "dpo" else "beta")
    if walk.has(beta):
        walk.put("preference.beta", walk.number(beta), beta)
    if walk.has(s + "loss_type"):
        walk.put("preference.loss_type", walk.text(s + "loss_type"), s + "loss_type")
    if walk.has(s + "max_prompt_length"):
        walk.put("preference.max_prompt_length", walk.integer(s + "max_prompt_length"), s + "max_prompt_length")
    if walk.has(s + "truncation_mode"):
        walk.put("preference.truncation_mode", walk.text(s + "truncation_mode"), s + "truncation_mode")
    if walk.has(s + "precompute_ref_log_probs"):
        if walk.flag(s + "precompute_ref_log_probs"):
            walk.keep(s + "precompute_ref_log_probs", "reference log-probs are always computed once before training")
        else:
            walk.drop(s + "precompute_ref_log_probs", "a per-step reference forward is not supported: reference "
                      "log-probs are computed once before training")
    walk.drop(p + kind, f"no counterpart in nxd-finetune's {kind} objective")  # what is left of the section


def _alignment(walk: KeyWalk) -> None:
    p = "model_alignment_strategy."
    if walk.has(p + "sft.packing"):
        walk.put("data.packing", walk.flag(p + "sft.packing"), p + "sft.packing")
    if any(k.startswith(p) for k in walk.flat):
        # NxDT's SFT data module reads `input` / `output` columns (bos + input, output + eos; output trained)
        walk.put("data.format", "prompt_completion")
        walk.put("data.fields", {"prompt": "input", "completion": "output"})
    else:  # a pretraining config: every token trained (its tokenized datasets are not read here)
        walk.put("data.format", "text")
    _preference(walk, p)
    peft = p + "peft."
    if not any(k.startswith(peft) for k in walk.flat):
        return
    walk.put("lora.rank", walk.integer(peft + "lora_rank", 16), peft + "lora_rank")
    walk.put("lora.alpha", walk.number(peft + "lora_alpha", 32), peft + "lora_alpha")
    walk.put("lora.dropout", walk.number(peft + "lora_dropout", 0.05), peft + "lora_dropout")
    walk.put("lora.bias", walk.text(peft + "lora_bias", "none"), peft + "lora_bias")
    targets = walk.names(peft + "target_modules", ["qkv_proj"])
    walk.put("lora.target_modules", [t for name in targets for t in FUSED_TARGETS.get(name, (name,))],
             peft + "target_modules")
    walk.drop(peft + "lora_verbose", "LoRA logging; nxd-finetune prints the adapter's parameter count")
    if walk.flag(peft + "load_lora_from_ckpt"):
        walk.drop(peft + "load_lora_from_ckpt", "import the adapter with `nxd-finetune import nxdt-checkpoint` and "
                                                "set lora.init_from to it")
    else:
        walk.keep(peft + "load_lora_from_ckpt", "a fresh adapter")
    base, merge = walk.flag(peft + "save_lora_base"), walk.flag(peft + "merge_lora")
    mode = "merged" if merge else "base_and_adapter" if base else "adapter"
    walk.put("checkpoint.save_mode", mode, peft + "save_lora_base", peft + "merge_lora")
    for key in ("save_lora_config_adapter", "merge_sharded_lora"):
        walk.drop(peft + key, "NxD adapter file layout; nxd-finetune writes a PEFT adapter (adapter_config.json "
                              "+ adapter_model.safetensors)")


def _precision(walk: KeyWalk) -> None:
    kind = walk.text("precision.type", "fp32")
    manual = ("master_weights", "fp32_grad_acc", "xla_use_bf16", "xla_downcast_bf16",
              "neuron_rt_stochastic_rounding_en")
    if kind in PRECISIONS:
        training, neuron, sr = PRECISIONS[kind]
        walk.put("training.precision", training, "precision.type")
        walk.put("neuron.precision", neuron)
        if sr is not None:
            walk.put("neuron.stochastic_rounding", sr)
        if neuron == "bf16-master" and not walk.recipe["parallel"]["zero1"]:
            walk.put("parallel.zero1", True)
            walk.mapped.append(("precision.type", "parallel.zero1=true (NxDT's mixed_precision uses ZeRO-1)"))
        for key in manual:
            walk.keep("precision." + key, f"set by the {kind} preset (neuron.precision={neuron})")
    else:
        walk.drop("precision.type", f"precision type {kind!r}: set training.precision and neuron.precision yourself")
        for key in manual:
            walk.drop("precision." + key, "manual precision knobs: see docs/trainium.md for the presets")
    walk.drop("precision.parallel_layers_reduce_dtype", "collectives reduce in the gradients' dtype")


def _neuron(walk: KeyWalk) -> None:
    try:
        flags = shlex.split(walk.text("compiler_flags"))
    except ValueError as e:  # an unclosed quote
        raise RecipeError(f"compiler_flags: {shown(walk.get('compiler_flags'))} does not split into flags "
                          f"({e})") from None
    model_type = None
    rest: list[str] = []
    i = 0
    while i < len(flags):
        if flags[i] == "--model-type" and i + 1 < len(flags):
            model_type, i = flags[i + 1], i + 2
            continue
        if flags[i].startswith("--model-type="):
            model_type = flags[i].split("=", 1)[1]
        else:
            rest.append(flags[i])
        i += 1
    if model_type is not None:
        walk.put("neuron.model_type", model_type)
    walk.put("neuron.cc_flags", rest)
    walk.keep("compiler_flags", "neuron.model_type (--model-type) + neuron.cc_flags (the other flags)")
    if walk.has("compiler_cache_url"):
        url = walk.text("compiler_cache_url")
        walk.put("neuron.compile_cache", url if "://" in url else walk.path(url, "compiler_cache_url"),
                 "compiler_cache_url")
    for key, var in RUNTIME_ENV.items():
        if walk.has(key):
            value = int(walk.flag(key)) if isinstance(walk.get(key), bool) else walk.text(key)
            walk.drop(key, f"a Neuron runtime variable: export {var}={value} before `nxd-finetune run`")


def _read_json(path: Path, source: str) -> dict[str, Any]:
    """The HF ``config.json`` at ``path``, which ``source`` (--model or model.model_config) names."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        if source.startswith("--model"):
            raise RecipeError(f"{source}: no {path} (--model is the HF checkpoint's directory)") from None
        raise RecipeError(f"{source}: {path} does not exist here: pass --model DIR, the HF checkpoint to train "
                          "(its config.json defines the model)") from None
    except (OSError, ValueError) as e:
        raise RecipeError(f"{source}: {path} is not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: {path} is not a JSON object")
    return data

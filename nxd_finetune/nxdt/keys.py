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

import dataclasses
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nxd_finetune.errors import RecipeError

if TYPE_CHECKING:
    from nxd_finetune.recipe import RecipeDict
    from nxd_finetune.recipe.yaml_loader import YamlValue

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

@dataclasses.dataclass
class KeyWalk:
    """The flattened config (dotted key -> leaf value), the recipe being built and the report."""

    flat: dict[str, YamlValue]
    base: Path  # relative NxDT paths are relative to the directory training starts in
    recipe: RecipeDict = dataclasses.field(default_factory=dict)
    mapped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    dropped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    used: set[str] = dataclasses.field(default_factory=set)

    def get(self, key: str, default: YamlValue = None) -> YamlValue:
        value = self.flat.get(key, default)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.flat.get(key) is not None

    def _keys(self, key: str) -> list[str]:
        return [k for k in self.flat if (k == key or k.startswith(key + ".")) and k not in self.used]

    def put(self, recipe_key: str, value: YamlValue, *keys: str) -> None:
        """Set ``recipe_key`` (dotted) to ``value``; ``keys`` are the NxDT keys it comes from."""
        node = self.recipe
        *parents, last = recipe_key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        for key in keys:
            for k in self._keys(key):
                self.used.add(k)
                self.mapped.append((k, recipe_key))

    def keep(self, key: str, note: str) -> None:
        """``key`` needs no recipe key of its own (already covered, or a default that agrees)."""
        for k in self._keys(key):
            self.used.add(k)
            self.mapped.append((k, note))

    def drop(self, key: str, reason: str) -> None:
        """``key`` (and everything under it) is not carried over, for ``reason``."""
        for k in self._keys(key):
            self.used.add(k)
            self.dropped.append((k, reason))

    def path(self, value: str) -> str:
        """An NxDT path made absolute (NxDT reads relative paths from the working directory)."""
        p = Path(str(value)).expanduser()
        return str(p if p.is_absolute() else (self.base / p).resolve())


def translate(walk: KeyWalk, model_path: str | None) -> None:
    """Apply every section's rules, then list the keys no rule knew."""
    source = walk.get("model_source", "hf")
    if source != "hf":
        raise RecipeError(f"model_source={source!r}: only NxDT's HF models (model_source: hf) can be imported; "
                          "a Megatron model has no HF checkpoint to train from")
    walk.keep("model_source", "HF model (model.path)")
    walk.keep("name", "output.dir (with exp_manager)")
    if walk.has("seed"):
        walk.put("training.seed", int(walk.get("seed")), "seed")
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
    tp = int(walk.get(p + "tensor_model_parallel_size", 1))
    pp = int(walk.get(p + "pipeline_model_parallel_size", 1))
    vpp = int(walk.get(p + "virtual_pipeline_model_parallel_size", 1))
    walk.put("parallel.tp", tp, p + "tensor_model_parallel_size")
    walk.put("parallel.pp", pp, p + "pipeline_model_parallel_size")
    walk.put("parallel.virtual_stages", vpp, p + "virtual_pipeline_model_parallel_size")
    if vpp > 1:
        walk.put("parallel.pp_schedule", "interleaved_1f1b")
    walk.put("parallel.zero1", bool(walk.get(p + "zero1", False)), p + "zero1")
    if walk.get(p + "sequence_parallel", False) and tp == 1:
        walk.drop(p + "sequence_parallel", "sequence parallelism needs tp > 1 (tp=1 here)")
    else:
        walk.put("parallel.sequence_parallel", bool(walk.get(p + "sequence_parallel", False)), p + "sequence_parallel")
    walk.keep(p + "kv_replicator", "not needed: nxd-finetune replicates KV heads itself when tp exceeds them "
                                   "(nxdt-checkpoint reads the replicated shards)")
    if int(walk.get(p + "context_parallel_size", 1)) > 1:
        walk.drop(p + "context_parallel_size", "nxd-finetune has no context parallelism (ring attention)")
    else:
        walk.keep(p + "context_parallel_size", "1: no context parallelism, as nxd-finetune")


def _trainer(walk: KeyWalk) -> None:
    p = "trainer."
    devices = int(walk.get(p + "devices", 1))
    nodes = int(walk.get(p + "num_nodes", 1))
    walk.put("parallel.nproc", devices * nodes, p + "devices", p + "num_nodes")
    steps, epochs = int(walk.get(p + "max_steps", -1)), int(walk.get(p + "max_epochs", -1))
    if steps > 0:
        walk.put("training.max_steps", steps, p + "max_steps")
        walk.keep(p + "max_epochs", "max_steps governs (as in Lightning when it is reached first)")
    elif epochs > 0:
        walk.put("training.epochs", float(epochs), p + "max_epochs", p + "max_steps")
    walk.put("logging.every_n_steps", int(walk.get(p + "log_every_n_steps", 1)), p + "log_every_n_steps")
    clip = walk.get(p + "gradient_clip_val")
    walk.put("training.grad_clip", float(clip) if clip else None, p + "gradient_clip_val")
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
    out = walk.get(p + "explicit_log_dir")
    if out is None:
        name = walk.get(p + "name") or walk.get("name") or "run"
        out = str(Path(walk.get(p + "exp_dir") or "outputs") / str(name))
    walk.put("output.dir", walk.path(out), p + "explicit_log_dir", p + "exp_dir", p + "name", "name")
    walk.put("logging.tensorboard", bool(walk.get(p + "create_tensorboard_logger", False)),
             p + "create_tensorboard_logger")
    if walk.get(p + "resume_if_exists", False):
        walk.put("checkpoint.resume", "latest", p + "resume_if_exists", p + "resume_ignore_no_checkpoint")
    else:
        walk.put("checkpoint.resume", None, p + "resume_if_exists")
        walk.keep(p + "resume_ignore_no_checkpoint", "no resume (resume_if_exists is false)")
    cb = p + "checkpoint_callback_params."
    if walk.get(p + "create_checkpoint_callback", True) and walk.has(cb + "every_n_train_steps"):
        walk.put("checkpoint.every_n_steps", int(walk.get(cb + "every_n_train_steps")),
                 cb + "every_n_train_steps", p + "create_checkpoint_callback")
    else:
        walk.put("checkpoint.every_n_steps", None, p + "create_checkpoint_callback", cb + "every_n_train_steps")
    top_k = int(walk.get(cb + "save_top_k", 1))
    if top_k >= 1:
        walk.put("checkpoint.keep_last", top_k, cb + "save_top_k")
    else:
        walk.drop(cb + "save_top_k", f"save_top_k={top_k} has no counterpart; checkpoint.keep_last keeps the newest N")
    for key in ("monitor", "mode", "save_last", "filename", "model_parallel_size"):
        walk.drop(cb + key, "Lightning ModelCheckpoint naming/ranking; nxd-finetune keeps the newest checkpoints "
                            "by step under checkpoint.dir")
    walk.drop(cb + "use_master_weights_in_ckpt", "checkpoints hold what the run trains; fp32 master weights of "
                                                 "ZeRO-1 are saved with the optimizer state")
    walk.put("checkpoint.async_save", bool(walk.get(p + "async_checkpointing", False)), p + "async_checkpointing")
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
    walk.put("training.micro_batch_size", int(walk.get(p + "micro_batch_size", 1)), p + "micro_batch_size")
    if walk.has(p + "global_batch_size"):
        walk.put("training.global_batch_size", int(walk.get(p + "global_batch_size")), p + "global_batch_size")
    if walk.has(p + "train_dir"):
        walk.put("data.train", walk.path(walk.get(p + "train_dir")), p + "train_dir")
    if walk.has(p + "val_dir") and walk.recipe.get("eval", {}).get("before") is not False:
        walk.put("data.eval", walk.path(walk.get(p + "val_dir")), p + "val_dir")
    else:
        walk.drop(p + "val_dir", "validation is off in this config (limit_val_batches=0)")
    if walk.has(p + "dev_choose_samples"):
        walk.put("data.max_samples", int(walk.get(p + "dev_choose_samples")), p + "dev_choose_samples")
    seq = walk.get(p + "seq_length", walk.get("model.encoder_seq_length"))
    if seq is not None:
        walk.put("data.max_seq_len", int(seq), p + "seq_length")
    if walk.has(p + "tokenizer.type"):
        walk.put("model.tokenizer", walk.path(walk.get(p + "tokenizer.type")), p + "tokenizer.type")
    for key in ("dataset_name", "subset_name", "prompt_name"):
        walk.drop(p + key, "promptsource templates are not applied; put the prompt text into the data")


def _model(walk: KeyWalk, model_path: str | None) -> None:
    p = "model."
    if not walk.has(p + "model_config"):
        raise RecipeError("model.model_config is not set: the HF config.json (beside the HF weights) defines the model")
    config_file = Path(walk.path(walk.get(p + "model_config")))
    path = model_path if model_path is not None else str(config_file.parent)
    walk.put("model.path", walk.path(path), p + "model_config")
    hf = _read_json(config_file)
    same = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
            "max_position_embeddings": "max_position_embeddings", "rope_theta": "rope_theta",
            "num_attention_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "ffn_hidden_size": "intermediate_size"}
    for key, hf_key in same.items():
        if not walk.has(p + key):
            continue
        ours, theirs = walk.get(p + key), hf.get(hf_key, (hf.get("rope_parameters") or {}).get(hf_key))
        if theirs is not None and float(ours) == float(theirs):
            walk.keep(p + key, f"matches {config_file.name}'s {hf_key}")
        else:
            walk.drop(p + key, f"overrides {config_file.name}'s {hf_key}={theirs} with {ours}: nxd-finetune takes "
                               "the architecture from the HF checkpoint it trains")
    seq = walk.get(p + "encoder_seq_length")
    if seq is not None and walk.has("data.seq_length") and int(seq) != int(walk.get("data.seq_length")):
        walk.drop(p + "encoder_seq_length", f"data.seq_length={walk.get('data.seq_length')} sets the sequence length")
    else:
        walk.keep(p + "encoder_seq_length", "data.max_seq_len")
    for key in ("qkv_linear", "fuse_qkv", "transpose_nki_inputs"):
        walk.drop(p + key, "NxD's Neuron layer layout; nxd-finetune keeps HF's q/k/v and gate/up projections "
                           "(nxdt-checkpoint splits NxD's fused ones)")
    walk.drop(p + "use_cpu_initialization", "weights come from the HF checkpoint, shard by shard")
    walk.keep(p + "weight_init_only", "an imported checkpoint starts a run with weights only")
    if walk.has(p + "pipeline_cuts"):
        cuts = [int(str(name).rsplit(".", 1)[-1]) + 1 for name in walk.get(p + "pipeline_cuts")]
        walk.put("parallel.pp_cuts", cuts, p + "pipeline_cuts")
    gran = walk.get(p + "activations_checkpoint_granularity")
    walk.put("parallel.activation_checkpointing", {"selective": "selective", "full": "full"}.get(str(gran), "none"),
             p + "activations_checkpoint_granularity")
    recompute = walk.get(p + "activations_checkpoint_recompute")
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
        if walk.get(p + "fusions." + key, False):
            walk.drop(p + "fusions." + key, f"{what} has no counterpart; nxd-finetune runs PyTorch's attention")
        else:
            walk.keep(p + "fusions." + key, f"off: {what} is not used, as in nxd-finetune")
    for key in (p + "do_layer_norm_weight_decay", p + "fusions.do_layer_norm_weight_decay"):
        if walk.get(key, False):
            walk.drop(key, "nxd-finetune never decays norm weights or biases (1-d parameters)")
        else:
            walk.keep(key, "no weight decay on norm weights, as nxd-finetune")
    _optim(walk)
    for key in sorted(k for k in walk.flat if k.startswith(p) and k not in walk.used):
        walk.drop(key, "Megatron/NeMo model setting; the HF config.json defines the model")


def _optim(walk: KeyWalk) -> None:
    p = "model.optim."
    name = walk.get(p + "name", "adamw")
    if name in ("adamw", "adamw_fp32OptState"):
        walk.keep(p + "name", "AdamW (its state in fp32 unless the whole run is bf16)")
    else:
        walk.drop(p + "name", f"optimizer {name!r} has no counterpart; nxd-finetune trains with AdamW")
    if walk.has(p + "lr"):
        walk.put("training.lr", float(walk.get(p + "lr")), p + "lr")
    if walk.has(p + "weight_decay"):
        walk.put("training.weight_decay", float(walk.get(p + "weight_decay")), p + "weight_decay")
    if walk.has(p + "betas"):
        walk.put("training.betas", [float(b) for b in walk.get(p + "betas")], p + "betas")
    if walk.has(p + "eps"):
        walk.put("training.eps", float(walk.get(p + "eps")), p + "eps")
    walk.drop(p + "capturable", "a CUDA-graph option of torch's AdamW; nothing to capture here")
    s = p + "sched."
    sched = walk.get(s + "name")
    if sched in SCHEDULERS:
        walk.put("training.scheduler", SCHEDULERS[sched], s + "name")
    elif sched is not None:
        walk.drop(s + "name", f"scheduler {sched!r} has no counterpart (linear, cosine or constant)")
    steps = walk.get("trainer.max_steps", -1)
    if walk.has(s + "warmup_steps"):
        walk.put("training.warmup_steps", int(walk.get(s + "warmup_steps")), s + "warmup_steps")
    elif walk.has(s + "warmup_ratio") and steps > 0:
        walk.put("training.warmup_steps", round(float(walk.get(s + "warmup_ratio")) * steps), s + "warmup_ratio")
    decay = walk.get(s + "max_steps")
    if decay is not None and int(decay) == int(steps):
        walk.keep(s + "max_steps", "the schedule ends at training.max_steps")
    elif decay is not None:
        walk.drop(s + "max_steps", f"the schedule ends at training.max_steps ({steps}), not at {decay}")
    if walk.has(s + "min_lr") and walk.has(p + "lr"):
        walk.put("training.min_lr_ratio", float(walk.get(s + "min_lr")) / float(walk.get(p + "lr")), s + "min_lr")
    if int(walk.get(s + "constant_steps", 0)) == 0:
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
        walk.put("preference.beta", float(walk.get(beta)), beta)
    if walk.has(s + "loss_type"):
        walk.put("preference.loss_type", str(walk.get(s + "loss_type")), s + "loss_type")
    if walk.has(s + "max_prompt_length"):
        walk.put("preference.max_prompt_length", int(walk.get(s + "max_prompt_length")), s + "max_prompt_length")
    if walk.has(s + "truncation_mode"):
        walk.put("preference.truncation_mode", str(walk.get(s + "truncation_mode")), s + "truncation_mode")
    if walk.has(s + "precompute_ref_log_probs"):
        if bool(walk.get(s + "precompute_ref_log_probs")):
            walk.keep(s + "precompute_ref_log_probs", "reference log-probs are always computed once before training")
        else:
            walk.drop(s + "precompute_ref_log_probs", "a per-step reference forward is not supported: reference "
                      "log-probs are computed once before training")
    walk.drop(p + kind, f"no counterpart in nxd-finetune's {kind} objective")  # what is left of the section


def _alignment(walk: KeyWalk) -> None:
    p = "model_alignment_strategy."
    if walk.has(p + "sft.packing"):
        walk.put("data.packing", bool(walk.get(p + "sft.packing")), p + "sft.packing")
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
    walk.put("lora.rank", int(walk.get(peft + "lora_rank", 16)), peft + "lora_rank")
    walk.put("lora.alpha", float(walk.get(peft + "lora_alpha", 32)), peft + "lora_alpha")
    walk.put("lora.dropout", float(walk.get(peft + "lora_dropout", 0.05)), peft + "lora_dropout")
    walk.put("lora.bias", str(walk.get(peft + "lora_bias", "none")), peft + "lora_bias")
    targets = walk.get(peft + "target_modules", ["qkv_proj"])
    targets = [targets] if isinstance(targets, str) else list(targets)
    walk.put("lora.target_modules", [t for name in targets for t in FUSED_TARGETS.get(name, (name,))],
             peft + "target_modules")
    walk.drop(peft + "lora_verbose", "LoRA logging; nxd-finetune prints the adapter's parameter count")
    if walk.get(peft + "load_lora_from_ckpt", False):
        walk.drop(peft + "load_lora_from_ckpt", "import the adapter with `nxd-finetune import nxdt-checkpoint` and "
                                                "set lora.init_from to it")
    else:
        walk.keep(peft + "load_lora_from_ckpt", "a fresh adapter")
    base, merge = bool(walk.get(peft + "save_lora_base", False)), bool(walk.get(peft + "merge_lora", False))
    mode = "merged" if merge else "base_and_adapter" if base else "adapter"
    walk.put("checkpoint.save_mode", mode, peft + "save_lora_base", peft + "merge_lora")
    for key in ("save_lora_config_adapter", "merge_sharded_lora"):
        walk.drop(peft + key, "NxD adapter file layout; nxd-finetune writes a PEFT adapter (adapter_config.json "
                              "+ adapter_model.safetensors)")


def _precision(walk: KeyWalk) -> None:
    kind = walk.get("precision.type", "fp32")
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
    flags = shlex.split(str(walk.get("compiler_flags", "")))
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
        url = str(walk.get("compiler_cache_url"))
        walk.put("neuron.compile_cache", url if "://" in url else walk.path(url), "compiler_cache_url")
    for key, var in RUNTIME_ENV.items():
        if walk.has(key):
            value = walk.get(key)
            if isinstance(value, bool):
                value = int(value)
            walk.drop(key, f"a Neuron runtime variable: export {var}={value} before `nxd-finetune run`")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"model.model_config: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise RecipeError(f"model.model_config: {path} is not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"model.model_config: {path} is not a JSON object")
    return data

"""NxD Training's example configs for HF models, as its releases ship them
(aws-neuron/neuronx-distributed-training ``examples/conf/``, Neuron SDK 2.26.0): their keys and
values, comments left out. Every one names the HF model by ``model.model_config:
/home/ubuntu/config.json``, a file of the machine they were written on; ``import nxdt-config
--model DIR`` must import them on any other.

``SFT`` is ``hf_llama3_8B_SFT_config.yaml``; each other config is given by what it changes in it
(dotted keys; ``DROP`` removes a key), which keeps the seven readable side by side.
"""

from __future__ import annotations

import copy
import re

import yaml

SFT = """\
name: hf_llama
model_source: hf
seed: 1234
trainer:
  devices: 32
  num_nodes: 1
  max_epochs: -1
  max_steps: 5000
  log_every_n_steps: 10
  val_check_interval: 500
  check_val_every_n_epoch: null
  num_sanity_val_steps: 0
  limit_val_batches: 0.0
  limit_test_batches: 0.0
  gradient_clip_val: 1.0
exp_manager:
  log_local_rank_0_only: True
  create_tensorboard_logger: True
  explicit_log_dir: null
  exp_dir: null
  name: hf_llama
  resume_if_exists: True
  resume_ignore_no_checkpoint: True
  create_checkpoint_callback: True
  checkpoint_callback_params:
    monitor: step
    save_top_k: 1
    mode: max
    save_last: False
    filename: 'hf_llama3_8B_SFT--{step}-{consumed_samples}'
    model_parallel_size: ${multiply:${distributed_strategy.tensor_model_parallel_size},
      ${distributed_strategy.pipeline_model_parallel_size}}
    every_n_train_steps: 10
    use_master_weights_in_ckpt: False
  log_parameter_norm: True
  log_gradient_norm: True
  enable_recovery_time_instrumentation: False
  save_xser: True
  load_xser: True
  save_bf16: False
  async_checkpointing: False
  resume_from_checkpoint: /home/ubuntu/pretrained_ckpt/
  ckpt_ptl_version: 1.8.6
distributed_strategy:
  tensor_model_parallel_size: 32
  pipeline_model_parallel_size: 1
  virtual_pipeline_model_parallel_size: 1
  zero1: True
  sequence_parallel: True
  kv_replicator: 4
data:
  micro_batch_size: 1
  global_batch_size: 64
  train_dir: /home/ubuntu/training.jsonl
  val_dir: /home/ubuntu/validation.jsonl
  dev_choose_samples: 2250
  seq_length: 4096
  tokenizer:
    type: /home/ubuntu/llama3_tokenizer
model:
  model_config: /home/ubuntu/config.json
  encoder_seq_length: 8192
  max_position_embeddings: 8192
  num_layers: 32
  hidden_size: 4096
  qkv_linear: True
  fuse_qkv: False
  rope_theta: 500000.0
  transpose_nki_inputs: False
  use_cpu_initialization: True
  weight_init_only: True
  activations_checkpoint_granularity: selective
  activations_checkpoint_recompute: [CoreAttention]
  fusions:
    softmax: True
    flash_attention: True
  do_layer_norm_weight_decay: True
  optim:
    name: adamw_fp32OptState
    lr: 1.5e-4
    weight_decay: 0.01
    capturable: False
    betas:
    - 0.9
    - 0.999
    sched:
      name: LinearAnnealingWithWarmUp
      warmup_steps: 10
      max_steps: ${trainer.max_steps}
model_alignment_strategy:
  sft:
    packing: True
precision:
  type: 'mixed_precision'
  master_weights: False
  fp32_grad_acc: False
  xla_use_bf16: '0'
  xla_downcast_bf16: '0'
  neuron_rt_stochastic_rounding_en: '0'
compiler_flags: '--model-type transformer'
compiler_cache_url: /home/ubuntu/neuron_cache
aync_exec_max_inflight_requests: 5
bucket_size_collectives: 1024
neuron_rt_exec_timeout: 100
neuron_experimental_compress_rg: False
"""

DROP = object()

# what a pretraining config changes in the SFT one (hf_llama3_8B_config.yaml)
_PRETRAIN = {
    "trainer.max_steps": 10000, "exp_manager.resume_from_checkpoint": None, "exp_manager.ckpt_ptl_version": DROP,
    "distributed_strategy.context_parallel_size": 1, "data.global_batch_size": 1024,
    "data.train_dir": "/home/ubuntu/examples_datasets/wikicorpus_llama3_tokenized_8k", "data.val_dir": DROP,
    "data.dev_choose_samples": DROP, "data.seq_length": DROP, "data.tokenizer": DROP, "model.fuse_qkv": True,
    "model.transpose_nki_inputs": DROP, "model.weight_init_only": DROP, "model_alignment_strategy": DROP,
}
_PEFT = {"lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_bias": "none", "lora_verbose": True,
         "target_modules": ["qkv_proj"], "load_lora_from_ckpt": False, "save_lora_base": True, "merge_lora": False,
         "save_lora_config_adapter": True, "merge_sharded_lora": False}
_PREFERENCE = {"exp_manager.resume_from_checkpoint": "/home/ubuntu/pretrained_ckpt", "data.val_dir": None,
               "data.dev_choose_samples": None, "model.transpose_nki_inputs": DROP,
               "model.activations_checkpoint_granularity": "full", "model.activations_checkpoint_recompute": None}

EDITS: dict[str, dict[str, object]] = {
    "hf_llama3_8B_SFT_config.yaml": {},
    "hf_llama3_8B_SFT_lora_config.yaml": {
        "exp_manager.checkpoint_callback_params.use_master_weights_in_ckpt": DROP,
        "distributed_strategy.zero1": False, "model.transpose_nki_inputs": DROP,
        "model_alignment_strategy.peft": _PEFT, "precision.type": "autocast"},
    "hf_llama3_8B_DPO_config.yaml": {
        **_PREFERENCE, "exp_manager.checkpoint_callback_params.filename": "hf_llama3_8B_DPO--{step}-{consumed_samples}",
        "exp_manager.checkpoint_callback_params.every_n_train_steps": 1000, "data.global_batch_size": 4,
        "data.train_dir": "/home/ubuntu/data_dpo.jsonl", "model.optim.lr": 5.0e-7, "model_alignment_strategy": {
            "dpo": {"kl_beta": 0.01, "loss_type": "sigmoid", "max_prompt_length": 2048,
                    "precompute_ref_log_probs": True, "truncation_mode": "keep_start"}}},
    "hf_llama3_8B_ORPO_config.yaml": {
        **_PREFERENCE,
        "exp_manager.checkpoint_callback_params.filename": "hf_llama3_8B_ORPO--{step}-{consumed_samples}",
        "data.global_batch_size": 16, "data.train_dir": "/home/ubuntu/data_orpo.jsonl",
        "model.encoder_seq_length": 4096, "model.optim.sched.name": "CosineAnnealing",
        "model_alignment_strategy": {"orpo": {"beta": 0.1, "max_prompt_length": 2048,
                                              "truncation_mode": "keep_start"}}},
    "hf_llama3_8B_config.yaml": {
        **_PRETRAIN, "trainer.num_nodes": 4, "trainer.val_check_interval": 10001,
        "exp_manager.checkpoint_callback_params.filename": "hf_llama3_8B--{step}-{consumed_samples}",
        "model.optim.sched.warmup_steps": 100},
    "hf_llama3_8B_trn2_config.yaml": {
        **_PRETRAIN, "trainer.devices": 64, "trainer.lnc": 2, "trainer.val_check_interval": 30001,
        "trainer.sequential_move_factor": 32, "distributed_strategy.context_parallel_size": DROP,
        "exp_manager.checkpoint_callback_params.filename": "hf_llama3_8B--{step}-{consumed_samples}",
        "exp_manager.checkpoint_callback_params.every_n_train_steps": 500,
        "distributed_strategy.tensor_model_parallel_size": 16, "distributed_strategy.kv_replicator": 2,
        "model.activations_checkpoint_granularity": None, "model.activations_checkpoint_recompute": DROP,
        "model.optim.sched.warmup_steps": 100, "compiler_cache_url": "/workspace/neuron_cache"},
    "hf_llama3_70B_CP_config.yaml": {
        **_PRETRAIN, "trainer.num_nodes": 16, "trainer.max_steps": 30000, "trainer.val_check_interval": 30001,
        "exp_manager.checkpoint_callback_params.filename": "hf_llama3_70B--{step}-{consumed_samples}",
        "distributed_strategy.context_parallel_size": 2, "distributed_strategy.pipeline_model_parallel_size": 8,
        "model.num_layers": 80, "model.hidden_size": 8192,
        "model.activations_checkpoint_recompute": ["CoreAttention", "LlamaMLP"],
        "model.fusions.flash_attention": False, "model.fusions.ring_attention": True, "model.optim.name": "adamw",
        "model.optim.lr": 0.000015, "model.optim.weight_decay": 0.1, "model.optim.betas": [0.9, 0.95],
        "model.optim.sched.name": "CosineAnnealing", "model.optim.sched.warmup_steps": 2000,
        "model.optim.sched.min_lr": 1e-06, "model.optim.sched.constant_steps": 0},
}


def example_config(name: str) -> str:
    """The YAML text of the example config ``name`` (a key of ``EDITS``)."""
    tree = yaml.safe_load(SFT)
    for dotted, value in EDITS[name].items():
        *parents, last = dotted.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        if value is DROP:
            node.pop(last, None)
        else:
            node[last] = copy.deepcopy(value)
    return yaml.safe_dump(tree, sort_keys=False)


def reported(err: str) -> dict[str, str]:
    """NxDT key -> its report line, asserting each key is reported once."""
    keys: dict[str, str] = {}
    for line in err.splitlines():
        m = re.match(r"^(mapped|not carried over): ([^ :]+)(?: -> |: )", line)
        if m:
            assert m.group(2) not in keys, f"{m.group(2)} reported twice"
            keys[m.group(2)] = line
    return keys

"""A home for NeuronX Distributed Training (NxDT) users: their YAML configs and their checkpoints.

- :mod:`.config`: an NxDT YAML config (``trainer``, ``exp_manager``, ``distributed_strategy``,
  ``data``, ``model``, ``model_alignment_strategy``, ``precision``, ``compiler_flags``, ...), its
  ``${...}`` interpolations resolved by OmegaConf as NxDT resolves them, translated into a recipe;
  every key is either mapped or listed as not carried over, with the reason (:mod:`.keys`), each
  value read with its type checked (:mod:`.walk`); ``${oc.env:...}`` is refused.
- :mod:`.checkpoint`: NxD's sharded model checkpoint
  (``<dir>/<tag>/model/dp_rank_00_tp_rank_YY_pp_rank_ZZ.pt``, a ``done`` marker) read with
  ``torch.load(weights_only=True)`` and united into HF tensors (:mod:`.layout`: NxD's parameter
  names, fused ``qkv_proj`` / ``gate_up_proj``, GQA kv replication; :mod:`.experts`: Mixtral's
  router and fused experts, split over expert-parallel ranks too).
- :mod:`.moe_keys`: NxDT's ``model.moe`` keys and ``expert_model_parallel_size`` against the HF config.
- :mod:`.lora`: an NxD LoRA adapter checkpoint into a PEFT adapter (fused names split into HF's).
- :mod:`.cli`: ``nxd-finetune import nxdt-config`` and ``nxd-finetune import nxdt-checkpoint``.

The formats follow NxD's own source: ``neuronx_distributed/trainer/checkpoint.py`` (file names,
markers), ``scripts/checkpoint_converter.py`` (parameter names, shard dims, the query-head order
under kv replication), ``modules/qkv_linear.py`` (GQA qkv, kv replication per hardware) and
``modules/lora/`` (adapter names and shards) and ``modules/moe/`` (the experts' layout).
"""

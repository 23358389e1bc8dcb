"""NxD Training's Mixtral: ``import nxdt-checkpoint`` reads NxD's expert layout (router, fused
``gate_up_proj`` / ``down_proj`` split over ep and tp, pp stages; tests/nxdt_moe_helpers.py writes it
from transformers' tensors as NxD does) into transformers' fused experts, bit for bit, and the
imported model's logits are transformers' MixtralForCausalLM's; ``import nxdt-config`` maps NxDT's
``model.moe`` keys and ``expert_model_parallel_size``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from nxdt_example_configs import reported
from nxdt_helpers import assert_bit_equal, read_hf, shard_lora, write_checkpoint
from nxdt_moe_helpers import shard_moe
from safetensors.torch import load_file

from tests.cli_run import run_cli
from tests.moe_helpers import build_tiny_moe, tiny_moe_config

CASES = [(1, 2, 2), (2, 1, 1), (2, 2, 1), (2, 2, 2), (4, 2, 1), (2, 4, 2)]  # (ep, tp, pp)


def cli(capsys, *args: object) -> tuple[int, str, str]:
    capsys.readouterr()  # what fixtures printed (transformers' progress bars)
    return run_cli(capsys, *map(str, args))


def run_ok(capsys, *args: object) -> str:
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    return out


@pytest.fixture
def mixtral(tmp_path):
    """Tiny Mixtral (4 experts of width 96, top 2, 4 query / 2 KV heads, 2 layers) as transformers
    writes it, its in-memory tensors (fused experts) and config.json."""
    path = tmp_path / "hf-mixtral"
    model = build_tiny_moe(tiny_moe_config("mixtral"), path)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, path, hf, json.loads((path / "config.json").read_text())


@pytest.mark.parametrize(("ep", "tp", "pp"), CASES)
def test_mixtral_bit_exact(capsys, tmp_path, mixtral, ep, tp, pp):
    """Every layout's import is the checkpoint transformers wrote, tensor for tensor, bit for bit."""
    _, path, hf, cfg = mixtral
    shards = shard_moe(hf, cfg, ep, tp, pp, m=max(1, tp // cfg["num_key_value_heads"]))
    if ep > 1:
        assert (ep - 1, tp - 1, pp - 1) in shards
    tag = write_checkpoint(tmp_path / "ckpt", "step=4", shards)
    out = tmp_path / "hf"
    said = run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", out, "--config", path / "config.json")
    assert (f"ep={ep}, " if ep > 1 else "(") + f"tp={tp}, pp={pp}" in said
    assert_bit_equal(read_hf(out), read_hf(path))


@pytest.mark.parametrize("variant", ["xser", "experts_only", "bf16"])
def test_mixtral_ep_file_variants(capsys, tmp_path, mixtral, variant):
    """``save_xser``: ep rank 1's folder lacks the tensors that are not its experts' (read from ep rank
    0's, as NxD's loader does); ``experts_only``: ep rank 1's files hold its experts alone (NxD's
    converter); ``bf16``: the dtype is kept (the router too)."""
    _, path, hf, cfg = mixtral
    if variant == "bf16":
        hf = {k: v.to(torch.bfloat16) for k, v in hf.items()}
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_moe(hf, cfg, 2, 2, 2, experts_only=variant == "experts_only"),
                           xser=variant == "xser")
    if variant == "xser":
        folders = [tag / "model" / f"dp_rank_00_ep_rank_{e:02d}_tp_rank_00_pp_rank_00.pt.tensors" for e in (0, 1)]
        files = [len(list(f.iterdir())) for f in folders]
        assert files[1] == 2 < files[0]  # layer 0's gate_up_proj and down_proj only
    out = tmp_path / "hf"
    run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", out, "--config", path)
    want = read_hf(path)
    assert_bit_equal(read_hf(out), {k: v.to(torch.bfloat16) for k, v in want.items()} if variant == "bf16" else want)


def test_imported_mixtral_logits_and_our_loader(capsys, tmp_path, mixtral):
    """The import of an ep2 x tp2 x pp2 checkpoint loads in transformers with the reference's logits
    (equal: the same weights), and in nxd-finetune's loader within 1e-5 of transformers'."""
    from transformers import AutoModelForCausalLM, MixtralForCausalLM

    from nxd_finetune.models import load_pretrained

    model, path, hf, cfg = mixtral
    tag = write_checkpoint(tmp_path / "ckpt", "t", shard_moe(hf, cfg, 2, 2, 2))
    run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "hf", "--config", path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert isinstance(loaded, MixtralForCausalLM)
    ids = torch.randint(0, cfg["vocab_size"], (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(loaded(ids).logits, want)
        ours = load_pretrained(tmp_path / "hf").eval()(ids)
    assert (ours - want).abs().max() <= 1e-5


def test_mixtral_attention_lora_under_ep(capsys, tmp_path, mixtral):
    """An NxD LoRA adapter on a Mixtral's attention (qkv_proj, o_proj) saved by ep2 x tp2 ranks (each ep
    rank's file holds the same adapter) imports into a PEFT adapter with the reference's logits."""
    import copy

    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

    model, path, _, cfg = mixtral
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    ref = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in sorted(ref.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        for layer in ref.base_model.model.model.layers:  # NxD's qkv_proj trains one A for q, k and v
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.lora_A.default.weight.copy_(layer.self_attn.q_proj.lora_A.default.weight)
    files = {"base_model.model." + k.removeprefix("base_model.model."): v.clone()
             for k, v in get_peft_model_state_dict(ref).items()}
    lora = shard_lora(files, cfg, 2, 1)
    tag = write_checkpoint(tmp_path / "ckpt", "t", {(e, t, p): s for e in range(2) for (t, p), s in lora.items()},
                           extra={"lora_config": {"lora_alpha": 16, "r": 4}})
    said = run_ok(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / "adapter", "--config", path)
    assert "ep=2, tp=2, pp=1" in said and "8 modules" in said
    assert_bit_equal(load_file(tmp_path / "adapter" / "adapter_model.safetensors"), files)
    ids = torch.randint(0, cfg["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = PeftModel.from_pretrained(copy.deepcopy(model), tmp_path / "adapter").eval()(ids).logits
        assert torch.equal(got, ref.eval()(ids).logits)


def test_bad_moe_checkpoints_are_one_line(capsys, tmp_path, mixtral):
    _, path, hf, cfg = mixtral
    shards = shard_moe(hf, cfg, 2, 2, 1)
    cases: dict[str, Path] = {}
    missing = write_checkpoint(tmp_path / "a", "t", shards)
    (missing / "model" / "dp_rank_00_ep_rank_01_tp_rank_01_pp_rank_00.pt").unlink()
    cases["misses 1 of its 2x2x1 shards, first ep_rank_01_tp_rank_01_pp_rank_00"] = missing
    mixed = write_checkpoint(tmp_path / "b", "t", shards)
    torch.save(shards[(0, 0, 0)], mixed / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    cases["with and without ep_rank"] = mixed
    other = shard_moe({k: v + 1 if "norm" in k else v for k, v in hf.items()}, cfg, 2, 2, 1)
    two = write_checkpoint(tmp_path / "c", "t", {**shards, (1, 0, 0): other[(1, 0, 0)]})
    cases["model.layers.0.input_layernorm.weight differs between ep ranks 0 and 1"] = two
    # NxD's checkpoint converter stacks HF's [I, H] expert weights untransposed: not the module's [E, H, 2I/tp]
    flipped = {r: {k: v.transpose(1, 2).contiguous() if "expert_mlps" in k else v for k, v in s.items()}
               for r, s in shards.items()}
    cases["model.layers.0.mlp.experts.gate_up_proj: united to (4, 128, 96), the model config needs (4, 192, 64)"] = \
        write_checkpoint(tmp_path / "d", "t", flipped)
    lora = {r: {**s, "model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.lora_A.weight": torch.zeros(4, 64),
                "model.layers.0.mlp.expert_mlps.mlp_op.gate_up_proj.lora_B.weight": torch.zeros(96, 4)}
            for r, s in shards.items()}
    cases["LoRA on NxD's fused expert layers is not imported"] = write_checkpoint(tmp_path / "e", "t", lora)
    for i, (words, tag) in enumerate(cases.items()):
        code, _, err = cli(capsys, "import", "nxdt-checkpoint", tag, "--out", tmp_path / f"o{i}", "--config", path)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, (words, err)
        assert not (tmp_path / f"o{i}").exists()


# ----------------------------------------------------------------------------------- config

# NxDT's hf_mixtral_8x7b_dropless_config.yaml (neuronx-distributed-training examples/conf/), its
# sizes scaled to 8 devices and the tiny model; comments left out
MIXTRAL_CONFIG = """\
name: hf_mixtral_dropless
model_source: hf
seed: 1234
trainer:
  devices: 8
  num_nodes: 1
  max_epochs: -1
  max_steps: 100
  log_every_n_steps: 1
  val_check_interval: 101
  check_val_every_n_epoch: null
  num_sanity_val_steps: 0
  limit_val_batches: 0
  limit_test_batches: 0
  gradient_clip_val: 1.0
exp_manager:
  create_tensorboard_logger: True
  explicit_log_dir: null
  exp_dir: null
  name: hf_mixtral_dropless
  resume_if_exists: True
  save_xser: True
  load_xser: True
  resume_from_checkpoint: null
distributed_strategy:
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 1
  virtual_pipeline_model_parallel_size: 1
  zero1: True
  sequence_parallel: True
  expert_model_parallel_size: 2
data:
  micro_batch_size: 1
  global_batch_size: 32
  train_dir: /home/ubuntu/examples_datasets/wikicorpus_llama2_tokenized_4k
model:
  encoder_seq_length: 256
  model_config: /home/ubuntu/config.json
  max_position_embeddings: ${.encoder_seq_length}
  num_layers: 2
  hidden_size: 64
  use_cpu_initialization: True
  moe:
    num_experts: 4
    frequency: 1
    dropout: 0.0
    capacity_factor: 0.0
    dropless: True
    routing_algorithm: top_k
    top_k: 2
    output_router_logits: True
    router_aux_loss_coef: 0.02
    normalize_top_k_affinities: True
  activations_checkpoint_granularity: 'full'
  activations_checkpoint_recompute: null
  fusions:
    softmax: True
    flash_attention: False
  optim:
    name: adamw
    lr: 3e-4
    weight_decay: 0.1
    betas: [0.9, 0.95]
    sched:
      name: CosineAnnealing
      warmup_steps: 10
      constant_steps: 0
      min_lr: 3.0e-5
precision:
  type: 'mixed_precision'
compiler_flags: '--model-type transformer'
"""


def test_mixtral_config_maps_moe_keys(capsys, tmp_path, mixtral):
    """NxDT's dropless Mixtral config on the tiny Mixtral: ep carried over, sequence parallel not (an
    MoE model's rows are whole here), the architecture keys that agree with config.json mapped, the
    router loss settings that differ named with what to change; the recipe fits the model."""
    from nxd_finetune.models import DecoderConfig
    from nxd_finetune.recipe import check_against_model, load_recipe

    _, path, _, cfg = mixtral
    (tmp_path / "mixtral.yaml").write_text(MIXTRAL_CONFIG)
    out = tmp_path / "recipe.yaml"
    code, _, err = cli(capsys, "import", "nxdt-config", tmp_path / "mixtral.yaml", "--model", path, "-o", out)
    assert code == 0, err
    lines = reported(err)
    assert lines["distributed_strategy.expert_model_parallel_size"] == \
        "mapped: distributed_strategy.expert_model_parallel_size -> parallel.ep"
    assert lines["distributed_strategy.sequence_parallel"].startswith(
        "not carried over: distributed_strategy.sequence_parallel: a mixture-of-experts model's router")
    for key, hf_key in (("num_experts", "num_local_experts"), ("top_k", "num_experts_per_tok"),
                        ("dropout", "attention_dropout")):
        assert lines[f"model.moe.{key}"] == f"mapped: model.moe.{key} -> matches config.json's {hf_key}"
    assert cfg["router_aux_loss_coef"] == 0.001 and not cfg["output_router_logits"]
    assert lines["model.moe.router_aux_loss_coef"] == (
        "not carried over: model.moe.router_aux_loss_coef: NxDT sets router_aux_loss_coef=0.02 over config.json's "
        "0.001; nxd-finetune reads it from config.json: set it there to train the router auxiliary loss as NxDT did")
    assert "output_router_logits=True over config.json's False" in lines["model.moe.output_router_logits"]
    for key in ("capacity_factor", "dropless", "routing_algorithm", "normalize_top_k_affinities", "frequency"):
        assert lines[f"model.moe.{key}"].startswith("mapped: "), lines[f"model.moe.{key}"]
    assert "full capacity (dropless)" in lines["model.moe.capacity_factor"]
    recipe = yaml.safe_load(out.read_text())
    assert recipe["parallel"]["ep"] == 2 and recipe["parallel"]["sequence_parallel"] is False
    check_against_model(load_recipe(out), DecoderConfig.from_hf(path / "config.json"))


@pytest.mark.parametrize(("edit", "key", "words"), [
    ({"capacity_factor": 1.25}, "model.moe.capacity_factor", "NxDT drops the tokens beyond an expert's capacity "
                                                              "(1.25 x tokens x top_k / experts)"),
    ({"capacity_factor": 2.0}, "model.moe.capacity_factor", "mapped: model.moe.capacity_factor -> full capacity"),
    ({"frequency": 2}, "model.moe.frequency", "NxDT puts dense MLP layers between its MoE layers"),
    ({"num_experts": 8}, "model.moe.num_experts", "NxDT sets num_local_experts=8 over config.json's 4; the "
                                                  "architecture is the HF checkpoint's"),
])
def test_mixtral_config_what_cannot_be_honoured(capsys, tmp_path, mixtral, edit, key, words):
    _, path, _, _ = mixtral
    tree = yaml.safe_load(MIXTRAL_CONFIG)
    tree["model"]["moe"].update(edit)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tree))
    code, _, err = cli(capsys, "import", "nxdt-config", tmp_path / "c.yaml", "--model", path, "-o", tmp_path / "r.yaml")
    assert code == 0, err
    assert words in reported(err)[key]


def test_moe_keys_on_a_dense_model(capsys, tmp_path, make_tiny_hf):
    _, path = make_tiny_hf("llama")
    tree = yaml.safe_load(MIXTRAL_CONFIG)
    tree["distributed_strategy"].update(sequence_parallel=False)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(tree))
    code, _, err = cli(capsys, "import", "nxdt-config", tmp_path / "c.yaml", "--model", path, "-o", tmp_path / "r.yaml")
    assert code == 0, err
    lines = reported(err)
    assert "defines a dense model (model_type 'llama'): it has no experts to split" in \
        lines["distributed_strategy.expert_model_parallel_size"]
    assert "NxDT's MoE settings apply to its Mixtral" in lines["model.moe.top_k"]
    assert "ep" not in yaml.safe_load((tmp_path / "r.yaml").read_text())["parallel"]

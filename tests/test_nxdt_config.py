"""``nxd-finetune import nxdt-config``: NxD Training configs written here from NxDT's documented keys
(config overview, SFT/LoRA/DPO tutorials) translated into recipes that ``validate`` accepts; every
key reported once, mapped or not carried over with its reason; ``${...}`` resolved as OmegaConf
resolves it, ``${oc.env:...}`` refused without its value shown. NxDT's own example configs imported
with ``--model`` on a machine without the file they name. Values of the wrong type or shape, and
``-o`` where nothing can be written, are one line. Also the README's "Coming from NxD Training"
commands, run as shown."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from nxdt_example_configs import EDITS, example_config, reported
from nxdt_helpers import shard_model, write_checkpoint
from safetensors.torch import load_file

from nxd_finetune.cli import main
from nxd_finetune.nxdt.config import flatten, resolve_config

REPO = Path(__file__).resolve().parents[1]

SFT_LORA = """\
name: tiny_sft_lora
model_source: hf
seed: 1234
trainer:
  devices: 8
  num_nodes: 1
  max_epochs: -1
  max_steps: 20
  log_every_n_steps: 2
  val_check_interval: 10
  check_val_every_n_epoch: null
  num_sanity_val_steps: 0
  limit_val_batches: 2
  limit_test_batches: 0.0
  gradient_clip_val: 1.0
  lnc: 2
  sequential_move_factor: 11
exp_manager:
  log_local_rank_0_only: True
  create_tensorboard_logger: True
  explicit_log_dir: null
  exp_dir: nemo_experiments
  name: ${name}
  resume_if_exists: True
  resume_ignore_no_checkpoint: True
  create_checkpoint_callback: True
  checkpoint_callback_params:
    monitor: step
    save_top_k: 3
    mode: max
    save_last: False
    filename: '${name}--{step}-{consumed_samples}'
    model_parallel_size: ${multiply:${distributed_strategy.tensor_model_parallel_size},
      ${distributed_strategy.pipeline_model_parallel_size}}
    every_n_train_steps: ${trainer.val_check_interval}
    use_master_weights_in_ckpt: False
  log_parameter_norm: True
  log_gradient_norm: True
  enable_recovery_time_instrumentation: False
  save_xser: True
  load_xser: True
  async_checkpointing: True
  resume_from_checkpoint: null
  save_bf16: False
  ckpt_ptl_version: 2.5.0
distributed_strategy:
  tensor_model_parallel_size: 2
  pipeline_model_parallel_size: 2
  virtual_pipeline_model_parallel_size: 1
  zero1: False
  sequence_parallel: True
  kv_replicator: 1
  context_parallel_size: 1
data:
  micro_batch_size: 1
  global_batch_size: 8
  train_dir: data/train.jsonl
  val_dir: data/val.jsonl
  dev_choose_samples: 16
  seq_length: ${model.encoder_seq_length}
  tokenizer:
    type: MODEL_DIR
model:
  model_config: MODEL_DIR/config.json
  encoder_seq_length: 64
  max_position_embeddings: ${.encoder_seq_length}
  num_layers: 4
  hidden_size: 256
  qkv_linear: True
  fuse_qkv: True
  transpose_nki_inputs: True
  pipeline_cuts: ['model.layers.0']
  rope_theta: 10000.0
  use_cpu_initialization: True
  weight_init_only: True
  activations_checkpoint_granularity: selective
  activations_checkpoint_recompute: [CoreAttention]
  fusions:
    softmax: True
    flash_attention: True
    ring_attention: False
  do_layer_norm_weight_decay: True
  optim:
    name: adamw_fp32OptState
    lr: 1.5e-4
    weight_decay: 0.01
    capturable: False
    betas:
    - 0.9
    - 0.95
    sched:
      name: LinearAnnealingWithWarmUp
      warmup_steps: 5
      max_steps: ${trainer.max_steps}
model_alignment_strategy:
  sft:
    packing: True
  peft:
    lora_rank: 16
    lora_alpha: 32
    lora_dropout: 0.05
    lora_bias: "none"
    lora_verbose: True
    target_modules: ["qkv_proj", "gate_up_proj"]
    load_lora_from_ckpt: False
    save_lora_base: False
    merge_lora: False
    save_lora_config_adapter: True
    merge_sharded_lora: False
precision:
  type: 'autocast'
  master_weights: False
  fp32_grad_acc: False
  xla_use_bf16: '0'
  xla_downcast_bf16: '0'
  neuron_rt_stochastic_rounding_en: '0'
  parallel_layers_reduce_dtype: bf16
compiler_flags: '--model-type transformer --retry_failed_compilation'
compiler_cache_url: neuron_cache
aync_exec_max_inflight_requests: 5
bucket_size_collectives: 1024
neuron_rt_exec_timeout: 100
neuron_experimental_compress_rg: False
"""

DPO = """\
name: tiny_dpo
trainer: {devices: 2, num_nodes: 1, max_epochs: -1, max_steps: 10, log_every_n_steps: 1,
          val_check_interval: 10, limit_val_batches: 0.0, gradient_clip_val: 1.0}
exp_manager: {name: dpo, resume_if_exists: False, checkpoint_callback_params: {save_top_k: 1, every_n_train_steps: 5}}
distributed_strategy: {tensor_model_parallel_size: 2, pipeline_model_parallel_size: 1, zero1: True,
                       sequence_parallel: False, kv_replicator: 1}
data: {micro_batch_size: 1, global_batch_size: 2, train_dir: data/train.jsonl, val_dir: null, seq_length: 64,
       tokenizer: {type: MODEL_DIR}}
model: {model_config: MODEL_DIR/config.json, encoder_seq_length: 64,
        optim: {name: adamw, lr: 1e-5, sched: {name: CosineAnnealing, warmup_steps: 2, min_lr: 1e-6}}}
model_alignment_strategy:
  dpo: {kl_beta: 0.01, loss_type: sigmoid, max_prompt_length: 32, precompute_ref_log_probs: True,
        truncation_mode: keep_start}
  orpo: {beta: 0.01, max_prompt_length: 32, truncation_mode: keep_start}
precision: {type: mixed_precision}
"""


def cli(capsys, *args: object) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def workdir(tmp_path, monkeypatch, quickstart_cache):
    """A directory as an NxDT user has it: data (input/output rows), the configs; the tiny model's
    directory stands for the HF checkpoint beside model.model_config."""
    from nxd_finetune.quickstart import ensure_tiny_model

    model_dir = ensure_tiny_model()
    (tmp_path / "data").mkdir()
    rows = [{"input": f"Is {n} even or odd?", "output": "even" if n % 2 == 0 else "odd"} for n in range(40)]
    for name in ("train", "val"):
        (tmp_path / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, text in (("sft_lora.yaml", SFT_LORA), ("dpo.yaml", DPO)):
        (tmp_path / name).write_text(text.replace("MODEL_DIR", str(model_dir)))
    monkeypatch.chdir(tmp_path)
    return tmp_path, model_dir


def test_sft_lora_config_to_valid_recipe(capsys, workdir):
    tmp, model_dir = workdir
    code, _, err = cli(capsys, "import", "nxdt-config", "sft_lora.yaml", "-o", "recipe.yaml")
    assert code == 0, err
    lines = reported(err)
    assert set(lines) == set(flatten(resolve_config(tmp / "sft_lora.yaml")))  # every key, once
    recipe = yaml.safe_load((tmp / "recipe.yaml").read_text())
    assert recipe["parallel"] == {"tp": 2, "pp": 2, "virtual_stages": 1, "zero1": False, "sequence_parallel": True,
                                  "nproc": 8, "activation_checkpointing": "selective",
                                  "checkpoint_modules": ["Attention"], "pp_cuts": [1]}
    assert recipe["lora"] == {"rank": 16, "alpha": 32.0, "dropout": 0.05, "bias": "none",
                              "target_modules": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]}
    assert recipe["training"]["max_steps"] == 20 and recipe["training"]["warmup_steps"] == 5
    assert recipe["training"]["lr"] == 1.5e-4 and recipe["training"]["betas"] == [0.9, 0.95]
    assert recipe["training"]["precision"] == "bf16-mixed" and recipe["neuron"]["precision"] == "autocast"
    assert recipe["training"]["scheduler"] == "linear" and recipe["training"]["global_batch_size"] == 8
    assert recipe["data"]["max_seq_len"] == 64 and recipe["data"]["packing"] is True  # ${model.encoder_seq_length}
    assert recipe["data"]["fields"] == {"prompt": "input", "completion": "output"}
    assert recipe["data"]["train"] == str(tmp / "data" / "train.jsonl")
    assert recipe["checkpoint"]["every_n_steps"] == 10 and recipe["checkpoint"]["keep_last"] == 3  # ${trainer...}
    assert recipe["output"]["dir"] == str(tmp / "nemo_experiments" / "tiny_sft_lora")  # exp_dir/${name}
    assert recipe["neuron"]["model_type"] == "transformer"
    assert recipe["neuron"]["cc_flags"] == ["--retry_failed_compilation"]
    assert recipe["model"]["path"] == str(model_dir)
    # resolved interpolation, reported; keys with no counterpart say why
    assert "exp_manager.checkpoint_callback_params.model_parallel_size" in lines
    resolved = resolve_config(tmp / "sft_lora.yaml")
    assert resolved["exp_manager"]["checkpoint_callback_params"]["model_parallel_size"] == 4  # ${multiply:2, 2}
    assert "not carried over: model.fusions.flash_attention: NxD's NKI flash-attention" in lines[
        "model.fusions.flash_attention"]
    assert lines["model.fusions.ring_attention"].startswith("mapped: ")  # off, as here
    assert "max_position_embeddings=1024 with 64" in lines["model.max_position_embeddings"]
    assert "export NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS=5" in lines["aync_exec_max_inflight_requests"]
    assert lines["model.hidden_size"].startswith("mapped: ")
    text = (tmp / "recipe.yaml").read_text()
    assert "#   model.fusions.flash_attention: " in text  # the recipe carries the list too
    code, out, err = cli(capsys, "validate", "recipe.yaml")
    assert code == 0, err


def test_preference_tuning_maps_to_the_dpo_objective(capsys, workdir):
    tmp, _ = workdir
    code, out, err = cli(capsys, "import", "nxdt-config", "dpo.yaml")
    assert code == 0, err
    lines = reported(err)
    p = "model_alignment_strategy."
    assert lines[p + "dpo.kl_beta"].endswith("preference.beta")
    assert lines[p + "dpo.loss_type"].endswith("preference.loss_type")
    assert lines[p + "dpo.max_prompt_length"].endswith("preference.max_prompt_length")
    assert lines[p + "dpo.truncation_mode"].endswith("preference.truncation_mode")
    assert "computed once before training" in lines[p + "dpo.precompute_ref_log_probs"]
    for key in ("orpo.beta", "orpo.max_prompt_length", "orpo.truncation_mode"):
        assert "also sets dpo, which was taken" in lines[p + key]
    recipe = yaml.safe_load(out)  # printed on stdout without -o
    assert recipe["objective"] == "dpo" and recipe["data"]["format"] == "preference" and "fields" not in recipe["data"]
    assert recipe["preference"] == {"beta": 0.01, "loss_type": "sigmoid", "max_prompt_length": 32,
                                    "truncation_mode": "keep_start"}
    assert "lora" not in recipe and recipe["parallel"]["zero1"] is True
    assert recipe["neuron"]["precision"] == "bf16-master" and recipe["training"]["precision"] == "bf16"
    assert recipe["training"]["scheduler"] == "cosine" and recipe["training"]["min_lr_ratio"] == pytest.approx(0.1)
    assert recipe["checkpoint"]["resume"] is None and recipe["eval"] == {"before": False}


@pytest.mark.parametrize(("edit", "words"), [
    (("max_steps: ${trainer.max_steps}", "max_steps: ${trainer.no_such_key}"), "no_such_key"),
    (("model_source: hf", "model_source: megatron"), "only NxDT's HF models"),
    (("tensor_model_parallel_size: 2", "tensor_model_parallel_size: 3"), "not divisible by tp*pp"),
    (("lr: 1.5e-4", "lr: abc"), "model.optim.lr: expected a number, found 'abc'"),
    (("lora_rank: 16", "lora_rank: sixteen"), "peft.lora_rank: expected an integer, found 'sixteen'"),
    (("devices: 8", "devices: eight"), "trainer.devices: expected an integer, found 'eight'"),
    (("betas:\n    - 0.9\n    - 0.95", "betas: 0.9"), "model.optim.betas: expected a list of numbers, found 0.9"),
    (("max_steps: 20", "max_steps: 2.5"), "trainer.max_steps: expected an integer, found 2.5"),
    (("lr: 1.5e-4", "lr: .inf"), "model.optim.lr: expected a number, found inf"),
    (("zero1: False", "zero1: maybe"), "distributed_strategy.zero1: expected true or false"),
    (("target_modules: [", "target_modules: [[a], "), "peft.target_modules: expected a name or a list of names"),
    (("compiler_flags: '", "compiler_flags: '\"unclosed "), "compiler_flags: "),
    (("name: tiny_sft_lora", "name: ${multiply:'ab', 1000000000}"), "multiply takes two numbers, not str and int"),
    (("name: tiny_sft_lora", "big: " + "x" * 3000 + "\nname: ${big}${big}"),
     ": name is 6000 characters long once interpolated"),
    (("max_steps: 20", "max_steps: ${multiply:${trainer.log_every_n_steps}, 1e308}"), "out of range"),
])
def test_bad_configs_are_one_line(capsys, workdir, edit, words):
    tmp, _ = workdir
    (tmp / "bad.yaml").write_text((tmp / "sft_lora.yaml").read_text().replace(*edit))
    code, _, err = cli(capsys, "import", "nxdt-config", "bad.yaml", "-o", "r.yaml")
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp / "r.yaml").exists()


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Coming from NxD Training", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("nxd-finetune ")]


def test_readme_commands_as_shown(capsys, workdir):
    """The README's commands, in a directory holding what they name: the config and an NxD
    checkpoint of that model (tp=2, pp=2) under the experiment's checkpoints/."""
    from transformers import AutoModelForCausalLM

    tmp, model_dir = workdir
    commands = readme_commands()
    assert [c.split()[1:3] for c in commands] == [["import", "nxdt-config"], ["validate", "recipe.yaml"],
                                                  ["import", "nxdt-checkpoint"]]
    (tmp / "hf_llama3_8B_SFT_lora_config.yaml").write_text((tmp / "sft_lora.yaml").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = json.loads((model_dir / "config.json").read_text())
    write_checkpoint(tmp / "nemo_experiments" / "hf_llama" / "checkpoints", "step=20.ckpt",
                     shard_model(hf, cfg, 2, 2))
    for command in commands:
        code, _, err = cli(capsys, *shlex.split(command)[1:])
        assert code == 0, f"{command}: {err}"
    out = tmp / "llama3-8b-nxdt"
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(hf) and all(torch.equal(got[k], hf[k]) for k in hf)
    assert (out / "tokenizer.json").is_file()  # from the config's data.tokenizer.type


def test_out_that_cannot_be_written_is_one_line(capsys, workdir):
    tmp, _ = workdir
    (tmp / "a_dir").mkdir()
    (tmp / "a_file").write_text("x")
    cases = {tmp / "a_dir": "is a directory", tmp / "a_file" / "r.yaml": "a_file is a file, not a directory",
             Path("/proc/nxd-recipe.yaml"): "cannot write /proc/nxd-recipe.yaml"}
    for out, words in cases.items():
        code, _, err = cli(capsys, "import", "nxdt-config", "dpo.yaml", "-o", out)
        assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and words in err, err
    code, _, err = cli(capsys, "import", "nxdt-config", "dpo.yaml", "-o", tmp / "new" / "dir" / "r.yaml")
    assert code == 0 and yaml.safe_load((tmp / "new" / "dir" / "r.yaml").read_text())["objective"] == "dpo"


def test_full_disk_keeps_the_old_recipe(capsys, workdir, full_disk):  # noqa: F811
    """-o over an existing recipe on a full disk: one line, the old recipe whole, no temp file left."""
    tmp, _ = workdir
    recipe = full_disk / "recipe.yaml"
    recipe.write_text("# the recipe as it was\n" * 40)
    with open(full_disk / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 4096)
    code, _, err = cli(capsys, "import", "nxdt-config", "dpo.yaml", "-o", recipe)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 1 and lines == [f"error: no space left on device writing {recipe}"], err
    assert recipe.read_text() == "# the recipe as it was\n" * 40
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler", "recipe.yaml"]


@pytest.mark.parametrize("name", sorted(EDITS))
def test_nxdt_example_configs_import_with_model(capsys, tmp_path, quickstart_cache, name):
    """NxD Training's own configs name /home/ubuntu/config.json; --model is enough on any machine."""
    from nxd_finetune.quickstart import ensure_tiny_model

    model_dir = ensure_tiny_model()
    assert not Path("/home/ubuntu/config.json").exists()
    (tmp_path / name).write_text(example_config(name))
    out = tmp_path / "r.yaml"
    code, _, err = cli(capsys, "import", "nxdt-config", tmp_path / name, "--model", model_dir, "-o", out)
    assert code == 0, err
    lines = reported(err)
    assert set(lines) == set(flatten(resolve_config(tmp_path / name)))  # every key, once
    assert lines["model.model_config"] == f"mapped: model.model_config -> --model {model_dir} (its config.json) " \
                                          "takes its place"
    assert "overrides config.json's hidden_size=256 with " in lines["model.hidden_size"]  # compared with --model's
    recipe = yaml.safe_load(out.read_text())
    assert recipe["model"]["path"] == str(model_dir) and recipe["parallel"]["tp"] in (16, 32)
    code, _, err = cli(capsys, "import", "nxdt-config", tmp_path / name)  # without --model: one line that says it
    assert code == 2 and err.count("\n") == 1, err
    assert err == ("error: model.model_config: /home/ubuntu/config.json does not exist here: pass --model DIR, the HF "
                   "checkpoint to train (its config.json defines the model)\n")


@pytest.mark.parametrize("value", ["${oc.env:NXDT_TEST_SECRET}", "${oc.env:NXDT_TEST_SECRET,/tmp}",
                                   "/data/${oc.env:NXDT_TEST_SECRET}", "${oc.decode:'${a}${b}'}"])
def test_environment_values_are_never_imported(capsys, workdir, monkeypatch, value):
    """A config that reads an environment variable (a secret key here) is refused in one line that
    names the variable; its value is neither in the output nor in a recipe."""
    tmp, _ = workdir
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    monkeypatch.setenv("NXDT_TEST_SECRET", secret)
    text = (tmp / "sft_lora.yaml").read_text().replace("exp_dir: nemo_experiments", f'exp_dir: "{value}"')
    (tmp / "env.yaml").write_text("a: $\nb: '{oc.env:NXDT_TEST_SECRET}'\n" + text)  # `a` + `b`: built in two parts
    for out in (["-o", tmp / "r.yaml"], []):
        code, stdout, err = cli(capsys, "import", "nxdt-config", "env.yaml", *out)
        assert code == 2 and err.count("\n") == 1 and "reads an environment variable" in err, err
        assert "NXDT_TEST_SECRET" in err and secret not in stdout + err
        assert not (tmp / "r.yaml").exists()


def mutated(text: str, key: str, value: object) -> str:
    tree = yaml.safe_load(text)
    *parents, last = key.split(".")
    node = tree
    for p in parents:
        node = node[p]
    node[last] = value
    return yaml.safe_dump(tree)


def test_no_value_of_a_wrong_type_is_a_traceback(capsys, workdir):
    """Every key of the SFT config set in turn to a word and to a list: imported (the key is not read
    as a number) or refused in one line, never a traceback."""
    tmp, _ = workdir
    text = (tmp / "sft_lora.yaml").read_text()
    keys = list(flatten(yaml.safe_load(text)))
    refused = 0
    for key in keys:
        for value in ("abc", [1, [2]]):
            (tmp / "m.yaml").write_text(mutated(text, key, value))
            code, _, err = cli(capsys, "import", "nxdt-config", "m.yaml", "-o", tmp / "m-recipe.yaml")
            assert code in (0, 2), (key, value, err)
            if code == 2:
                refused += 1
                assert err.startswith("error: ") and err.count("\n") == 1, (key, value, err)
    assert refused > len(keys)  # most keys are read, and typed

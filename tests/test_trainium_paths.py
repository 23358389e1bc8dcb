"""The two Trainium paths as shipped: the TorchNeuron recipe (``recipes/llama3-8b-lora-trn2.yaml``),
its image (``docker/Dockerfile.torchneuron``) and Kubernetes manifests, ``import nxdt-config
--target trn2``, and what the torch-xla path keeps for itself (the Neuron environment, the compile
cache, precompile). Nothing here runs on Trainium: the recipe is validated, the image parsed and
linted, the manifests rendered (docs/trainium.md)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_run import run_cli
from nxdt_example_configs import example_config, reported

from nxd_finetune.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TRN2 = ROOT / "recipes" / "llama3-8b-lora-trn2.yaml"
IMAGE = "acct.dkr.ecr/nxd-finetune:torchneuron"


def test_trn2_recipe_validates_for_the_neuron_device(capsys, quickstart_cache):
    r = load_recipe(TRN2)
    assert (r.training.device, r.parallel.nproc, r.parallel.tp, r.parallel.dp) == ("neuron", 64, 4, 16)
    assert r.training.global_batch(r.parallel.dp) == 64 and r.model.compile is False
    again = load_recipe(TRN2, ["model.compile=neuron"])
    assert again.model.compile == "neuron"
    # validate where torch has no neuron device: one warning line, the rest of the recipe checked
    from nxd_finetune.preflight.hardware import check_device

    with pytest.warns(UserWarning, match="training.device=neuron: torch has no neuron device on this machine"):
        check_device(r, required=False)


def test_a_run_on_a_device_torch_does_not_have_is_one_line(capsys, quickstart_cache):
    code, _, err = run_cli(capsys, "run", str(ROOT / "recipes" / "quickstart.yaml"), "training.device=tpu",
                           "training.max_steps=1")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "error: unknown device 'tpu'; use auto, cpu, cuda or xla, or a device backend registered with torch "
        "(neuron with TorchNeuron)")


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of ``docker/<name>``: continuation lines joined, comments dropped."""
    lines = [line for line in (ROOT / "docker" / name).read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(word.upper(), rest.strip()) for line in text.splitlines() if line.strip()
            for word, _, rest in [line.strip().partition(" ")]]


def test_torchneuron_dockerfile_keeps_the_image_stack_and_passes_hadolint():
    steps = dockerfile("Dockerfile.torchneuron")
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    assert args["BASE_IMAGE"].startswith("public.ecr.aws/neuron/pytorch-training-neuronx:")
    assert ("FROM", "${BASE_IMAGE}") in steps and steps[-1] == ("CMD", '["nxd-finetune", "--help"]')
    runs = [a for k, a in steps if k == "RUN"]
    assert any("--constraint" in r and "torch-neuronx" in r and '".[s3,tensorboard,etcd]"' in r for r in runs)
    assert not any(re.search(r"pip install [^|&]*\btorch\b", r) for r in runs)  # the image's torch stays
    assert not any("torch-xla" in r for r in runs)  # TorchNeuron: no torch-xla
    assert any("nxd-finetune validate builtin:quickstart" in r for r in runs)
    hadolint = Path(sys.executable).with_name("hadolint")
    proc = subprocess.run([str(hadolint), "--no-color", "docker/Dockerfile.torchneuron"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def k8s(capsys, *argv: str) -> tuple[list[dict], str]:
    code, out, err = run_cli(capsys, "k8s", *argv)
    assert code == 0, err
    return list(yaml.safe_load_all(out)), err


def test_torchneuron_manifests_ask_for_trn2_devices_and_no_xla_environment(capsys, monkeypatch):
    """On trn2 a Neuron device holds 4 processes (logical NeuronCores); the pods get none of
    torch-xla's variables and no compile-cache override; precompile is refused in one line."""
    monkeypatch.chdir(ROOT)
    common = ["--image", IMAGE, "--instance-type", "trn2.48xlarge", "--pvc", "fsx-claim",
              "--recipe-path", "/fsx/recipes/llama3-8b-lora-trn2.yaml"]
    (job,), err = k8s(capsys, "pytorchjob", str(TRN2), "--nodes", "1", "--name", "sft-trn2", *common)
    assert err == ""
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"aws.amazon.com/neuron": "16"}  # 64 processes / 4
    assert container["args"][container["args"].index("run"):] == ["run", "/fsx/recipes/llama3-8b-lora-trn2.yaml"]
    env = {e["name"] for e in container["env"]}
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}  # no NEURON_CC_FLAGS / XLA_* on TorchNeuron
    (trainjob, *_), _ = k8s(capsys, "trainjob", str(TRN2), "--nodes", "1", *common)
    trn1 = ROOT / "recipes" / "llama3-8b-lora-trn1.yaml"  # the torch-xla recipe keeps its environment
    (xla_job,), _ = k8s(capsys, "pytorchjob", str(trn1), "--nodes", "2", "--image", IMAGE, "--instance-type",
                        "trn1.32xlarge", "--pvc", "fsx-claim", "--recipe-path", "/fsx/recipes/trn1.yaml")
    xla_container = xla_job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert xla_container["resources"]["limits"]["aws.amazon.com/neuron"] == "16"  # 32 processes / 2
    assert "NEURON_CC_FLAGS" in {e["name"] for e in xla_container["env"]}
    code, _, err = run_cli(capsys, "k8s", "precompile-job", str(TRN2), "--nodes", "1", *common)
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        "error: precompile fills torch-xla's Neuron compile cache (training.device=xla); a recipe on "
        "training.device=neuron compiles as it runs")


def test_trainium_doc_torchneuron_commands_render_as_written(capsys, monkeypatch):
    """docs/trainium.md's TorchNeuron `nxd-finetune k8s` line, from the repository root."""
    monkeypatch.chdir(ROOT)
    text = (ROOT / "docs" / "trainium.md").read_text()
    commands = []
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, re.S | re.M):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if line.startswith("nxd-finetune k8s") and "llama3-8b-lora-trn2.yaml" in line:
                commands.append(shlex.split(re.split(r" [|>] ", line)[0].replace("$REPO", "acct.dkr.ecr/nxd")))
    assert [argv[2] for argv in commands] == ["pytorchjob"]
    (job,), err = k8s(capsys, *commands[0][2:])
    assert err == "" and job["metadata"]["name"] == "sft-trn2"
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["image"] == "acct.dkr.ecr/nxd:torchneuron"
    assert container["resources"]["limits"] == {"aws.amazon.com/neuron": "16"}


def test_import_nxdt_config_for_the_torchneuron_path(capsys, tmp_path, quickstart_cache):
    """``--target trn2``: training.device=neuron, no neuron: section (its keys reported as not
    carried over); the default stays the torch-xla recipe."""
    from nxd_finetune.quickstart import ensure_tiny_model

    model = str(ensure_tiny_model())
    config = tmp_path / "lora.yaml"
    config.write_text(example_config("hf_llama3_8B_SFT_lora_config.yaml"))
    code, _, err = run_cli(capsys, "import", "nxdt-config", str(config), "--model", model, "--target", "trn2",
                           "-o", str(tmp_path / "trn2.yaml"))
    assert code == 0, err
    recipe = yaml.safe_load((tmp_path / "trn2.yaml").read_text())
    assert recipe["training"]["device"] == "neuron" and "neuron" not in recipe
    assert recipe["training"]["precision"] == "bf16-mixed"  # autocast on the device: torch.autocast("neuron")
    lines = reported(err)
    assert lines["compiler_flags"].startswith("not carried over: compiler_flags: torch-xla's Neuron environment")
    assert lines["precision.type"].startswith("mapped: precision.type -> training.precision")
    code, _, err = run_cli(capsys, "import", "nxdt-config", str(config), "--model", model,
                           "-o", str(tmp_path / "xla.yaml"))
    assert code == 0, err
    xla = yaml.safe_load((tmp_path / "xla.yaml").read_text())
    assert xla["neuron"]["model_type"] == "transformer" and "device" not in xla["training"]  # the default: xla
    code, _, err = run_cli(capsys, "import", "nxdt-config", str(config), "--model", model, "--target", "trn9")
    assert code == 2 and "--target" in err

"""The ``nxd-finetune k8s`` jobs against what their pods will run: the precompile job traces the
training job's per-rank layout (every shipped recipe, several node counts), the compile cache and
the recipe's paths on the shared volume, the restart-safe store variable in every generated spec."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import yaml

from nxd_finetune import neuron
from nxd_finetune.cli import main
from nxd_finetune.cluster.components import finetune
from nxd_finetune.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))
STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def k8s(capsys, *args: str) -> tuple[list[dict], str]:
    """``nxd-finetune k8s ARGS`` (with an ``--image`` unless given): the manifests written and
    stderr (warnings)."""
    image = [] if "--image" in args else ["--image", "repo.example/nxd-finetune:neuron"]
    try:
        main(["k8s", *args, *image])
    except SystemExit as e:  # typer exits 0 after a command
        assert e.code in (0, None), capsys.readouterr().err
    out = capsys.readouterr()
    return list(yaml.safe_load_all(out.out)), out.err


def through_models(doc: dict) -> dict:
    """``doc`` read into the Kubeflow training SDK's ``KubeflowOrgV1PyTorchJob`` (a ``Job``: the
    kubernetes client's ``V1Job``) and written back: a missing required field raises, a field the
    model does not know is dropped, so the round trip must give ``doc`` back unchanged."""
    if doc["kind"] == "PyTorchJob":
        from kubeflow.training.api_client import ApiClient

        client, model = ApiClient(), "KubeflowOrgV1PyTorchJob"
    else:
        from kubernetes.client import ApiClient

        client, model = ApiClient(), "V1Job"
    back = client.sanitize_for_serialization(client._ApiClient__deserialize(doc, model))
    assert back == doc
    return doc


def pods(doc: dict) -> list[dict]:
    """The container of every pod a manifest starts (PyTorchJob replicas counted)."""
    if doc["kind"] == "Job":
        return [doc["spec"]["template"]["spec"]["containers"][0]]
    return [spec["template"]["spec"]["containers"][0] for spec in doc["spec"]["pytorchReplicaSpecs"].values()
            for _ in range(spec["replicas"])]


def rank_layout(recipe_file: Path, run_args: list[str], world: int | None) -> dict:
    """What every rank of ``nxd_finetune run RECIPE OVERRIDES`` runs, loaded as the CLI loads it
    (under torchrun ``parallel.nproc`` is the world, unless an override sets it)."""
    overrides = run_args[1:]
    if world is not None and not any(o.startswith("parallel.nproc=") for o in overrides):
        overrides = [f"parallel.nproc={world}", *overrides]
    r = load_recipe(recipe_file, overrides)
    p, t = r.parallel, r.training
    return {"nproc": p.nproc, "tp": p.tp, "pp": p.pp, "dp": p.dp, "virtual_stages": p.virtual_stages,
            "zero1": p.zero1, "sequence_parallel": p.sequence_parallel, "micro_batch": t.micro_batch_size,
            "grad_accum": t.grad_accum_steps(p.dp), "max_seq_len": r.data.max_seq_len, "packing": r.data.packing,
            "precision": t.precision, "checkpointing": p.activation_checkpointing,
            "lora": r.lora.model_dump() if r.lora else None, "neuron": r.neuron.model_dump()}


def torchrun_layout(recipe_file: Path, argv: list[str]) -> dict:
    """The rank layout of a pod running ``torchrun ... -m nxd_finetune run ...``."""
    world = int(argv[argv.index("--nnodes") + 1]) * int(argv[argv.index("--nproc-per-node") + 1])
    run = argv.index("run", argv.index("-m"))
    return rank_layout(recipe_file, argv[run + 1:], world)


@pytest.fixture
def standin_compiler(tmp_path, monkeypatch) -> Path:
    """``neuron_parallel_compile`` on PATH writing the command it wraps, one argument a line (the
    Neuron SDK is not here; ``nxd-finetune precompile`` hands it the run it would trace)."""
    record = tmp_path / "wrapped.txt"
    tool = tmp_path / "bin" / neuron.PARALLEL_COMPILE
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {shlex.quote(str(record))}\n")
    tool.chmod(0o755)
    monkeypatch.setattr(neuron, "neuron_available", lambda: True)
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    return record


def precompile_layout(recipe_file: Path, doc: dict, capsys, record: Path) -> dict:
    """The rank layout the precompile manifest traces: a PyTorchJob's torchrun line, or the run the
    one-node Job's ``nxd-finetune precompile`` starts (through the CLI, with the stand-in compiler)."""
    (container, *others) = pods(doc)
    argv = container["command"] + container["args"]
    assert all(c["command"] + c["args"] == argv for c in others)
    if doc["kind"] == "PyTorchJob":
        assert argv[0] == neuron.PARALLEL_COMPILE
        return torchrun_layout(recipe_file, argv[1:])
    assert argv[:2] == ["nxd-finetune", "precompile"]
    with pytest.raises(SystemExit) as e:
        main(argv[1:])
    assert e.value.code in (0, None), capsys.readouterr().err
    capsys.readouterr()
    wrapped = record.read_text().splitlines()  # python -m nxd_finetune run RECIPE ...
    assert wrapped[1:4] == ["-m", "nxd_finetune", "run"]
    return rank_layout(recipe_file, wrapped[4:], None)  # `run` starts parallel.nproc processes itself


# the torch-xla recipes (a TorchNeuron one has nothing to precompile: tests/test_trainium_paths.py)
CASES = [(path, nodes, []) for path in SHIPPED for nodes in (1, 2, 4, 8)
         if load_recipe(path).parallel.nproc % nodes == 0 and not neuron.native_device(load_recipe(path))]
CASES += [(ROOT / "recipes" / "quickstart.yaml", 2, ["parallel.nproc=8", "parallel.tp=2",
                                                     "training.global_batch_size=32", "training.grad_accum=null"])]


@pytest.mark.parametrize("recipe, nodes, overrides", CASES,
                         ids=[f"{p.stem}-{n}node{'-' + str(len(o)) + 'ov' if o else ''}" for p, n, o in CASES])
def test_precompile_traces_the_training_layout(recipe, nodes, overrides, capsys, standin_compiler):
    common = [str(recipe), *overrides, "--nodes", str(nodes), "--pvc", "fsx-claim"]
    (train,), _ = k8s(capsys, "pytorchjob", *common)
    (pre,), _ = k8s(capsys, "precompile-job", *common, "--steps", "2")
    through_models(train), through_models(pre)
    train_pods, pre_pods = pods(train), pods(pre)
    assert len(train_pods) == len(pre_pods) == nodes
    train_argv = train_pods[0]["command"] + train_pods[0]["args"]
    expected = torchrun_layout(recipe, train_argv)
    assert expected["nproc"] == load_recipe(recipe, overrides).parallel.nproc
    assert precompile_layout(recipe, pre, capsys, standin_compiler) == expected
    for key in ("resources", "env"):  # same devices and the same Neuron variables (compile cache included)
        assert pre_pods[0][key] == train_pods[0][key]


# ----------------------------------------------------------------------------- the shared volume

RECIPE = """\
model: {path: /models/llama}
data: {train: data/train.jsonl, eval: /fsx/data/eval.jsonl, format: messages}
training: {device: xla, precision: bf16, max_steps: 10}
parallel: {nproc: 8, tp: 8}
output: {dir: /outputs/sft}
"""


@pytest.fixture
def recipe(tmp_path) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(RECIPE)
    return path


def env_of(doc: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pods(doc)[0]["env"]}


def test_the_compile_cache_goes_on_the_volume_and_unseen_paths_are_named(capsys, recipe):
    (job,), err = k8s(capsys, "pytorchjob", str(recipe), "--pvc", "fsx-claim", "--recipe-path", "/fsx/r/sft.yaml")
    argv = pods(job)[0]["command"] + pods(job)[0]["args"]
    assert argv[-1] == "neuron.compile_cache=/fsx/neuron-cache"  # the workers' recipe says it too
    assert "--cache_dir=/fsx/neuron-cache" in shlex.split(env_of(job)["NEURON_CC_FLAGS"])
    # data/train.jsonl lies beside the recipe in the pods: /fsx/r/data/train.jsonl, on the volume
    assert err.splitlines() == [
        f"warning: {key}={path} is not on the shared volume (fsx-claim at /fsx): the pods cannot share it; "
        "put it under the mount or into the image" for key, path in (("model.path", "/models/llama"),
                                                                    ("output.dir", "/outputs/sft"))]
    # the recipe given as a relative path: its data/ is relative to the image's working directory
    _, err = k8s(capsys, "pytorchjob", str(recipe), "--pvc", "fsx-claim", "--recipe-path", "sft.yaml",
                 "output.dir=/fsx/out", "model.path=s3://models/llama")
    assert [line.split(" is not")[0] for line in err.splitlines()] == [f"warning: data.train={recipe.parent}/data/"
                                                                      "train.jsonl"]
    (pre,), err = k8s(capsys, "precompile-job", str(recipe), "--pvc", "fsx-claim", "--mount-path", "/", "--name",
                      "pre")
    assert "--cache_dir=/neuron-cache" in env_of(pre)["NEURON_CC_FLAGS"] and err == ""


def test_a_compile_cache_off_the_volume(capsys, recipe):
    args = [str(recipe), "neuron.compile_cache=/var/tmp/cache", "--pvc", "fsx-claim", "output.dir=/fsx/o",
            "model.path=/fsx/m", "--recipe-path", "/fsx/sft.yaml"]
    with pytest.raises(SystemExit) as e:
        main(["k8s", "precompile-job", *args])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: neuron.compile_cache=/var/tmp/cache is not on the shared volume (fsx-claim at /fsx), so the training "
        "pods cannot read what precompile compiles; set it under the mount or leave it unset\n")
    (job,), err = k8s(capsys, "pytorchjob", *args)  # training alone still runs: warned
    assert err.startswith("warning: neuron.compile_cache=/var/tmp/cache is not on the shared volume")
    assert len(err.splitlines()) == 1 and "--cache_dir=/var/tmp/cache" in env_of(job)["NEURON_CC_FLAGS"]
    with pytest.raises(SystemExit) as e:
        main(["k8s", "precompile-job", str(recipe)])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: the precompile job needs a shared volume for the compile cache (--pvc CLAIM): on a pod's own disk "
        "the graphs are lost with the pod\n")


# ----------------------------------------------------------------------------- restarts across nodes


def test_every_generated_spec_sets_the_restart_safe_store(capsys, recipe):
    docs = [k8s(capsys, "pytorchjob", str(recipe), "--nodes", n, "--accelerator", a)[0][0]
            for n in ("1", "2") for a in ("neuron", "gpu", "cpu")]
    docs += [k8s(capsys, "precompile-job", str(recipe), "--nodes", n, "--pvc", "c", "--mount-path", "/")[0][0]
             for n in ("1", "2")]
    for doc in docs:
        for container in pods(doc):
            assert {e["name"]: e["value"] for e in container["env"]}[STORE_ENV] == "1"
    for nnodes, restarts in ((1, 0), (2, 0), (2, 3)):
        app = finetune(recipe=str(recipe), nnodes=nnodes, nproc_per_node=8 // nnodes, max_restarts=restarts)
        assert app.roles[0].env[STORE_ENV] == "1"
        app = finetune(recipe="/not/here.yaml", nnodes=nnodes, max_restarts=restarts)  # recipe unreadable here
        assert app.roles[0].env[STORE_ENV] == "1"


def test_max_restarts_with_one_process_is_said(capsys, quickstart_cache, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["run", str(ROOT / "recipes" / "quickstart.yaml"), "--max-restarts", "2", "training.max_steps=1",
              "training.warmup_steps=0", "eval.every_n_steps=null", "eval.before=false",
              f"output.dir={tmp_path / 'out'}", "logging.progress=false"])
    err = capsys.readouterr().err
    assert e.value.code in (0, None), err
    said = [line for line in err.splitlines() if line.startswith("warning: parallel.max_restarts")]
    assert said == ["warning: parallel.max_restarts=2 is ignored with one process: restarts need the elastic "
                    "launcher's workers (--nproc 2 or more)"]


# ----------------------------------------------------------------------------- pod settings


def pod_templates(doc: dict) -> list:
    """Every pod template of a manifest read through the ``kubernetes`` client's models."""
    from kubernetes.client import ApiClient

    raw = ([doc["spec"]["template"]] if doc["kind"] == "Job"
           else [spec["template"] for spec in doc["spec"]["pytorchReplicaSpecs"].values()])
    return [ApiClient()._ApiClient__deserialize(t, "V1PodTemplateSpec") for t in raw]


def test_env_and_service_account_reach_every_pod(capsys, recipe):
    extra = ["--env", "AWS_REGION=us-west-2", "--env", "FI_PROVIDER=sockets", "--env", "EMPTY=",
             "--service-account", "s3-reader", "--pvc", "fsx-claim", "--nodes", "2", "--efa", "8"]
    for command in ("pytorchjob", "precompile-job"):
        (doc,), _ = k8s(capsys, command, str(recipe), *extra)
        templates = pod_templates(through_models(doc))
        assert len(templates) == 2
        for template in templates:
            assert template.spec.service_account_name == "s3-reader"
            (container,) = template.spec.containers
            env = {e.name: e.value for e in container.env}
            assert env["AWS_REGION"] == "us-west-2" and env["EMPTY"] == ""
            assert env["FI_PROVIDER"] == "sockets" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"  # given wins
            assert env[STORE_ENV] == "1" and "NEURON_CC_FLAGS" in env
    with pytest.raises(SystemExit) as e:
        main(["k8s", "pytorchjob", str(recipe), "--env", "NO_EQUALS"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: --env 'NO_EQUALS': write KEY=VALUE with KEY of letters, digits and '_' (not starting with a digit)\n")


def test_the_image_must_be_given(capsys, recipe):
    with pytest.raises(SystemExit) as e:
        main(["k8s", "pytorchjob", str(recipe)])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: --image is the placeholder REGISTRY/nxd-finetune:neuron: give the image your cluster pulls, e.g. "
        "<account>.dkr.ecr.<region>.amazonaws.com/nxd-finetune:neuron (built from docker/)\n")
    (job,), _ = k8s(capsys, "pytorchjob", str(recipe), "--image", "123.dkr.ecr.us-west-2.amazonaws.com/nxd:neuron")
    assert pods(job)[0]["image"] == "123.dkr.ecr.us-west-2.amazonaws.com/nxd:neuron"


# ----------------------------------------------------------------------------- Kubeflow Trainer v2


def through_trainer_models(doc: dict) -> dict:
    """``doc`` read into the Kubeflow Trainer API's pydantic model of its kind and written back unchanged."""
    from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime, TrainerV1alpha1TrainJob

    model = {"TrainJob": TrainerV1alpha1TrainJob, "ClusterTrainingRuntime": TrainerV1alpha1ClusterTrainingRuntime}
    assert model[doc["kind"]].from_dict(doc).to_dict() == doc
    return doc


@pytest.mark.parametrize("recipe_file, nodes", [(p, n) for p, n, o in CASES if not o and n in (1, 2, 4)],
                         ids=lambda v: v.stem if isinstance(v, Path) else f"{v}node")
def test_trainjob_trains_the_pytorchjob_layout(recipe_file, nodes, capsys):
    common = [str(recipe_file), "--nodes", str(nodes), "--pvc", "fsx-claim", "--efa", "8"]
    (train,), _ = k8s(capsys, "pytorchjob", *common)
    (runtime, job), _ = k8s(capsys, "trainjob", *common, "--runtime", "torch-nxd")
    through_trainer_models(runtime), through_trainer_models(job)
    assert runtime["kind"] == "ClusterTrainingRuntime" and runtime["metadata"]["name"] == "torch-nxd"
    assert job["spec"]["runtimeRef"]["name"] == "torch-nxd"
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (nodes, load_recipe(recipe_file).parallel.nproc // nodes)
    c = pods(train)[0]
    assert torchrun_layout(recipe_file, trainer["command"]) == torchrun_layout(recipe_file, c["command"] + c["args"])
    assert trainer["resourcesPerNode"] == c["resources"] and trainer["env"] == c["env"]


def test_trainjob_patches_the_runtime_pod(capsys, recipe):
    (_, job), _ = k8s(capsys, "trainjob", str(recipe), "--pvc", "fsx-claim", "--service-account", "s3-reader",
                      "--instance-type", "trn1.32xlarge", "--env", "AWS_REGION=us-west-2", "--max-restarts", "2",
                      "--recipe-path", "/fsx/r/sft.yaml", "output.dir=/fsx/o", "model.path=/fsx/m")
    through_trainer_models(job)
    (patch,) = job["spec"]["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    spec = node["template"]["spec"]["template"]["spec"]
    assert node["name"] == "node" and spec["serviceAccountName"] == "s3-reader"
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn1.32xlarge"}
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {"shared": "fsx-claim"} and mounts["shared"] == "/fsx"
    command = job["spec"]["trainer"]["command"]
    assert command[command.index("--max-restarts") + 1] == "2"
    assert command[-1] == "neuron.compile_cache=/fsx/neuron-cache"
    env = {e["name"]: e["value"] for e in job["spec"]["trainer"]["env"]}
    assert env["AWS_REGION"] == "us-west-2" and env[STORE_ENV] == "1"


# ----------------------------------------------------------------------------- elastic node range


def test_elastic_node_range(capsys):
    trn1 = ROOT / "recipes" / "llama3-8b-lora-trn1.yaml"  # 64 processes = 4 nodes x 16 here, tp 8
    (job,), _ = k8s(capsys, "pytorchjob", str(trn1), "training.global_batch_size=96", "--nodes", "1:4",
                    "--max-restarts", "3", "--pvc", "fsx-claim")
    through_models(job)
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1, "maxReplicas": 4,
                                            "maxRestarts": 3}
    (spec,) = job["spec"]["pytorchReplicaSpecs"].values()  # Workers only: the operator's elastic mode
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4 and spec["restartPolicy"] == "OnFailure"
    c = pods(job)[0]
    argv = c["command"] + c["args"]
    assert argv[argv.index("--nnodes") + 1] == "1:4" and argv[argv.index("--nproc-per-node") + 1] == "16"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "$(PET_RDZV_ENDPOINT)"  # the operator's Service
    run = argv[argv.index("run") + 1:]
    layouts = [rank_layout(trn1, run, n * 16) for n in range(1, 5)]  # what the ranks run on each node count
    assert [la["dp"] for la in layouts] == [2, 4, 6, 8] and [la["grad_accum"] * la["dp"] for la in layouts] == [96] * 4
    assert k8s(capsys, "pytorchjob", str(trn1), "--nodes", "4:4")[0][0]["spec"].get("elasticPolicy") is None


def test_precompile_covers_every_node_count_of_the_range(capsys, standin_compiler):
    """An elastic job runs another layout on every node count (dp, hence the ZeRO-1 shards and the
    micro-batches per step): the precompile jobs trace each, as training's ranks run it there."""
    trn1 = ROOT / "recipes" / "llama3-8b-lora-trn1.yaml"  # 64 processes = 4 nodes x 16 here, tp 8, zero1
    common = [str(trn1), "training.global_batch_size=96", "--nodes", "1:4", "--pvc", "fsx-claim", "--efa", "8"]
    (train,), _ = k8s(capsys, "pytorchjob", *common)
    docs, err = k8s(capsys, "precompile-job", *common, "--steps", "2", "--name", "pre")
    assert err == "" and [d["metadata"]["name"] for d in docs] == ["pre-1n", "pre-2n", "pre-3n", "pre-4n"]
    assert [d["kind"] for d in docs] == ["Job"] + ["PyTorchJob"] * 3
    c = pods(train)[0]
    run = (c["command"] + c["args"])
    run = run[run.index("run") + 1:]
    layouts = []
    for nodes, doc in enumerate(docs, start=1):
        through_models(doc)
        assert doc["metadata"]["labels"]["nxd-finetune/nodes"] == str(nodes) and len(pods(doc)) == nodes
        expected = rank_layout(trn1, run, nodes * 16)  # what training's ranks run on `nodes` nodes
        assert precompile_layout(trn1, doc, capsys, standin_compiler) == expected, nodes
        assert pods(doc)[0]["resources"] == c["resources"] and pods(doc)[0]["env"] == c["env"]
        layouts.append(expected)
    assert [la["dp"] for la in layouts] == [2, 4, 6, 8] and {la["zero1"] for la in layouts} == {True}
    (one,), _ = k8s(capsys, "precompile-job", str(trn1), "--nodes", "4:4", "--pvc", "fsx-claim")
    assert one["metadata"]["name"] == "nxd-finetune-precompile" and len(pods(one)) == 4  # a range of one count


def test_trainjob_has_no_node_range(capsys, recipe):
    """Kubeflow Trainer's API has no elastic policy (its models: one ``numNodes``, a torch policy
    without min / max nodes), so ``trainjob --nodes MIN:MAX`` is refused in one line."""
    from kubeflow_trainer_api.models import TrainerV1alpha1TorchMLPolicySource, TrainerV1alpha1Trainer
    from pydantic import ValidationError

    elastic = {"elasticPolicy": {"minNodes": 1, "maxNodes": 2}, "numProcPerNode": 8}
    assert TrainerV1alpha1TorchMLPolicySource.from_dict(elastic).to_dict() == {}  # unknown fields dropped
    with pytest.raises(ValidationError):
        TrainerV1alpha1Trainer.from_dict({"numNodes": "1:2"})
    with pytest.raises(SystemExit) as e:
        main(["k8s", "trainjob", str(recipe), "--nodes", "1:2", "--image", "r/x:n"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: --nodes 1:2: a Kubeflow Trainer TrainJob has one node count (the Trainer API has no elastic "
        "policy); use `nxd-finetune k8s pytorchjob --nodes MIN:MAX` for an elastic job\n")
    (_, job), _ = k8s(capsys, "trainjob", str(recipe), "--nodes", "2:2")
    assert job["spec"]["trainer"]["numNodes"] == 2


@pytest.mark.parametrize("command", ["pytorchjob", "precompile-job"])
@pytest.mark.parametrize("args, message", [
    (["recipes/mistral-7b-sft.yaml", "--nodes", "1:4"],
     "on 3 node(s): training.global_batch_size=128 is not divisible by micro_batch_size*dp=1*3=3; narrow the node "
     "range"),
    (["recipes/quickstart.yaml", "parallel.nproc=4", "--nodes", "1:2"],
     "with an elastic node range the world is the launcher's: drop the parallel.nproc override"),
    (["recipes/llama3-8b-lora-trn1.yaml", "--nodes", "3:16"],
     "3 node(s) x 4 process(es) = 12 is not divisible by tp*pp=8*1; narrow the node range"),
    (["recipes/llama3-8b-lora-trn1.yaml", "training.global_batch_size=null", "training.grad_accum=8", "--nodes",
      "1:2"],
     "an elastic node range needs training.global_batch_size: the global batch must stay the same when nodes come "
     "and go"),
    (["recipes/quickstart.yaml", "--nodes", "2:1"], "--nodes '2:1': give a node count N or a range MIN:MAX with 1 <= "
     "MIN <= MAX"),
])
def test_elastic_node_range_refusals(command, args, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        main(["k8s", command, *args, "--image", "r/x:n", "--pvc", "fsx-claim"])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: {message}\n"

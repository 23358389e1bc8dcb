"""The cluster commands of the README and docs/ (``docs/cluster.md``, ``docs/trainium.md``, ...) as
written: TorchX lines rendered with ``--dryrun``, ``torchx log`` handles parsed by TorchX, every
``torchrun`` line with the restart-safe store variable."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = {name: (ROOT / name).read_text()
        for name in ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]}
# the docs whose inline `torchrun ...` commands are for a user to copy (docs/trainium.md's inline
# mentions describe what tests ran)
INLINE_COMMANDS = ("README.md", "docs/cluster.md")
STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def shell_blocks(text: str) -> list[str]:
    """The commands of every ```bash block: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.split(" # ")[0].strip() for line in joined.splitlines() if line.strip()
                     and not line.lstrip().startswith("#")]
    return commands


def torchx_dryrun(argv: list[str], tmp_path: Path) -> dict:
    """``torchx run ARGS`` as written but with ``--dryrun``, from the repository root: the job."""
    argv = list(argv)
    argv[argv.index("run") + 1:argv.index("run") + 1] = ["--dryrun"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)}
    proc = subprocess.run([str(Path(sys.executable).with_name("torchx")), *argv[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return yaml.safe_load(proc.stdout.split("=== SCHEDULER REQUEST ===", 1)[1])


def test_cluster_doc_torchx_kubernetes_line_renders(tmp_path):
    (line,) = [c for c in shell_blocks(DOCS["docs/cluster.md"]) if c.startswith("torchx run") and "kubernetes" in c]
    job = torchx_dryrun(shlex.split(line), tmp_path)
    assert job["spec"]["queue"] == "default" and len(job["spec"]["tasks"]) == 2
    container = job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]
    assert {e["name"]: e["value"] for e in container["env"]}[STORE_ENV.split("=")[0]] == "1"


def test_torchx_log_handles_parse():
    from torchx.specs.api import parse_app_handle

    handles = [h for text in DOCS.values() for h in re.findall(r"torchx log ([^`]+)`", text)]
    assert handles
    for handle in handles:
        parsed = parse_app_handle(handle.replace("<app id>", "sft-run-x1"))
        assert parsed.scheduler_backend == "kubernetes" and parsed.app_id == "default:sft-run-x1"


def test_every_documented_torchrun_sets_the_store_variable():
    """Every torchrun command a user copies: the docs' bash blocks (a block may export it once) and
    the inline commands of the README and docs/cluster.md."""
    for name, text in DOCS.items():
        for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, re.S | re.M):
            if "torchrun " in block and f"export {STORE_ENV}" not in block:
                for command in shell_blocks(f"```bash\n{block}```"):
                    assert "torchrun " not in command or STORE_ENV in command, (name, command)
    for name in INLINE_COMMANDS:
        for command in re.findall(r"`([^`]*\btorchrun --[^`]*)`", DOCS[name]):
            assert STORE_ENV in command, (name, command)


def doc_commands(prefix: str) -> list[list[str]]:
    """docs/trainium.md's commands starting with ``prefix``, up to a pipe or redirection, ``$REPO`` set."""
    out = []
    for command in shell_blocks(DOCS["docs/trainium.md"]):
        if command.startswith(prefix):
            argv = shlex.split(re.split(r" [|>] ", command)[0].replace("$REPO", "acct.dkr.ecr/nxd-finetune"))
            out.append(argv)
    return out


def test_trainium_k8s_commands_run_as_written(capsys, monkeypatch):
    """The EKS section's `nxd-finetune k8s` lines, from the repository root, on the shipped Trainium
    recipe: manifests written, and no path of the recipe off the shared volume (no warning)."""
    from nxd_finetune.cli import main

    monkeypatch.chdir(ROOT)
    # the torch-xla path's lines (the TorchNeuron path's: tests/test_trainium_paths.py)
    commands = [argv for argv in doc_commands("nxd-finetune k8s") if "recipes/llama3-8b-lora-trn1.yaml" in argv]
    assert {argv[2] for argv in commands} == {"precompile-job", "pytorchjob", "trainjob"}
    for argv in commands:
        with pytest.raises(SystemExit) as e:
            main(argv[1:])
        out = capsys.readouterr()
        assert e.value.code in (0, None) and out.err == "", out.err
        docs = list(yaml.safe_load_all(out.out))
        if argv[2] == "precompile-job" and ":" in argv[argv.index("--nodes") + 1]:  # one job per node count
            assert [(d["kind"], d["metadata"]["name"], d["metadata"]["labels"]["nxd-finetune/nodes"]) for d in docs] \
                == [("Job", "nxd-finetune-precompile-1n", "1"), ("PyTorchJob", "nxd-finetune-precompile-2n", "2")]
            # the names and labels the following kubectl lines use
            shown = "\n".join(c for c in shell_blocks(DOCS["docs/trainium.md"]) if c.startswith("kubectl"))
            for d in docs:
                kind, name = d["kind"].lower(), d["metadata"]["name"]
                assert f"-l nxd-finetune/nodes={d['metadata']['labels']['nxd-finetune/nodes']}\n" in shown + "\n"
                assert f" {kind}/{name} " in shown, (kind, name)
        doc = docs[-1]
        if doc["kind"] == "TrainJob":
            assert doc["spec"]["trainer"]["numNodes"] == 2
            args = doc["spec"]["trainer"]["command"]
        else:
            assert doc["kind"] == "PyTorchJob"
            replicas = doc["spec"]["pytorchReplicaSpecs"]
            elastic = doc["spec"].get("elasticPolicy")
            assert replicas["Worker"]["replicas"] == (2 if elastic else 1)
            assert not elastic or (elastic["minReplicas"], elastic["maxReplicas"]) == (1, 2)
            replica = replicas["Worker"] if elastic else replicas["Master"]
            container = replica["template"]["spec"]["containers"][0]
            args = container["command"] + container["args"]
        assert args[args.index("run") + 1] == "/fsx/recipes/llama3-8b-lora-trn1.yaml"


def test_trainium_torchx_line_renders(tmp_path):
    (argv,) = [a for a in doc_commands("torchx run") if "kubernetes" in a]
    job = torchx_dryrun(argv, tmp_path)
    container = job["spec"]["tasks"][0]["template"]["spec"]["containers"][0]
    env_of = {e["name"]: e["value"] for e in container["env"]}
    assert "--cache_dir=/fsx/neuron-cache" in env_of["NEURON_CC_FLAGS"]  # read from the shipped recipe

"""The container images under ``docker/``: which Dockerfile builds what, their build command, and a
small Dockerfile reader (instructions with their arguments) for checks without a Docker daemon.

- ``docker/Dockerfile.cpu``: ``python:3.11-slim`` (``BASE_IMAGE``) + CPU torch ``TORCH_VERSION``
  (``TORCH_INDEX_URL``; a CUDA index makes a GPU image), pinned as installed, + ``pip install
  ".[s3,tensorboard,etcd]"`` (``etcd``: python-etcd, for torchrun's etcd rendezvous).
- ``docker/Dockerfile.neuron``: an AWS Neuron training image (``BASE_IMAGE``) whose torch /
  torch-neuronx / torch-xla / neuronx-cc are pinned as installed, + the same ``pip install``.
  Both pass hadolint (``tests/test_cluster.py``).

Both copy the project to ``/opt/nxd-finetune`` (recipes included) and check ``nxd-finetune --help``
and ``nxd-finetune validate builtin:quickstart`` with the installed package.
"""

from __future__ import annotations

DOCKERFILES: dict[str, str] = {"cpu": "docker/Dockerfile.cpu", "neuron": "docker/Dockerfile.neuron"}


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

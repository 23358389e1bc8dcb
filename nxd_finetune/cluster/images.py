"""The container images under ``docker/``: which Dockerfile builds what and their build command
(``tests/test_cluster.py`` reads them without a Docker daemon).

- ``docker/Dockerfile.cpu``: ``python:3.11-slim`` (``BASE_IMAGE``) + CPU torch ``TORCH_VERSION``
  (``TORCH_INDEX_URL``; a CUDA index makes a GPU image), pinned as installed, + ``pip install
  ".[s3,tensorboard,etcd]"`` (``etcd``: python-etcd, for torchrun's etcd rendezvous).
- ``docker/Dockerfile.neuron``: an AWS Neuron training image (``BASE_IMAGE``) whose torch /
  torch-neuronx / torch-xla / neuronx-cc are pinned as installed, + the same ``pip install``: the
  torch-xla path (Neuron SDK <= 2.28, Trn1 / Trn2, ``training.device: xla``).
- ``docker/Dockerfile.torchneuron``: the same on an AWS Neuron training image for TorchNeuron
  (Neuron SDK 2.33+, Trn2 / Trn3, ``training.device: neuron``), its torch / torch-neuronx pinned.
  All pass hadolint (``tests/test_cluster.py``, ``tests/test_trainium_paths.py``).

All copy the project to ``/opt/nxd-finetune`` (recipes included) and check ``nxd-finetune --help``
and ``nxd-finetune validate builtin:quickstart`` with the installed package.
"""

from __future__ import annotations

DOCKERFILES: dict[str, str] = {"cpu": "docker/Dockerfile.cpu", "neuron": "docker/Dockerfile.neuron",
                               "torchneuron": "docker/Dockerfile.torchneuron"}

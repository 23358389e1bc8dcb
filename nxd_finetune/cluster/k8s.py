"""Kubernetes manifests for a recipe, without TorchX: a Kubeflow training-operator ``PyTorchJob``
(one ``Master`` and ``nodes - 1`` ``Worker`` pods, each running ``torchrun`` with
``nproc_per_node = parallel.nproc / nodes`` processes) and a one-node precompile ``Job``
(``nxd-finetune precompile``, filling the Neuron compile cache on the shared volume).

Plain dicts (:func:`pytorchjob`, :func:`precompile_job`) written as YAML by :func:`to_yaml`; the
``nxd-finetune k8s`` commands (:mod:`.cli`) load the recipe first, so the manifests follow its
layout and its ``neuron:`` section (:mod:`.spec`).

The PyTorchJob's pods rendezvous through c10d on the master pod: the operator sets
``MASTER_ADDR`` / ``MASTER_PORT`` in every pod and Kubernetes expands ``$(MASTER_ADDR)`` in the
container's arguments, so the same command runs on every node.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from nxd_finetune.cluster.spec import INSTANCE_TYPE_LABEL, device_resources, job_env, node_layout, torchrun_command
from nxd_finetune.errors import NxdError
from nxd_finetune.recipe import Recipe

PYTORCHJOB_API = "kubeflow.org/v1"
MASTER_PORT = 23456  # the training operator's default port (container port "pytorchjob-port")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?")


@dataclasses.dataclass(frozen=True)
class PodSettings:
    """What every pod of a job shares. ``pvc`` / ``mount_path``: a PersistentVolumeClaim (FSx for
    Lustre on EKS) mounted in every pod; ``cpu`` / ``memory``: Kubernetes quantities (``"120"``,
    ``"480Gi"``) requested and limited, None leaves them out."""

    image: str
    accelerator: str = "neuron"
    efa: int = 0
    instance_type: str | None = None
    pvc: str | None = None
    mount_path: str = "/fsx"
    cpu: str | None = None
    memory: str | None = None
    namespace: str = "default"


def check_name(name: str) -> str:
    """``name`` if it is a valid Kubernetes object name (lowercase letters, digits, ``-``), else NxdError."""
    if not _NAME.fullmatch(name):
        raise NxdError(f"job name {name!r} is not a Kubernetes name: lowercase letters, digits and '-', "
                       "starting and ending with a letter or digit, at most 52 characters")
    return name


def _container(name: str, pod: PodSettings, args: list[str], nproc_per_node: int, env: dict[str, str],
               ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices = {k: str(v) for k, v in device_resources(pod.accelerator, nproc_per_node, pod.efa).items()}
    limits: dict[str, str] = dict(devices)
    requests: dict[str, str] = dict(devices)
    for key, value in (("cpu", pod.cpu), ("memory", pod.memory)):
        if value:
            limits[key] = requests[key] = value
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if pod.pvc:
        mounts.append({"name": "shared", "mountPath": pod.mount_path})
    container: dict[str, Any] = {
        "name": name,
        "image": pod.image,
        "imagePullPolicy": "IfNotPresent",
        "command": args[:1],
        "args": args[1:],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "resources": {"limits": limits, "requests": requests},
        "volumeMounts": mounts,
    }
    if ports:
        container["ports"] = [dict(p) for p in ports]
    return container


def _pod_spec(container: dict[str, Any], pod: PodSettings, restart_policy: str) -> dict[str, Any]:
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if pod.pvc:
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": pod.pvc}})
    spec: dict[str, Any] = {"restartPolicy": restart_policy, "containers": [container], "volumes": volumes}
    if pod.instance_type:
        spec["nodeSelector"] = {INSTANCE_TYPE_LABEL: pod.instance_type}
    return spec


def pytorchjob(recipe: Recipe, recipe_path: str, overrides: Sequence[str], pod: PodSettings, *, nodes: int,
               name: str, max_restarts: int = 0) -> dict[str, Any]:
    """The ``PyTorchJob`` training ``recipe`` (its path inside the pods: ``recipe_path``, then
    ``overrides``) on ``nodes`` pods of ``parallel.nproc / nodes`` processes. Raises NxdError when
    the layout does not split over the nodes or the name is not a Kubernetes name."""
    layout = node_layout(recipe, nodes)
    cmd = torchrun_command(layout, recipe_path, overrides, rdzv_backend="c10d",
                           rdzv_endpoint="$(MASTER_ADDR):$(MASTER_PORT)", rdzv_id=check_name(name),
                           max_restarts=max_restarts)
    env = job_env(recipe, pod.accelerator, pod.efa, max_restarts)
    ports = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT}]
    def template() -> dict[str, Any]:  # one per replica type (no YAML anchors)
        return {"spec": _pod_spec(_container("pytorch", pod, cmd, layout.nproc_per_node, env, ports), pod, "Never")}

    replicas: dict[str, Any] = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template()}}
    if nodes > 1:
        replicas["Worker"] = {"replicas": nodes - 1, "restartPolicy": "Never", "template": template()}
    return {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": pod.namespace,
                     "labels": {"app.kubernetes.io/name": "nxd-finetune"}},
        "spec": {"runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 0}, "pytorchReplicaSpecs": replicas},
    }


def precompile_job(recipe: Recipe, recipe_path: str, overrides: Sequence[str], pod: PodSettings, *, nodes: int,
                   name: str, steps: int = 5) -> dict[str, Any]:
    """A one-node ``Job`` running ``nxd-finetune precompile`` with one node's share of the
    processes (``parallel.nproc / nodes``: tp and pp as in the recipe, dp divided by ``nodes``), so
    the Neuron compile cache (``neuron.compile_cache`` on the shared volume) holds the graphs of
    the training job's ranks before it starts."""
    layout = node_layout(recipe, nodes)
    par = recipe.parallel
    if layout.nproc_per_node % (par.tp * par.pp):
        raise NxdError(f"one node runs {layout.nproc_per_node} process(es), not a multiple of tp*pp={par.tp}*{par.pp}: "
                       "keep tensor and pipeline groups within a node to precompile on one")
    cmd = ["nxd-finetune", "precompile", recipe_path, *overrides, "--nproc", str(layout.nproc_per_node),
           "--steps", str(steps)]
    env = job_env(recipe, pod.accelerator, pod.efa)
    container = _container("precompile", pod, cmd, layout.nproc_per_node, env)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": check_name(name), "namespace": pod.namespace,
                     "labels": {"app.kubernetes.io/name": "nxd-finetune"}},
        "spec": {"backoffLimit": 0, "template": {"spec": _pod_spec(container, pod, "Never")}},
    }


def to_yaml(*docs: dict[str, Any]) -> str:
    """The manifests as one multi-document YAML text (``kubectl apply -f``)."""
    import yaml

    return "---\n".join(yaml.safe_dump(d, sort_keys=False, default_flow_style=False) for d in docs)

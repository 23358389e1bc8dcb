"""Kubeflow Trainer v2 (the training operator's successor, ``trainer.kubeflow.org/v1alpha1``): a
``TrainJob`` training a recipe, and the ``ClusterTrainingRuntime`` for torch it refers to.

The runtime is the Trainer's torch runtime reduced to what nxd-finetune needs: one replicated job
``node`` whose container ``node`` the Trainer's torch plugin gives ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``, which
``torchrun`` reads as the defaults of its options. The ``TrainJob`` sets the image, the
``torchrun ... -m nxd_finetune run RECIPE OVERRIDES`` line (static rendezvous on the first node, as
the Trainer sets it up), nodes and processes per node (``parallel.nproc`` / nodes), each node's
devices and the environment (:func:`.spec.job_env`), and patches the runtime's pod with the shared
volume, ``/dev/shm``, node selector and service account (``runtimePatches``, Trainer API 2.3).
The shared volume, compile cache and image are handled as for the PyTorchJob (:mod:`.k8s`).
"""

from __future__ import annotations

from collections.abc import Sequence

from nxd_finetune.cluster.k8s import (
    K8sObject,
    PodSettings,
    for_pods,
    pod_env,
    pod_mounts,
    pod_resources,
    pod_volumes,
)
from nxd_finetune.cluster.spec import INSTANCE_TYPE_LABEL, check_image, job_env, node_layout
from nxd_finetune.cluster.validate import check_name
from nxd_finetune.errors import NxdError
from nxd_finetune.recipe import Recipe

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
RUNTIME = "nxd-finetune-torch"
NODE = "node"  # the replicated job and container the Trainer's torch plugin configures
PATCH_MANAGER = "nxd-finetune"


def cluster_training_runtime(image: str, name: str = RUNTIME) -> K8sObject:
    """The ``ClusterTrainingRuntime`` for torch that :func:`trainjob` refers to (apply once per
    cluster); ``image`` is its default, which every TrainJob sets anyway."""
    return {
        "apiVersion": TRAINER_API,
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": check_name(name, "--runtime"), "labels": {"trainer.kubeflow.org/framework": "torch"}},
        "spec": {
            "mlPolicy": {"numNodes": 1, "torch": {}},
            "template": {"spec": {"replicatedJobs": [{
                "name": NODE,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                    "spec": {"template": {"spec": {"containers": [{"name": NODE, "image": image}]}}},
                },
            }]}},
        },
    }


def trainjob(recipe: Recipe, recipe_path: str, overrides: Sequence[str], pod: PodSettings, *, nodes: int,
             name: str, max_restarts: int = 0, runtime: str = RUNTIME, min_nodes: int | None = None) -> K8sObject:
    """The ``TrainJob`` training ``recipe`` (its path inside the pods: ``recipe_path``, then
    ``overrides``) on ``nodes`` nodes of ``parallel.nproc / nodes`` processes through ``runtime``.
    A node range (``min_nodes`` < ``nodes``) is refused: the Trainer API (2.3) has no elastic
    policy, ``trainer.numNodes`` and the runtime's ``mlPolicy.numNodes`` are one count and its torch
    policy has no min / max nodes."""
    if min_nodes is not None and min_nodes < nodes:
        raise NxdError(f"--nodes {min_nodes}:{nodes}: a Kubeflow Trainer TrainJob has one node count (the Trainer "
                       "API has no elastic policy); use `nxd-finetune k8s pytorchjob --nodes MIN:MAX` for an "
                       "elastic job")
    layout = node_layout(recipe, nodes)
    check_name(name)
    if max_restarts < 0:
        raise NxdError(f"max_restarts must be 0 or more, got {max_restarts}")
    recipe, overrides = for_pods(recipe, overrides, pod, precompile=False)
    command = ["torchrun", "--nnodes", str(layout.nnodes), "--nproc-per-node", str(layout.nproc_per_node),
               "--max-restarts", str(max_restarts), "-m", "nxd_finetune", "run", recipe_path, *overrides]
    pod_spec: K8sObject = {"volumes": pod_volumes(pod),
                                "containers": [{"name": NODE, "volumeMounts": pod_mounts(pod)}]}
    if pod.instance_type:
        pod_spec["nodeSelector"] = {INSTANCE_TYPE_LABEL: pod.instance_type}
    if pod.service_account:
        pod_spec["serviceAccountName"] = pod.service_account
    patch = {"template": {"spec": {"replicatedJobs": [
        {"name": NODE, "template": {"spec": {"template": {"spec": pod_spec}}}}]}}}
    return {
        "apiVersion": TRAINER_API,
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": pod.namespace, "labels": {"app.kubernetes.io/name": "nxd-finetune"}},
        "spec": {
            "runtimeRef": {"name": runtime, "kind": "ClusterTrainingRuntime", "apiGroup": TRAINER_API.split("/")[0]},
            "trainer": {
                "image": check_image(pod.image),
                "command": command,
                "numNodes": layout.nnodes,
                "numProcPerNode": layout.nproc_per_node,
                "resourcesPerNode": pod_resources(pod, layout.nproc_per_node),
                "env": pod_env(job_env(recipe, pod.accelerator, pod.efa), pod),
            },
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": patch}],
        },
    }

"""Kubernetes manifests for a recipe, without TorchX: a Kubeflow training-operator ``PyTorchJob``
(one ``Master`` and ``nodes - 1`` ``Worker`` pods, each running ``torchrun`` with
``nproc_per_node = parallel.nproc / nodes`` processes) and the precompile job that fills the Neuron
compile cache on the shared volume with the training job's graphs.

The precompile job runs the training job's exact layout, so it traces the same per-rank shapes, the
same micro-batches per step and the same collectives: on one node a ``Job`` running
``nxd-finetune precompile`` with all the processes; on several a ``PyTorchJob`` of as many pods as
training, each running ``neuron_parallel_compile`` around the training job's ``torchrun`` line (the
pattern of the Neuron multi-node examples), with the precompile overrides of
:func:`nxd_finetune.neuron.precompile_overrides`. For an elastic training job (a node range) one
precompile job per node count of the range: dp, and with it the ZeRO-1 optimizer-step graphs,
differs on every count (:func:`precompile_jobs`).

Plain dicts (:func:`pytorchjob`, :func:`precompile_jobs`) written as YAML by :func:`to_yaml`; the
``nxd-finetune k8s`` commands (:mod:`.cli`) load the recipe first, so the manifests follow its
layout and its ``neuron:`` section (:mod:`.spec`). With a shared volume (``pvc``) the compile cache
goes on it and the recipe's paths the pods cannot see are warned about (:mod:`.volume`).

The PyTorchJob's pods rendezvous through c10d on the master pod: the operator sets
``MASTER_ADDR`` / ``MASTER_PORT`` in every pod and Kubernetes expands ``$(MASTER_ADDR)`` in the
container's arguments, so the same command runs on every node.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from nxd_finetune.cluster import validate
from nxd_finetune.cluster.spec import (
    INSTANCE_TYPE_LABEL,
    NodeLayout,
    check_image,
    device_resources,
    elastic_layout,
    job_env,
    node_layout,
    torchrun_command,
)
from nxd_finetune.cluster.validate import check_name
from nxd_finetune.cluster.volume import cache_on_volume, warn_unseen_paths
from nxd_finetune.errors import NxdError
from nxd_finetune.neuron import PARALLEL_COMPILE, native_device, precompile_overrides, require_xla_recipe
from nxd_finetune.recipe import Recipe

PYTORCHJOB_API = "kubeflow.org/v1"
MASTER_PORT = 23456  # the training operator's default port (container port "pytorchjob-port")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NODES_LABEL = "nxd-finetune/nodes"  # a precompile job's node count (kubectl apply -l nxd-finetune/nodes=N)
PRECOMPILE_OUT = "/tmp/nxd-precompile"  # the precompile run's output.dir in its pods (thrown away)
# a Kubernetes object (or a part of one) as plain data: what to_yaml writes for kubectl
K8sObject = dict[str, object]


@dataclasses.dataclass(frozen=True)
class PodSettings:
    """What every pod of a job shares. ``pvc`` / ``mount_path``: a PersistentVolumeClaim (FSx for
    Lustre on EKS) mounted in every pod; ``cpu`` / ``memory``: Kubernetes quantities (``"120"``,
    ``"480Gi"``) requested and limited, None leaves them out. ``env``: more environment variables
    (they win over the generated ones); ``service_account``: the pods' ``serviceAccountName``
    (IAM roles for service accounts give them S3 access on EKS)."""

    image: str
    accelerator: str = "neuron"
    efa: int = 0
    instance_type: str | None = None
    pvc: str | None = None
    mount_path: str = "/fsx"
    cpu: str | None = None
    memory: str | None = None
    namespace: str = "default"
    env: tuple[tuple[str, str], ...] = ()
    service_account: str | None = None

    def __post_init__(self) -> None:
        """Each value against Kubernetes' syntax for it (:mod:`~nxd_finetune.cluster.validate`):
        NxdError naming the flag."""
        validate.check_image(self.image)
        validate.check_namespace(self.namespace)
        validate.check_mount_path(self.mount_path)
        for flag, value in (("--service-account", self.service_account), ("--pvc", self.pvc)):
            if value is not None:
                validate.check_subdomain(flag, value)
        for flag, value in (("--cpu", self.cpu), ("--memory", self.memory)):
            if value is not None:
                validate.check_quantity(flag, value)
        if self.instance_type is not None:
            validate.check_label_value("--instance-type", self.instance_type)


def parse_env(pairs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``KEY=VALUE`` texts as pairs; NxdError (one line) for one without ``=`` or with a key that is
    not an environment variable name."""
    out = []
    for text in pairs:
        key, sep, value = text.partition("=")
        if not sep or not _ENV_KEY.fullmatch(key):
            raise NxdError(f"--env {text!r}: write KEY=VALUE with KEY of letters, digits and '_' (not starting "
                           "with a digit)")
        out.append((key, value))
    return tuple(out)


def pod_resources(pod: PodSettings, nproc_per_node: int) -> dict[str, dict[str, str]]:
    """``limits`` and ``requests`` of one node's pod: its devices, and the CPU / memory given."""
    limits = {k: str(v) for k, v in device_resources(pod.accelerator, nproc_per_node, pod.efa,
                                                                pod.instance_type).items()}
    for key, value in (("cpu", pod.cpu), ("memory", pod.memory)):
        if value:
            limits[key] = value
    return {"limits": limits, "requests": dict(limits)}


def pod_env(env: dict[str, str], pod: PodSettings) -> list[dict[str, str]]:
    """The container's environment: ``env`` with the user's ``--env`` over it."""
    return [{"name": k, "value": v} for k, v in {**env, **dict(pod.env)}.items()]


def pod_mounts(pod: PodSettings) -> list[dict[str, str]]:
    """A memory-backed ``/dev/shm`` (dataloader workers, the elastic agent), and the shared volume."""
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if pod.pvc:
        mounts.append({"name": "shared", "mountPath": pod.mount_path})
    return mounts


def pod_volumes(pod: PodSettings) -> list[K8sObject]:
    """The volumes :func:`pod_mounts` mounts."""
    volumes: list[K8sObject] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if pod.pvc:
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": pod.pvc}})
    return volumes


def _container(name: str, pod: PodSettings, args: list[str], nproc_per_node: int, env: dict[str, str],
               ports: list[K8sObject] | None = None) -> K8sObject:
    container: K8sObject = {
        "name": name,
        "image": check_image(pod.image),
        "imagePullPolicy": "IfNotPresent",
        "command": args[:1],
        "args": args[1:],
        "env": pod_env(env, pod),
        "resources": pod_resources(pod, nproc_per_node),
        "volumeMounts": pod_mounts(pod),
    }
    if ports:
        container["ports"] = [dict(p) for p in ports]
    return container


def _pod_spec(container: K8sObject, pod: PodSettings, restart_policy: str) -> K8sObject:
    spec: K8sObject = {"restartPolicy": restart_policy, "containers": [container], "volumes": pod_volumes(pod)}
    if pod.instance_type:
        spec["nodeSelector"] = {INSTANCE_TYPE_LABEL: pod.instance_type}
    if pod.service_account:
        spec["serviceAccountName"] = pod.service_account
    return spec


def for_pods(recipe: Recipe, overrides: Sequence[str], pod: PodSettings, *,
             precompile: bool) -> tuple[Recipe, list[str]]:
    """The recipe and overrides the pods get: with a shared volume the Neuron compile cache on it
    (:func:`.volume.cache_on_volume`) and a warning per recipe path the pods cannot see. A
    precompile job needs the volume (its compile cache would die with its pod)."""
    if pod.pvc is None:
        if precompile and pod.accelerator == "neuron":
            raise NxdError("the precompile job needs a shared volume for the compile cache (--pvc CLAIM): "
                           "on a pod's own disk the graphs are lost with the pod")
        return recipe, list(overrides)
    if pod.accelerator == "neuron" and not native_device(recipe):  # torch-xla's compile cache
        recipe, overrides = cache_on_volume(recipe, overrides, pod.pvc, pod.mount_path, require=precompile)
    warn_unseen_paths(recipe, pod.pvc, pod.mount_path, skip=("neuron.compile_cache",))
    return recipe, list(overrides)


def _pytorchjob_doc(name: str, pod: PodSettings, cmd: list[str], layout: NodeLayout, env: dict[str, str],
                    container_name: str = "pytorch", labels: dict[str, str] | None = None,
                    elastic: tuple[int, int, int] | None = None) -> K8sObject:
    """A ``PyTorchJob`` of ``layout.nnodes`` pods (one Master, the rest Workers) running ``cmd``;
    ``labels``: the job's (default ``app.kubernetes.io/name: nxd-finetune``). ``elastic``: ``(min
    nodes, max nodes, max restarts)``: Workers only, with the operator's ``elasticPolicy``
    (:func:`_elastic`)."""
    ports = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT}]

    def template(restart_policy: str) -> K8sObject:  # one per replica type (no YAML anchors)
        container = _container(container_name, pod, cmd, layout.nproc_per_node, env, ports)
        return {"spec": _pod_spec(container, pod, restart_policy)}

    replicas: K8sObject
    spec: K8sObject
    if elastic is None:
        replicas = {"Master": {"replicas": 1, "restartPolicy": "Never", "template": template("Never")}}
        if layout.nnodes > 1:
            replicas["Worker"] = {"replicas": layout.nnodes - 1, "restartPolicy": "Never",
                                  "template": template("Never")}
        spec = {"runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 0}, "pytorchReplicaSpecs": replicas}
    else:
        min_nodes, max_nodes, max_restarts = elastic
        # a failed pod comes back (OnFailure) and rejoins: the world grows again up to max_nodes
        replicas = {"Worker": {"replicas": max_nodes, "restartPolicy": "OnFailure", "template": template("OnFailure")}}
        spec = {"runPolicy": {"cleanPodPolicy": "None", "backoffLimit": max_restarts},
                "pytorchReplicaSpecs": replicas,
                "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": min_nodes, "maxReplicas": max_nodes,
                                  "maxRestarts": max_restarts}}
    return {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": {"name": check_name(name), "namespace": pod.namespace,
                     "labels": labels or {"app.kubernetes.io/name": "nxd-finetune"}},
        "spec": spec,
    }


def _master_torchrun(layout: NodeLayout, recipe_path: str, overrides: Sequence[str], name: str,
                     max_restarts: int = 0) -> list[str]:
    return torchrun_command(layout, recipe_path, overrides, rdzv_backend="c10d",
                            rdzv_endpoint="$(MASTER_ADDR):$(MASTER_PORT)", rdzv_id=check_name(name),
                            max_restarts=max_restarts)


def pytorchjob(recipe: Recipe, recipe_path: str, overrides: Sequence[str], pod: PodSettings, *, nodes: int,
               name: str, max_restarts: int = 0, min_nodes: int | None = None) -> K8sObject:
    """The ``PyTorchJob`` training ``recipe`` (its path inside the pods: ``recipe_path``, then
    ``overrides``) on ``nodes`` pods of ``parallel.nproc / nodes`` processes. Raises NxdError when
    the layout does not split over the nodes or the name is not a Kubernetes name. ``min_nodes`` <
    ``nodes``: an elastic job (:func:`_elastic`)."""
    if min_nodes is not None and min_nodes < nodes:
        return _elastic(recipe, recipe_path, overrides, pod, min_nodes, nodes, name, max_restarts)
    layout = node_layout(recipe, nodes)
    recipe, overrides = for_pods(recipe, overrides, pod, precompile=False)
    cmd = _master_torchrun(layout, recipe_path, overrides, name, max_restarts)
    return _pytorchjob_doc(name, pod, cmd, layout, job_env(recipe, pod.accelerator, pod.efa))


def _elastic(recipe: Recipe, recipe_path: str, overrides: Sequence[str], pod: PodSettings, min_nodes: int,
             max_nodes: int, name: str, max_restarts: int) -> K8sObject:
    """An elastic ``PyTorchJob`` (the operator's ``elasticPolicy``): ``max_nodes`` Worker pods, the
    job going on while ``min_nodes`` remain, torch elastic re-forming the world (and the run resuming
    from its newest checkpoint at the new dp) when nodes come and go; ``parallel.nproc`` is the
    world at ``max_nodes`` (:func:`.spec.elastic_layout`). The operator gives every pod
    ``PET_RDZV_ENDPOINT`` (a c10d store behind the first Worker's Service) and ``PET_RDZV_ID``."""
    layout = elastic_layout(recipe, min_nodes, max_nodes, overrides)
    check_name(name)
    recipe, overrides = for_pods(recipe, overrides, pod, precompile=False)
    cmd = ["torchrun", "--nnodes", f"{min_nodes}:{max_nodes}", "--nproc-per-node", str(layout.nproc_per_node),
           "--max-restarts", str(max_restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", "$(PET_RDZV_ENDPOINT)",
           "--rdzv-id", name, "-m", "nxd_finetune", "run", recipe_path, *overrides]
    return _pytorchjob_doc(name, pod, cmd, layout, job_env(recipe, pod.accelerator, pod.efa),
                           elastic=(min_nodes, max_nodes, max_restarts))


def precompile_job(recipe: Recipe, recipe_path: str, overrides: Sequence[str], pod: PodSettings, *, nodes: int,
                   name: str, steps: int = 5) -> K8sObject:
    """The job that fills the compile cache with the graphs of :func:`pytorchjob`'s ranks (same
    recipe, overrides and ``nodes``): the training layout exactly (tp, pp, dp, ZeRO-1 shards,
    micro-batches per step), for ``steps`` steps. One node: a ``Job`` running ``nxd-finetune
    precompile --nproc parallel.nproc``; several: a ``PyTorchJob`` whose pods run
    ``neuron_parallel_compile torchrun ...`` as training runs ``torchrun``. Needs a shared volume
    on Neuron (``pod.pvc``), where the cache goes."""
    layout = node_layout(recipe, nodes)
    check_name(name)
    recipe, overrides = for_pods(recipe, overrides, pod, precompile=True)
    return _precompile(recipe, recipe_path, overrides, pod, layout, name, steps)


def precompile_jobs(recipe: Recipe, recipe_path: str, overrides: Sequence[str], pod: PodSettings, *, nodes: int,
                    name: str, steps: int = 5, min_nodes: int | None = None) -> list[K8sObject]:
    """The precompile jobs of :func:`pytorchjob` with the same arguments. One node count:
    :func:`precompile_job`. An elastic range (``min_nodes`` < ``nodes``): the ranks run another
    layout on every node count (dp, and with it the ZeRO-1 shards and micro-batches per step,
    follows the world), so one job per count ``n``, named ``<name>-<n>n``, with training's layout
    there: ``n`` nodes of ``parallel.nproc / nodes`` processes (:func:`.spec.elastic_layout`). The
    jobs are independent; each carries the label ``nxd-finetune/nodes: n``. NxdError for a recipe
    off torch-xla (:func:`nxd_finetune.neuron.require_xla_recipe`)."""
    require_xla_recipe(recipe)
    if min_nodes is None or min_nodes >= nodes:
        return [precompile_job(recipe, recipe_path, overrides, pod, nodes=nodes, name=name, steps=steps)]
    per_node = elastic_layout(recipe, min_nodes, nodes, overrides).nproc_per_node
    check_name(name)
    names = {n: f"{name}-{n}n" for n in range(min_nodes, nodes + 1)}
    if too_long := [job for job in names.values() if not validate.JOB_NAME.fullmatch(job)]:
        raise NxdError(f"--name {name!r}: the job name of a node count, {too_long[-1]!r}, is over 52 characters; "
                       "give a shorter --name")
    recipe, overrides = for_pods(recipe, overrides, pod, precompile=True)
    return [_precompile(recipe, recipe_path, overrides, pod, NodeLayout(n, per_node), job, steps)
            for n, job in names.items()]


def _precompile(recipe: Recipe, recipe_path: str, overrides: Sequence[str], pod: PodSettings, layout: NodeLayout,
                name: str, steps: int) -> K8sObject:
    """The precompile job of ``layout`` (``recipe`` and ``overrides`` as the pods get them): the
    world is ``layout``'s (``--nproc`` on one node, the torchrun world on several)."""
    env = job_env(recipe, pod.accelerator, pod.efa)
    labels = {"app.kubernetes.io/name": "nxd-finetune", NODES_LABEL: str(layout.nnodes)}
    if layout.nnodes > 1:
        run_overrides = [*overrides, *precompile_overrides(recipe, steps, PRECOMPILE_OUT)]
        cmd = [PARALLEL_COMPILE, *_master_torchrun(layout, recipe_path, run_overrides, name)]
        return _pytorchjob_doc(name, pod, cmd, layout, env, container_name="pytorch", labels=labels)
    cmd = ["nxd-finetune", "precompile", recipe_path, *overrides, "--nproc", str(layout.nproc_per_node),
           "--steps", str(steps)]
    container = _container("precompile", pod, cmd, layout.nproc_per_node, env)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": check_name(name), "namespace": pod.namespace, "labels": labels},
        "spec": {"backoffLimit": 0, "template": {"spec": _pod_spec(container, pod, "Never")}},
    }


def to_yaml(*docs: K8sObject) -> str:
    """The manifests as one multi-document YAML text (``kubectl apply -f``)."""
    import yaml

    return "---\n".join(yaml.safe_dump(d, sort_keys=False, default_flow_style=False) for d in docs)

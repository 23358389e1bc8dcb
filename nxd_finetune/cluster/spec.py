"""What every cluster job of a recipe has in common: its node layout, the ``torchrun`` line each
node runs, the accelerator resources a node asks for and the environment the recipe implies.

Pure functions of the recipe (no torchx, no kubernetes imports); :mod:`.components` (TorchX) and
:mod:`.k8s` (PyTorchJob / precompile Job YAML) build on them, so both stay in step with the
recipe's layout: processes per node = ``parallel.nproc`` (tp x pp x dp) / nodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from nxd_finetune.errors import NxdError, RecipeError
from nxd_finetune.neuron import native_device, neuron_env
from nxd_finetune.parallel.launch import SHARE_STORE_ENV
from nxd_finetune.recipe import Recipe

Accelerator = Literal["neuron", "gpu", "cpu"]
ACCELERATORS: tuple[str, ...] = ("neuron", "gpu", "cpu")
NEURON_RESOURCE = "aws.amazon.com/neuron"  # Neuron device plugin: Trainium chips
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
# processes (one per NeuronCore) per Neuron device: a Trn1 chip has 2 NeuronCores; a Trn2 chip's 8
# physical NeuronCores are 4 logical ones at Neuron's default logical-core size (LNC=2)
NEURON_CORES_PER_DEVICE = 2
NEURON_CORES_PER_DEVICE_OF: dict[str, int] = {"trn2": 4}
RDZV_BACKENDS: tuple[str, ...] = ("c10d", "etcd", "etcd-v2", "static")
ETCD_ENDPOINT = "etcd-server:2379"  # the etcd service of the EKS pattern (TorchX + Volcano)
# libfabric's EFA provider, as the Neuron multi-node examples set it
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
# the default image of the cluster jobs and the TorchX component: a registry path to replace
# (uppercase: no registry accepts it as is)
IMAGE_PLACEHOLDER = "REGISTRY/nxd-finetune:neuron"


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """``nnodes`` nodes of ``nproc_per_node`` processes: the recipe's ``parallel.nproc`` split."""

    nnodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def check_image(image: str) -> str:
    """``image``; NxdError (one line) while it is the ``--image`` placeholder."""
    if image == IMAGE_PLACEHOLDER:
        raise NxdError(f"--image is the placeholder {IMAGE_PLACEHOLDER}: give the image your cluster pulls, e.g. "
                       "<account>.dkr.ecr.<region>.amazonaws.com/nxd-finetune:neuron (built from docker/)")
    return image


def node_layout(recipe: Recipe, nnodes: int) -> NodeLayout:
    """Split ``parallel.nproc`` over ``nnodes``. Raises NxdError (one line) when it does not divide."""
    par = recipe.parallel
    if nnodes < 1:
        raise NxdError(f"nodes must be 1 or more, got {nnodes}")
    if par.nproc % nnodes:
        raise NxdError(f"parallel.nproc={par.nproc} (tp {par.tp} x pp {par.pp} x dp {par.dp}) does not split over "
                       f"{nnodes} nodes; set parallel.nproc to a multiple of {nnodes}")
    return NodeLayout(nnodes, par.nproc // nnodes)


def parse_nodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (an elastic node range) -> ``(min, max)``; NxdError for anything else."""
    low, sep, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        lo = hi = 0
    if lo < 1 or hi < lo:
        raise NxdError(f"--nodes {text!r}: give a node count N or a range MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def elastic_layout(recipe: Recipe, min_nodes: int, max_nodes: int, overrides: Sequence[str] = ()) -> NodeLayout:
    """The layout at ``max_nodes`` (``parallel.nproc`` is the world there) of a job torch elastic may
    run on any node count from ``min_nodes`` to ``max_nodes``. Every world in the range must fit the
    layout (tp x pp dividing it, ``global_batch_size`` dividing by ``micro_batch_size x dp``), and the
    recipe must set ``training.global_batch_size``: a run resumed on another node count keeps its
    global batch (grad_accum follows dp). NxdError (one line) otherwise."""
    if any(o.startswith("parallel.nproc=") for o in overrides):
        raise NxdError("with an elastic node range the world is the launcher's: drop the parallel.nproc override")
    layout = node_layout(recipe, max_nodes)
    par, tr = recipe.parallel, recipe.training
    if tr.global_batch_size is None:
        raise NxdError("an elastic node range needs training.global_batch_size: the global batch must stay the same "
                       "when nodes come and go")
    for n in range(min_nodes, max_nodes + 1):
        world = n * layout.nproc_per_node
        if world % (par.tp * par.pp):
            raise NxdError(f"{n} node(s) x {layout.nproc_per_node} process(es) = {world} is not divisible by "
                           f"tp*pp={par.tp}*{par.pp}; narrow the node range")
        try:
            tr.grad_accum_steps(world // (par.tp * par.pp))
        except RecipeError as e:
            raise NxdError(f"on {n} node(s): {e}; narrow the node range") from None
    return layout


def neuron_cores_per_device(instance_type: str | None) -> int:
    """NeuronCores (processes) per Neuron device on ``instance_type`` (trn2.48xlarge, trn2u...: 4;
    others, and no instance type: Trn1's 2)."""
    family = (instance_type or "").split(".", 1)[0].rstrip("nu")
    return NEURON_CORES_PER_DEVICE_OF.get(family, NEURON_CORES_PER_DEVICE)


def device_resources(accelerator: str, nproc_per_node: int, efa: int = 0,
                     instance_type: str | None = None) -> dict[str, int]:
    """Extended resources of one node's pod: Neuron devices (a process drives a NeuronCore:
    :func:`neuron_cores_per_device` of ``instance_type`` processes per device) or GPUs (one per
    process), and ``efa`` EFA interfaces."""
    if accelerator not in ACCELERATORS:
        raise NxdError(f"unknown accelerator {accelerator!r}; use {', '.join(ACCELERATORS)}")
    if efa < 0:
        raise NxdError(f"efa must be 0 or more, got {efa}")
    out: dict[str, int] = {}
    if accelerator == "neuron":
        out[NEURON_RESOURCE] = math.ceil(nproc_per_node / neuron_cores_per_device(instance_type))
    elif accelerator == "gpu":
        out[GPU_RESOURCE] = nproc_per_node
    if efa:
        out[EFA_RESOURCE] = efa
    return out


def job_env(recipe: Recipe | None, accelerator: str, efa: int = 0) -> dict[str, str]:
    """The environment of every pod: on Neuron, for a recipe on torch-xla (not a
    :func:`nxd_finetune.neuron.native_device` one), what the recipe's ``neuron:`` section implies
    (``NEURON_CC_FLAGS`` with the compile cache, the precision preset's ``XLA_*`` / ``NEURON_RT_*``
    variables; :func:`nxd_finetune.neuron.neuron_env` of an empty environment; TorchNeuron's
    ``neuron`` device reads none of them), libfabric's EFA
    settings when the pod has EFA interfaces, and always a fresh process-group store per attempt
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): with the agent's store shared, a multi-node worker
    group restarted by torch elastic hangs in gloo's ``connectFullMesh`` (see
    :mod:`nxd_finetune.parallel.launch`). Without a recipe (not readable here) no Neuron
    variables: the workers set them themselves at start."""
    env: dict[str, str] = {SHARE_STORE_ENV: "1"}
    if accelerator == "neuron" and recipe is not None and not native_device(recipe):
        env.update(neuron_env(recipe, environ={}))
    if efa:
        env.update(EFA_ENV)
    return env


def rdzv_endpoint_for(backend: str, endpoint: str | None, rank0_host: str, port: int) -> str:
    """The rendezvous endpoint: given, else etcd's service for the etcd backends, else
    ``<rank0_host>:<port>`` (c10d store / static master on the first node)."""
    if backend not in RDZV_BACKENDS:
        raise NxdError(f"unknown rendezvous backend {backend!r}; use {', '.join(RDZV_BACKENDS)}")
    if endpoint:
        return endpoint
    return ETCD_ENDPOINT if backend.startswith("etcd") else f"{rank0_host}:{port}"


def torchrun_command(layout: NodeLayout, recipe_path: str, overrides: Sequence[str], *, rdzv_backend: str = "c10d",
                     rdzv_endpoint: str = "localhost:29500", rdzv_id: str = "nxd-finetune", max_restarts: int = 0,
                     node_rank: str | None = None, extra_args: Sequence[str] = ()) -> list[str]:
    """``torchrun ... -m nxd_finetune run RECIPE OVERRIDES``, the same line on every node.

    ``static`` uses ``--master-addr`` / ``--master-port`` from ``rdzv_endpoint`` and needs
    ``node_rank``; the others rendezvous through ``rdzv_endpoint`` under ``rdzv_id``."""
    if max_restarts < 0:
        raise NxdError(f"max_restarts must be 0 or more, got {max_restarts}")
    cmd = ["torchrun", "--nnodes", str(layout.nnodes), "--nproc-per-node", str(layout.nproc_per_node),
           "--max-restarts", str(max_restarts)]
    if rdzv_backend == "static":
        if node_rank is None:
            raise NxdError("a static rendezvous needs the node rank")
        host, _, port = rdzv_endpoint.rpartition(":")
        cmd += ["--node-rank", node_rank, "--master-addr", host, "--master-port", port]
    else:
        cmd += ["--rdzv-backend", rdzv_backend, "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    return [*cmd, *extra_args, "-m", "nxd_finetune", "run", recipe_path, *overrides]

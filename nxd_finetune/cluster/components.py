"""TorchX component for nxd-finetune: ``nnodes`` nodes x ``nproc_per_node`` processes of
``torchrun -m nxd_finetune run RECIPE OVERRIDES`` in ``image``.

::

    # on this machine, from a checkout (local_cwd runs in the current directory, image ignored)
    torchx run --scheduler local_cwd nxd_finetune/cluster/components.py:finetune \\
        --recipe recipes/quickstart.yaml --nproc_per_node 2 -- parallel.tp=2
    # two trn1.32xlarge nodes on EKS (Volcano + etcd), FSx for Lustre claim mounted at /fsx
    torchx run --scheduler kubernetes -cfg queue=default,namespace=default \\
        nxd_finetune/cluster/components.py:finetune --recipe /fsx/recipes/sft.yaml \\
        --image <account>.dkr.ecr.<region>.amazonaws.com/nxd-finetune:neuron --nnodes 2 \\
        --nproc_per_node 32 --accelerator neuron --efa 8 --instance_type trn1.32xlarge \\
        --rdzv_backend etcd --mounts type=volume,src=fsx-claim,dst=/fsx -- training.device=xla

TorchX finds components by file path (``FILE.py:FUNCTION``); with the package installed,
``python -c "import nxd_finetune.cluster.components as c; print(c.__file__)"`` prints it.

Where the recipe can be read here (the path as given, or ``local_recipe``), the component checks
the layout (``parallel.nproc`` after the overrides must equal ``nnodes * nproc_per_node``, or be 1
and then taken from the world) and puts the environment the recipe's ``neuron:`` section implies
into every replica (:func:`nxd_finetune.cluster.spec.job_env`).
"""

# ruff: noqa: UP006, UP007, UP035, UP045  (TorchX's component linter reads typing.Optional / Dict / List, not | or dict[])
from pathlib import Path
from typing import Dict, List, Optional

import torchx.specs as specs
from torchx.specs.finder import ComponentValidationException

from nxd_finetune.cluster.spec import (
    GPU_RESOURCE,
    IMAGE_PLACEHOLDER,
    INSTANCE_TYPE_LABEL,
    NodeLayout,
    check_image,
    device_resources,
    job_env,
    rdzv_endpoint_for,
    torchrun_command,
)
from nxd_finetune.errors import NxdError
from nxd_finetune.recipe import load_recipe

# the schedulers (backend names) that neither pull nor use the role's image: local_cwd's LocalScheduler
# ("local"), which runs in the current directory
IMAGE_IGNORED_BY = ("local",)


def finetune(
    *overrides: str,
    recipe: str,
    image: str = IMAGE_PLACEHOLDER,
    nnodes: int = 1,
    nproc_per_node: int = 1,
    accelerator: str = "cpu",
    efa: int = 0,
    instance_type: Optional[str] = None,
    cpu: int = 2,
    memMB: int = 8192,
    rdzv_backend: str = "c10d",
    rdzv_endpoint: Optional[str] = None,
    rdzv_port: int = 29500,
    max_restarts: int = 0,
    max_retries: int = 0,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
    local_recipe: Optional[str] = None,
    name: str = "nxd-finetune",
) -> specs.AppDef:
    """Fine-tune with nxd-finetune on ``nnodes`` x ``nproc_per_node`` processes.

    Args:
        overrides: recipe overrides ``key.path=value`` (after ``--``)
        recipe: the recipe's path inside the image / on the shared volume
        image: container image your cluster pulls (built from docker/ and pushed); the default is a
            placeholder that every scheduler but local_cwd (which ignores the image) refuses
        nnodes: number of nodes (replicas)
        nproc_per_node: processes per node (NeuronCores on Trainium: 32 per trn1.32xlarge; GPUs)
        accelerator: neuron (aws.amazon.com/neuron devices, one per 2 processes), gpu (nvidia.com/gpu,
            one per process) or cpu
        efa: EFA interfaces per node (vpc.amazonaws.com/efa; 8 on trn1.32xlarge)
        instance_type: node.kubernetes.io/instance-type the pods must run on (e.g. trn1.32xlarge)
        cpu: CPUs per node
        memMB: host memory per node in MB
        rdzv_backend: c10d (store on the first node), etcd / etcd-v2 (an etcd server) or static
        rdzv_endpoint: rendezvous endpoint; default: etcd-server:2379 for etcd, the first node's
            host:rdzv_port otherwise
        rdzv_port: port of the c10d store / static master on the first node
        max_restarts: torch elastic restarts of the worker group (the run resumes from its newest checkpoint)
        max_retries: scheduler retries of a failed replica
        env: more environment variables (KEY=VALUE,KEY=VALUE)
        mounts: mounts, e.g. type=volume,src=fsx-claim,dst=/fsx (see the scheduler's documentation)
        local_recipe: where the recipe is readable here, to check the layout and derive the environment
        name: job name
    """
    try:  # torchx run prints a ComponentValidationException as its one error line
        if nnodes < 1 or nproc_per_node < 1:
            raise NxdError(f"nnodes and nproc_per_node must be 1 or more, got {nnodes} and {nproc_per_node}")
        layout = NodeLayout(nnodes, nproc_per_node)
        recipe_env = _recipe_env(local_recipe or recipe, list(overrides), layout, accelerator, efa)
        if nnodes == 1 and rdzv_backend == "c10d" and rdzv_endpoint is None:
            endpoint = "localhost:0"  # one agent: any free port
        else:
            endpoint = rdzv_endpoint_for(rdzv_backend, rdzv_endpoint, f"$${{{specs.macros.rank0_env}:=localhost}}",
                                         rdzv_port)
        cmd = torchrun_command(layout, recipe, overrides, rdzv_backend=rdzv_backend, rdzv_endpoint=endpoint,
                               rdzv_id=specs.macros.app_id, max_restarts=max_restarts,
                               node_rank=specs.macros.replica_id, extra_args=["--tee", "3"])
        devices = device_resources(accelerator, nproc_per_node, efa, instance_type)
        gpu = devices.pop(GPU_RESOURCE, 0)  # TorchX's own field (nvidia.com/gpu on Kubernetes)
        resource = specs.Resource(cpu=cpu, gpu=gpu, memMB=memMB, devices=devices,
                                  capabilities={INSTANCE_TYPE_LABEL: instance_type} if instance_type else {})
        return specs.AppDef(
            name=name,
            roles=[
                PulledImageRole(
                    name="trainer",
                    image=image,
                    entrypoint="bash",
                    args=["-c", " ".join(_quote(a) for a in cmd)],
                    num_replicas=nnodes,
                    min_replicas=nnodes,
                    resource=resource,
                    env={"LOGLEVEL": "WARNING", **recipe_env, **(env or {})},
                    port_map={"c10d": rdzv_port},
                    max_retries=max_retries,
                    mounts=specs.parse_mounts(mounts) if mounts else [],
                )
            ],
        )
    except NxdError as e:
        raise ComponentError(str(e)) from None


class ComponentError(NxdError, ComponentValidationException):
    """A user error in the component's arguments: an :class:`NxdError` that ``torchx run`` reports
    as its component error (one line, no traceback)."""


class PulledImageRole(specs.Role):
    """A role whose image the scheduler runs: every scheduler but ``local_cwd`` (which runs in the
    current directory and ignores the image) pulls it or uses it as its working directory, so there
    the ``--image`` placeholder is refused when TorchX prepares the request (``torchx run``, with
    ``--dryrun`` too)."""

    def pre_proc(self, scheduler: str, dryrun_info: specs.AppDryRunInfo) -> specs.AppDryRunInfo:  # type: ignore[type-arg]
        if scheduler not in IMAGE_IGNORED_BY:
            try:
                check_image(self.image)
            except NxdError as e:
                raise ComponentError(f"{e}; TorchX's {scheduler} scheduler uses the image, only local_cwd "
                                     "ignores it") from None
        return dryrun_info


def _recipe_env(path: str, overrides: list[str], layout: NodeLayout, accelerator: str, efa: int) -> dict[str, str]:
    """Check the layout against the recipe and return its environment, where the recipe is readable here."""
    if not Path(path).is_file():
        return job_env(None, accelerator, efa)
    # as under torchrun (nxd_finetune.cli): the world is parallel.nproc unless an override sets it
    given = any(o.startswith("parallel.nproc=") for o in overrides)
    recipe = load_recipe(path, [*([] if given else [f"parallel.nproc={layout.world_size}"]), *overrides])
    if recipe.parallel.nproc != layout.world_size:
        raise NxdError(f"parallel.nproc={recipe.parallel.nproc} but the job has {layout.nnodes} node(s) x "
                       f"{layout.nproc_per_node} process(es) = {layout.world_size}")
    return job_env(recipe, accelerator, efa)


def _quote(arg: str) -> str:
    """Shell-quote ``arg`` for ``bash -c`` but keep ``$`` references (TorchX macros, the rank-0 host)."""
    import shlex

    return arg if "$" in arg and not any(c in arg for c in " '\"") else shlex.quote(arg)

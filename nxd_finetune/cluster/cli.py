"""``nxd-finetune k8s``: write the Kubernetes manifests of a recipe (:mod:`.k8s`).

Mounted on the main app by :func:`nxd_finetune.cli._mount_subcommands`; only typer at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from nxd_finetune.cluster.k8s import PodSettings
    from nxd_finetune.recipe import Recipe

k8s_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                      rich_markup_mode="markdown")

RecipeArg = Annotated[Path, typer.Argument(help="YAML recipe file (read here to check the layout).",
                                           show_default=False)]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="Overrides key.path=value, passed on to the pods.",
                                                          show_default=False)]
NodeRangeOpt = Annotated[str, typer.Option(
    "--nodes", metavar="N|MIN:MAX", help="Nodes (pods); processes per node = parallel.nproc / nodes. MIN:MAX: an "
                                         "elastic job on MIN to MAX nodes (parallel.nproc is the world at MAX).")]
OneNodeCountOpt = Annotated[str, typer.Option(
    "--nodes", metavar="N", help="Nodes; processes per node = parallel.nproc / nodes (one count: the Trainer API has "
                                 "no elastic policy for MIN:MAX).")]
ImageOpt = Annotated[str, typer.Option(
    "--image", help="Container image your cluster pulls (built from docker/ and pushed); the default is a "
                    "placeholder to replace.")]
AcceleratorOpt = Annotated[str, typer.Option("--accelerator", help="neuron, gpu or cpu.")]
EfaOpt = Annotated[int, typer.Option("--efa", min=0, help="EFA interfaces per pod (8 on trn1.32xlarge).")]
InstanceOpt = Annotated[str | None, typer.Option("--instance-type",
                                                 help="nodeSelector instance type, e.g. trn1.32xlarge.")]
PvcOpt = Annotated[str | None, typer.Option("--pvc",
                                            help="PersistentVolumeClaim mounted in every pod (FSx for Lustre).")]
MountOpt = Annotated[str, typer.Option("--mount-path", help="Where the claim is mounted.")]
CpuOpt = Annotated[str | None, typer.Option("--cpu", help="CPU request and limit per pod (e.g. 120).")]
MemOpt = Annotated[str | None, typer.Option("--memory", help="Memory request and limit per pod (e.g. 480Gi).")]
NamespaceOpt = Annotated[str, typer.Option("--namespace", help="Kubernetes namespace.")]
NameOpt = Annotated[str, typer.Option("--name", help="Job name (lowercase letters, digits, '-').")]
RecipePathOpt = Annotated[str | None, typer.Option(
    "--recipe-path", help="The recipe's path inside the pods (default: RECIPE as given).")]
OutOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Write the YAML here instead of stdout.")]
RestartsOpt = Annotated[int, typer.Option("--max-restarts", min=0,
                                          help="torch elastic restarts (resume from the newest checkpoint).")]
EnvOpt = Annotated[list[str] | None, typer.Option("--env", metavar="KEY=VALUE",
                                                  help="An environment variable of every pod (repeatable).")]
ServiceAccountOpt = Annotated[str | None, typer.Option(
    "--service-account", help="serviceAccountName of the pods (e.g. one with an IAM role for S3).")]


def _load(recipe: Path, overrides: list[str] | None, recipe_path: str) -> Recipe:
    """The recipe as the pods read it: its relative paths against ``recipe_path``'s directory there."""
    from nxd_finetune.cluster.volume import pod_recipe_base
    from nxd_finetune.recipe import load_recipe

    return load_recipe(recipe, overrides or [], base_dir=pod_recipe_base(recipe_path))


def _pod(image: str, accelerator: str, efa: int, instance_type: str | None, pvc: str | None, mount_path: str,
         cpu: str | None, memory: str | None, namespace: str, env: list[str] | None,
         service_account: str | None) -> PodSettings:
    from nxd_finetune.cluster.k8s import PodSettings, parse_env

    return PodSettings(image=image, accelerator=accelerator, efa=efa, instance_type=instance_type, pvc=pvc,
                       mount_path=mount_path, cpu=cpu, memory=memory, namespace=namespace,
                       env=parse_env(env or []), service_account=service_account)


def _write(text: str, output: Path | None) -> None:
    """The manifest on stdout, or into ``output`` (beside it, then renamed: a failed write leaves an
    existing file whole; an unwritable path is one line)."""
    if output is None:
        typer.echo(text, nl=False)
    else:
        from nxd_finetune.storage.atomic import publish_file, write_error

        try:
            publish_file(output, text.encode())
        except OSError as e:
            raise write_error(e, output) from None
        typer.echo(f"wrote {output}", err=True)


@k8s_app.command("pytorchjob")
def pytorchjob_cmd(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    nodes: NodeRangeOpt = "1",
    image: ImageOpt = "REGISTRY/nxd-finetune:neuron",  # spec.IMAGE_PLACEHOLDER (typer reads the default here)
    accelerator: AcceleratorOpt = "neuron",
    efa: EfaOpt = 0,
    instance_type: InstanceOpt = None,
    pvc: PvcOpt = None,
    mount_path: MountOpt = "/fsx",
    cpu: CpuOpt = None,
    memory: MemOpt = None,
    namespace: NamespaceOpt = "default",
    name: NameOpt = "nxd-finetune",
    max_restarts: RestartsOpt = 0,
    recipe_path: RecipePathOpt = None,
    env: EnvOpt = None,
    service_account: ServiceAccountOpt = None,
    output: OutOpt = None,
) -> None:
    """Write a Kubeflow `PyTorchJob` (training operator) that trains RECIPE on `--nodes` pods."""
    from nxd_finetune.cluster.k8s import pytorchjob, to_yaml
    from nxd_finetune.cluster.spec import parse_nodes

    in_pods = recipe_path or str(recipe)
    loaded = _load(recipe, overrides, in_pods)
    pod = _pod(image, accelerator, efa, instance_type, pvc, mount_path, cpu, memory, namespace, env,
               service_account)
    low, high = parse_nodes(nodes)
    doc = pytorchjob(loaded, in_pods, overrides or [], pod, nodes=high, name=name, max_restarts=max_restarts,
                     min_nodes=low)
    _write(to_yaml(doc), output)


@k8s_app.command("precompile-job")
def precompile_job_cmd(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    nodes: NodeRangeOpt = "1",
    image: ImageOpt = "REGISTRY/nxd-finetune:neuron",  # spec.IMAGE_PLACEHOLDER (typer reads the default here)
    accelerator: AcceleratorOpt = "neuron",
    efa: EfaOpt = 0,
    instance_type: InstanceOpt = None,
    pvc: PvcOpt = None,
    mount_path: MountOpt = "/fsx",
    cpu: CpuOpt = None,
    memory: MemOpt = None,
    namespace: NamespaceOpt = "default",
    name: NameOpt = "nxd-finetune-precompile",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps to trace.")] = 5,
    recipe_path: RecipePathOpt = None,
    env: EnvOpt = None,
    service_account: ServiceAccountOpt = None,
    output: OutOpt = None,
) -> None:
    """Write the job that fills the Neuron compile cache (on `--pvc`) with the training job's graphs.

    Same recipe, overrides and `--nodes` as `k8s pytorchjob`: the exact training layout. One node: a
    `Job` running `nxd-finetune precompile`; several: a `PyTorchJob` running `neuron_parallel_compile
    torchrun ...` on as many pods. `--nodes MIN:MAX` (an elastic training job): one such job per node
    count, `NAME-<n>n`, labelled `nxd-finetune/nodes=<n>` (the layout, dp included, differs per count)."""
    from nxd_finetune.cluster.k8s import precompile_jobs, to_yaml
    from nxd_finetune.cluster.spec import parse_nodes

    in_pods = recipe_path or str(recipe)
    loaded = _load(recipe, overrides, in_pods)
    pod = _pod(image, accelerator, efa, instance_type, pvc, mount_path, cpu, memory, namespace, env,
               service_account)
    low, high = parse_nodes(nodes)
    docs = precompile_jobs(loaded, in_pods, overrides or [], pod, nodes=high, name=name, steps=steps, min_nodes=low)
    _write(to_yaml(*docs), output)


@k8s_app.command("trainjob")
def trainjob_cmd(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    nodes: OneNodeCountOpt = "1",
    image: ImageOpt = "REGISTRY/nxd-finetune:neuron",  # spec.IMAGE_PLACEHOLDER
    accelerator: AcceleratorOpt = "neuron",
    efa: EfaOpt = 0,
    instance_type: InstanceOpt = None,
    pvc: PvcOpt = None,
    mount_path: MountOpt = "/fsx",
    cpu: CpuOpt = None,
    memory: MemOpt = None,
    namespace: NamespaceOpt = "default",
    name: NameOpt = "nxd-finetune",
    max_restarts: RestartsOpt = 0,
    recipe_path: RecipePathOpt = None,
    env: EnvOpt = None,
    service_account: ServiceAccountOpt = None,
    runtime: Annotated[str, typer.Option("--runtime", help="Name of the ClusterTrainingRuntime written beside it.")]
        = "nxd-finetune-torch",
    output: OutOpt = None,
) -> None:
    """Write a Kubeflow Trainer v2 `TrainJob` that trains RECIPE on `--nodes` nodes, after the torch
    `ClusterTrainingRuntime` it uses (apply that once per cluster). Options as `pytorchjob`'s (typer
    needs each command's own signature); no `--nodes MIN:MAX`: the Trainer API has no elastic policy."""
    from nxd_finetune.cluster.k8s import to_yaml
    from nxd_finetune.cluster.spec import parse_nodes
    from nxd_finetune.cluster.trainjob import cluster_training_runtime, trainjob

    in_pods = recipe_path or str(recipe)
    loaded = _load(recipe, overrides, in_pods)
    pod = _pod(image, accelerator, efa, instance_type, pvc, mount_path, cpu, memory, namespace, env,
               service_account)
    low, high = parse_nodes(nodes)
    job = trainjob(loaded, in_pods, overrides or [], pod, nodes=high, name=name, max_restarts=max_restarts,
                   runtime=runtime, min_nodes=low)
    _write(to_yaml(cluster_training_runtime(pod.image, runtime), job), output)

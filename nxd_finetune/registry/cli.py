"""``nxd-finetune adapters ...``: the registry from the command line.

``adapters_app`` is a Typer sub-app mounted by the main CLI. Commands raise
:class:`~nxd_finetune.errors.NxdError` with one line for every user error; the main ``cli.main()``
prints ``error: ...`` and exits 2. Heavy imports (the registry, boto3, rich) happen inside commands.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

adapters_app = typer.Typer(
    name="adapters",
    help="Push, pull, list, show, tag, remove and gc adapters in a registry (local directory or s3://bucket/prefix).",
    no_args_is_help=True,
    add_completion=False,
)

_LEFT_SHOWN = 20  # gc lists at most this many files it leaves alone, then counts the rest
_REF_HELP = "REGISTRY/NAME[:VERSION|@TAG], e.g. s3://team-adapters/support-bot:3 or ./reg/support-bot@prod"


def _console():
    from rich.console import Console

    return Console()


def _say(message: str, console=None) -> None:
    """One status line, never wrapped (scripts grep it)."""
    (console or _console()).print(message, soft_wrap=True, highlight=False, markup=False)


def _size(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x} B"


@adapters_app.command("push")
def push_cmd(
    src: Annotated[Path, typer.Argument(help="adapter directory (adapter_config.json + adapter_model.safetensors)")],
    ref: Annotated[str, typer.Argument(help="REGISTRY/NAME, e.g. s3://team-adapters/support-bot")],
    tag: Annotated[list[str] | None, typer.Option("--tag", "-t", help="tag the new version (repeatable)")] = None,
) -> None:
    """Publish an adapter directory as the next version of NAME."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn

    from nxd_finetune.registry import api

    console = _console()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(fname: str, n: int) -> None:
            if fname not in tasks:
                tasks[fname] = bar.add_task(fname, total=(src / fname).stat().st_size)
            bar.advance(tasks[fname], n)

        v = api.push(src, ref, tags=tag or (), progress=progress)
    tags = f" (tags: {', '.join(v.tags)})" if v.tags else ""
    if v.reused:
        _say(f"unchanged: identical to {v.ref}{tags}", console)
    else:
        _say(f"pushed {v.ref}{tags}", console)


@adapters_app.command("pull")
def pull_cmd(
    ref: Annotated[str, typer.Argument(help=_REF_HELP)],
    dest: Annotated[Path, typer.Argument(help="directory to create (must not exist, or be empty)")],
) -> None:
    """Download a version into DEST, verifying every file against its manifest."""
    from nxd_finetune.registry import api

    v = api.pull(ref, dest)
    _say(f"pulled {v.ref} -> {dest}")


@adapters_app.command("ls")
def ls_cmd(
    registry: Annotated[str, typer.Argument(help="registry root: ./reg, s3://bucket[/prefix]")],
    name: Annotated[str | None, typer.Argument(help="list the versions of this adapter")] = None,
) -> None:
    """List adapter names in REGISTRY, or the versions of NAME."""
    from rich.table import Table

    from nxd_finetune.registry import core

    reg = core.open_registry(registry)
    reg.storage.check_root()
    console = _console()
    if name is None:
        names = reg.list_names()
        if not names:
            _say(f"no adapters in {reg.uri}", console)
            return
        table = Table("name", "versions", "latest", "tags", title=reg.uri)
        problems = []
        for n in names:
            versions = reg.versions(n)
            tags, bad = reg.read_tags(n)
            problems += bad
            tag_text = ", ".join(f"{t}->{v}" for t, v in sorted(tags.items()))
            table.add_row(n, str(len(versions)), str(versions[-1]) if versions else "-", tag_text)
        console.print(table)
        for line in problems:
            _say(f"warning: {line}", console)
        return
    listed = reg.list_versions(name)
    if not listed:
        _say(f"no versions of {name!r} in {reg.uri}", console)
        return
    table = Table("version", "created", "size", "base model", "tags", title=f"{reg.uri.rstrip('/')}/{name}")
    latest = listed[-1].version
    for v in listed:
        size = sum(f["size"] for f in v.manifest["files"].values())
        tag_names = list(v.tags) + (["latest"] if v.version == latest else [])
        base = v.manifest.get("base_model") or {}
        table.add_row(
            str(v.version),
            str(v.manifest.get("created", "")),
            _size(size),
            str(base.get("name_or_path") or "-"),
            ", ".join(tag_names),
        )
    console.print(table)
    for line in reg.read_tags(name)[1]:
        _say(f"warning: {line}", console)


@adapters_app.command("show")
def show_cmd(ref: Annotated[str, typer.Argument(help=_REF_HELP)]) -> None:
    """Print the manifest of a version (JSON) after a line naming it."""
    import json

    from nxd_finetune.registry import api

    v = api.show(ref)
    console = _console()
    tags = f"  tags: {', '.join(v.tags)}" if v.tags else ""
    _say(f"{v.ref}{tags}", console)
    if (line := _objective_line(v.manifest)) is not None:
        _say(line, console)
    console.print_json(json.dumps(v.manifest))


def _objective_line(manifest: Mapping[str, object]) -> str | None:
    """``objective: dpo (loss sigmoid)  reference: init_from:...`` from what the adapter records
    (the manifest's ``objective``), else the objective its recipe names; None when neither says."""
    found = manifest.get("objective")
    if isinstance(found, Mapping) and found.get("name"):
        loss = f" (loss {found['loss_type']})" if found.get("loss_type") else ""
        return f"objective: {found['name']}{loss}  reference: {found.get('reference') or 'none'}"
    recipe = manifest.get("recipe")
    name = recipe.get("objective") if isinstance(recipe, Mapping) else None
    return f"objective: {name}" if name else None


@adapters_app.command("rm")
def rm_cmd(
    ref: Annotated[str, typer.Argument(help="REGISTRY/NAME:VERSION or REGISTRY/NAME@TAG")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
) -> None:
    """Remove one version (tags pointing to it are dropped)."""
    from nxd_finetune.errors import NxdError
    from nxd_finetune.registry import core
    from nxd_finetune.registry.ref import parse_ref

    r = parse_ref(ref)
    reg = core.open_registry(r.registry)
    if r.version is None and r.tag in (None, "latest"):
        raise NxdError(f"say which version of {r.name} to remove: NAME:VERSION or NAME@TAG")
    version = reg.resolve(r.name, r.version, r.tag)  # fail early on a bad REF or a missing version
    target = f"{reg.uri.rstrip('/')}/{r.name}:{version}"  # a damaged version (bad manifest) included
    if not yes:
        if not sys.stdin.isatty():
            raise NxdError(f"refusing to remove {target} without confirmation: pass --yes")
        if not typer.confirm(f"remove {target}?", default=False):
            raise typer.Exit(1)
    v = reg.remove(r.name, version)
    dropped = f" (dropped tags: {', '.join(v.tags)})" if v.tags else ""
    _say(f"removed {v.ref}{dropped}")


@adapters_app.command("tag")
def tag_cmd(
    ref: Annotated[str, typer.Argument(help=_REF_HELP)],
    tag: Annotated[str, typer.Argument(help="tag to set or move, e.g. prod")],
) -> None:
    """Point TAG at the version REF names (moves the tag if it exists)."""
    from nxd_finetune.registry import api

    v = api.tag(ref, tag)
    _say(f"tagged {v.ref} as {tag}")


@adapters_app.command("gc")
def gc_cmd(
    registry: Annotated[str, typer.Argument(help="registry root: ./reg, s3://bucket[/prefix]")],
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="list what would be removed; change nothing")] \
        = False,
    adopt: Annotated[bool, typer.Option("--adopt", help="mark REGISTRY as a registry root first (one written by "
                                        "an earlier release, which has no marker yet)")] = False,
) -> None:
    """Remove what killed pushes left: dead claims, unpublished files, temp files, incomplete S3 uploads.

    Only on a registry root (marked by its pushes); only what a push or rm of this registry wrote.
    A version a live push is still writing is left alone, published versions are never touched;
    damaged versions are reported (remove them with `adapters rm REF:VERSION --yes`).
    """
    from nxd_finetune.registry import core
    from nxd_finetune.registry.gc import collect
    from nxd_finetune.registry.layout import MARKER

    console = _console()
    report = collect(core.open_registry(registry), dry_run=dry_run, adopt=adopt)
    if report.adopted:
        _say(f"{'would mark' if dry_run else 'marked'} {report.registry} as a registry ({MARKER})", console)
    verb = "would remove" if dry_run else "removed"
    for g in report.removed:
        size = f" ({_size(g.size)})" if g.size is not None else ""
        _say(f"{verb} {g.what}: {g.key}{size}", console)
    for ref, why in report.damaged:
        rm = f"nxd-finetune adapters rm {report.registry.rstrip('/')}/{ref} --yes"
        _say(f"damaged {ref}: {why}; remove it with: {rm}", console)
    for ref in report.busy:
        _say(f"skipped {ref}: a live push is writing it", console)
    for key in report.left[:_LEFT_SHOWN]:
        _say(f"left alone {key}: no push of this registry wrote it", console)
    if len(report.left) > _LEFT_SHOWN:
        _say(f"left alone {len(report.left) - _LEFT_SHOWN} more files no push of this registry wrote", console)
    for key in report.kept:
        n = sum(k.startswith(f"{key}/") for k in report.left)
        _say(f"{'would keep' if dry_run else 'kept'} {key}/: no manifest, not a version, but it holds {n} "
             f"file{'s' * (n != 1)} no push of this registry wrote (left alone above); remove "
             f"{'them' if n != 1 else 'it'} to have the directory go", console)
    total = f" ({_size(report.bytes)})" if report.bytes else ""
    summary = f"{verb} {len(report.removed)} object{'s' * (len(report.removed) != 1)}{total}" if report.removed \
        else "nothing to remove"
    damaged = f"; {len(report.damaged)} damaged version{'s' * (len(report.damaged) != 1)}" if report.damaged else ""
    _say(f"gc {report.registry}: {summary}{damaged}", console)

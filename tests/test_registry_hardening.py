"""Registry hardening (issue 30): gc deletes only what a push of this registry left, push refuses
links leaving the adapter directory and tensors ``merge`` refuses, and bad registry input is one
``error:`` line with exit 2. Local directory and moto's S3 server where the storage matters."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nxd_finetune.cli import main
from nxd_finetune.errors import AdapterError
from nxd_finetune.lora.io import read_adapter
from nxd_finetune.registry import Registry, RegistryError, open_registry, pull, push
from nxd_finetune.registry.cli import adapters_app
from nxd_finetune.registry.gc import collect
from nxd_finetune.registry.layout import MARKER
from nxd_finetune.registry.publish import publish_run
from nxd_finetune.storage import StorageError, open_storage
from tests.registry_helpers import make_adapter, same_files

LONG = "x" * 300  # one path component over every common file system's 255-byte limit


def cli_error(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """Run the CLI; assert it ended in one ``error:`` line and exit 2; return that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert info.value.code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


# -- gc: only in a registry, only what a push left ------------------------------------------------


def test_gc_refuses_a_folder_above_a_registry_and_deletes_nothing(reg_uri, tmp_path, capsys):
    """The reported case: a registry at ROOT/team, photos beside it, gc run on ROOT."""
    src = make_adapter(tmp_path / "a")
    v = push(src, f"{reg_uri}/team/2024")
    root = open_registry(reg_uri)
    root.storage.put_bytes("photos/2023/a.jpg", b"x")
    before = root.storage.list("")
    line = cli_error(capsys, "adapters", "gc", reg_uri)
    assert "is not an adapter registry" in line
    with pytest.raises(RegistryError, match="not an adapter registry"):
        collect(root, dry_run=True)
    assert root.storage.list("") == before
    pull(v.ref, tmp_path / "back")
    assert same_files(src, tmp_path / "back")


def test_gc_in_a_registry_leaves_what_no_push_wrote(reg_uri, tmp_path):
    """Inside a marked registry, version-shaped folders of other data, a registry nested below it
    and files put into a published version are all left alone (and reported)."""
    team = f"{reg_uri}/team"
    v = push(make_adapter(tmp_path / "a"), f"{team}/bot")
    nested = push(make_adapter(tmp_path / "n", seed=1), f"{team}/2024/5")  # registry team/2024, name "5"
    reg = open_registry(team)
    assert reg.storage.exists(MARKER) and open_registry(f"{team}/2024").storage.exists(MARKER)
    reg.storage.put_bytes("photos/2023/a.jpg", b"x")
    reg.storage.put_bytes("photos/2023/adapter_config.json", b"{}")  # a push's file name, no claim
    reg.storage.put_bytes("bot/1/notes.md", b"mine")
    before = reg.storage.list("")
    report = collect(reg)
    assert report.removed == [] and report.busy == [] and report.damaged == []
    assert sorted(report.left) == ["bot/1/notes.md", "photos/2023/a.jpg", "photos/2023/adapter_config.json"]
    assert reg.storage.list("") == before
    for ref, src in ((v.ref, "a"), (nested.ref, "n")):
        pull(ref, tmp_path / f"back-{src}")
        assert same_files(tmp_path / src, tmp_path / f"back-{src}")
    r = CliRunner().invoke(adapters_app, ["gc", team])
    assert r.exit_code == 0, r.output
    assert "left alone photos/2023/a.jpg: no push of this registry wrote it" in r.output
    assert f"gc {reg.uri}: nothing to remove" in r.output


def test_gc_removes_the_files_of_an_interrupted_rm(reg_uri, tmp_path):
    """``rm`` retires the number, deletes the manifest, then the files: killed in between, what it
    left is removed by gc (the number is retired, so no push can be writing there)."""
    uri = f"{reg_uri}/bot"
    push(make_adapter(tmp_path / "a"), uri)
    v2 = push(make_adapter(tmp_path / "b", seed=1), uri)
    reg = open_registry(reg_uri)
    reg.storage.put_bytes("bot/retired/1.json", b'{"version": 1}')
    reg.storage.delete("bot/1/manifest.json")  # rm killed here
    report = collect(reg)
    assert sorted(g.key for g in report.removed) == ["bot/1/adapter_config.json", "bot/1/adapter_model.safetensors"]
    assert reg.storage.list("bot/1/") == [] and reg.versions("bot") == [2]
    pull(v2.ref, tmp_path / "back")
    assert same_files(tmp_path / "b", tmp_path / "back")


def test_gc_adopts_an_unmarked_registry_only_when_asked(reg_uri, tmp_path, capsys):
    """A registry an earlier release wrote has no marker: gc says how to mark it and deletes
    nothing; ``--adopt`` marks it and cleans it."""
    push(make_adapter(tmp_path / "a"), f"{reg_uri}/bot")
    reg = open_registry(reg_uri)
    reg.storage.delete(MARKER)
    dead = {"host": "elsewhere", "pid": 1, "created": time.time() - 10 * 86400}
    reg.storage.put_bytes("bot/2/.claim-1.json", json.dumps(dead).encode())
    reg.storage.put_bytes("bot/2/adapter_config.json", b"{}")
    before = reg.storage.list("")
    line = cli_error(capsys, "adapters", "gc", reg_uri)
    assert "no registry marker" in line and f"adapters gc {reg.uri} --adopt" in line
    r = CliRunner().invoke(adapters_app, ["gc", reg_uri, "--adopt", "--dry-run"])
    assert r.exit_code == 0 and "would mark" in r.output and "would remove 2 objects" in r.output, r.output
    assert reg.storage.list("") == before
    r = CliRunner().invoke(adapters_app, ["gc", reg_uri, "--adopt"])
    assert r.exit_code == 0 and f"marked {reg.uri}" in r.output and "removed 2 objects" in r.output, r.output
    assert reg.storage.exists(MARKER) and reg.storage.list("bot/2/") == []
    assert collect(reg).removed == []  # marked now: no --adopt needed


def test_a_claim_on_this_machine_lives_exactly_as_long_as_its_process(tmp_path):
    """Same host and PID namespace: the TTL plays no part; a PID that runs another process (started
    at another time: the PID was reused) does not keep a dead push's claim alive."""
    reg = Registry(str(tmp_path / "reg"), claim_ttl=0.0)
    push(make_adapter(tmp_path / "a"), f"{reg.uri}/bot")
    live = reg.claims._holder("live")
    live["created"] -= 10 * 86400
    reused = {**live, "started": live["started"] - 1}
    reg.storage.put_bytes("bot/2/.claim-1.json", json.dumps(live).encode())
    reg.storage.put_bytes("bot/3/.claim-1.json", json.dumps(reused).encode())
    report = collect(reg)
    assert report.busy == ["bot:2"] and [g.key for g in report.removed] == ["bot/3/.claim-1.json"]


# -- push: links and tensors -----------------------------------------------------------------------


def test_push_refuses_links_that_leave_the_adapter_dir(reg_uri, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("aws_secret_access_key = hunter2\n")
    d = make_adapter(tmp_path / "a")
    (d / "notes.txt").symlink_to(Path("..") / "secret.txt")
    line = cli_error(capsys, "adapters", "push", d, f"{reg_uri}/bot")
    assert "notes.txt -> ../secret.txt" in line
    with pytest.raises(RegistryError, match="links to files outside"):
        publish_run(d, f"{reg_uri}/bot", recipe_dict=None, metrics=None, parallel=None, lineage=None)
    (d / "notes.txt").unlink()
    (d / "notes.txt").symlink_to("missing.txt")  # dangling
    with pytest.raises(RegistryError, match="missing.txt"):
        push(d, f"{reg_uri}/bot")
    assert open_registry(reg_uri).storage.list("") == []  # nothing stored, not even the marker
    (d / "notes.txt").unlink()
    (d / "notes.txt").write_text("plain\n")
    (d / "README.md").symlink_to("notes.txt")  # a link inside the directory is followed
    v = push(d, f"{reg_uri}/bot")
    assert "aws_secret" not in json.dumps(v.manifest)
    pull(v.ref, tmp_path / "back")
    assert (tmp_path / "back" / "README.md").read_text() == "plain\n"


def _overlap(d: Path) -> Path:
    """Rewrite the adapter's safetensors so its two tensors share their bytes (same offsets)."""
    path = d / "adapter_model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    keys = sorted(k for k in header if k != "__metadata__")
    first = header[keys[0]]["data_offsets"]
    header[keys[1]]["data_offsets"] = list(first)  # both tensors are 128 floats
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:][: first[1] - first[0]])
    return d


def test_push_refuses_overlapping_tensors_as_merge_does(reg_uri, tmp_path, capsys):
    d = _overlap(make_adapter(tmp_path / "a"))
    with pytest.raises(AdapterError, match="invalid offset"):
        read_adapter(d)  # what merge and lora.init_from read it with
    line = cli_error(capsys, "adapters", "push", d, f"{reg_uri}/bot")
    assert "invalid offset" in line and str(d) in line
    assert open_registry(reg_uri).storage.list("") == []


# -- bad registry input: one line, exit 2 ---------------------------------------------------------


def test_bad_version_digits_long_names_and_files_in_the_way(tmp_path, capsys):
    reg = tmp_path / "reg"
    src = make_adapter(tmp_path / "a")
    push(src, f"{reg}/bot")
    assert "invalid version '²'" in cli_error(capsys, "adapters", "pull", f"{reg}/bot:²", tmp_path / "out")
    assert "invalid version" in cli_error(capsys, "adapters", "show", f"{reg}/bot:{'9' * 30}")
    assert "File name too long" in cli_error(capsys, "adapters", "push", src, f"{reg}/{LONG}/bot")
    assert "File name too long" in cli_error(capsys, "adapters", "pull", f"{reg}/bot", tmp_path / LONG)
    assert "File name too long" in cli_error(capsys, "adapters", "ls", f"{reg}/{LONG}")
    (tmp_path / "file.txt").write_text("x")
    line = cli_error(capsys, "adapters", "push", src, tmp_path / "file.txt" / "bot")
    assert "file.txt is a file, not a directory" in line
    for root in (tmp_path / "file.txt", tmp_path / "file.txt" / "bot"):  # ls: an error, not "no adapters"
        assert "file.txt is a file, not a directory" in cli_error(capsys, "adapters", "ls", root)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "file.txt", "reg"]  # nothing half-made


def test_a_malformed_alias_is_one_line_and_ls_goes_on(reg_uri, tmp_path, capsys):
    uri = f"{reg_uri}/bot"
    push(make_adapter(tmp_path / "a"), uri, tags=["good"])
    push(make_adapter(tmp_path / "b", seed=1), f"{reg_uri}/other")
    reg = open_registry(reg_uri)
    reg.storage.put_bytes("bot/aliases/prod.json", b'{"version": 1e999}')
    reg.storage.put_bytes("bot/aliases/str.json", b'{"version": "1"}')
    for argv in (["pull", f"{uri}@prod", tmp_path / "out"], ["show", f"{uri}@prod"], ["rm", f"{uri}@prod", "--yes"]):
        line = cli_error(capsys, "adapters", *argv)
        assert "alias 'prod' is malformed" in line and "integer" in line, line
    assert reg.list_tags("bot") == {"good": 1}
    r = CliRunner().invoke(adapters_app, ["ls", reg_uri])
    out = r.output
    assert r.exit_code == 0, out
    assert "good->1" in out and "other" in out, out  # every adapter listed, the good tag shown
    assert "warning: " in out and "bot/aliases/prod.json is malformed" in out, out
    assert "bot/aliases/str.json is malformed" in out, out
    r = CliRunner().invoke(adapters_app, ["ls", reg_uri, "bot"])
    assert r.exit_code == 0 and "good" in r.output and "prod.json is malformed" in r.output, r.output
    r = CliRunner().invoke(adapters_app, ["rm", f"{uri}:1", "--yes"])  # rm goes past it too
    assert r.exit_code == 0 and "dropped tags: good" in r.output, r.output


def test_local_storage_errors_are_one_line(tmp_path):
    """The storage seam itself: the system's refusals are StorageErrors naming the path."""
    s = open_storage(tmp_path / LONG)
    for call in (lambda: s.put_bytes("k", b"x"), lambda: s.exists("k"), lambda: s.get_bytes("k")):
        with pytest.raises(StorageError, match="File name too long") as e:
            call()
        assert "\n" not in str(e.value)
    (tmp_path / "f").write_text("x")
    with pytest.raises(StorageError, match="is a file, not a directory"):
        open_storage(tmp_path / "f" / "reg").put_bytes("k", b"x")
    assert not os.path.exists(tmp_path / "f" / "reg")

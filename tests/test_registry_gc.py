"""Registry leftovers and races with real processes, on a local directory and on moto's S3 server:
``adapters gc``, identical pushes racing each other, ``tag`` racing ``rm``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from typer.testing import CliRunner

from nxd_finetune.registry import Registry, open_registry, pull, push
from nxd_finetune.registry.cli import adapters_app
from nxd_finetune.registry.gc import collect
from tests.registry_helpers import killed_push, make_adapter, s3_client, same_files, worker_env
from tests.s3_server import REGISTRY_BUCKET as BUCKET

MIB = 1 << 20

def _uploads(endpoint: str, uri: str) -> list[str]:
    prefix = uri[len(f"s3://{BUCKET}/"):]
    resp = s3_client(endpoint).list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
    return [u["Key"] for u in resp.get("Uploads", [])]


def test_gc_removes_what_killed_pushes_left(reg_uri, tmp_path, request):
    reg = open_registry(reg_uri)
    src = make_adapter(tmp_path / "big", seed=3, pad_bytes=11 * MIB)
    killed_push(reg_uri, src, tmp_path)
    left = reg.storage.leftovers("")
    assert [x.key for x in left] == ["bot/1/adapter_model.safetensors"]  # temp file / incomplete upload
    assert "bot/1/.claim-1.json" in reg.storage.list("")
    if reg_uri.startswith("s3://"):
        assert _uploads(request.getfixturevalue("s3_endpoint"), reg_uri) != []

    # what else can linger: a published version with a dead push's claim (and a file someone put
    # there, which gc leaves alone), a content lock of a dead push, a damaged version, and a version
    # a live push is writing
    good = push(make_adapter(tmp_path / "good", seed=4), f"{reg_uri}/done")
    dead = json.dumps({"host": "elsewhere", "pid": 1, "created": time.time() - 10 * 86400}).encode()
    reg.storage.put_bytes("done/1/.claim-7.json", dead)
    reg.storage.put_bytes("done/1/stray.bin", b"x" * 100)
    reg.storage.put_bytes("done/pushing/0123456789abcdef0123456789abcdef/.claim-1.json", dead)
    push(make_adapter(tmp_path / "dmg", seed=5), f"{reg_uri}/dmg")
    reg.storage.put_bytes("dmg/1/manifest.json", b'{"trunc')
    live = reg.claims._holder("live-push")  # this process: alive
    reg.storage.put_bytes("live/1/.claim-1.json", json.dumps(live).encode())
    reg.storage.put_bytes("live/1/adapter_model.safetensors", b"partial")
    before = reg.storage.list("")

    dry = collect(reg, dry_run=True)
    assert reg.storage.list("") == before and len(reg.storage.leftovers("")) == 1  # nothing changed
    report = collect(reg)
    assert sorted(g.key for g in report.removed) == sorted(g.key for g in dry.removed)
    removed = {g.key for g in report.removed}
    assert {"bot/1/.claim-1.json", "done/1/.claim-7.json",
            "done/pushing/0123456789abcdef0123456789abcdef/.claim-1.json"} <= removed
    assert report.left == ["done/1/stray.bin"] and reg.storage.exists("done/1/stray.bin")
    assert [ref for ref, _ in report.damaged] == ["dmg:1"] and report.busy == ["live:1"]
    assert reg.storage.leftovers("") == []
    assert reg.storage.list("bot/") == [] and reg.storage.list("done/pushing/") == []
    assert reg.storage.list("live/") == ["live/1/.claim-1.json", "live/1/adapter_model.safetensors"]
    assert reg.storage.exists("dmg/1/manifest.json")
    if reg_uri.startswith("s3://"):
        assert _uploads(request.getfixturevalue("s3_endpoint"), reg_uri) == []
    pull(good.ref, tmp_path / "back")  # the published version is intact
    assert same_files(tmp_path / "good", tmp_path / "back")
    assert collect(reg).removed == []  # a second pass finds nothing

    # from the command line: the same report, one line each, and a summary
    killed_push(reg_uri, src, tmp_path)
    r = CliRunner().invoke(adapters_app, ["gc", reg_uri, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "would remove claim of a dead push: bot/1/.claim-1.json" in r.output
    assert "damaged dmg:1:" in r.output and "skipped live:1: a live push is writing it" in r.output
    assert "left alone done/1/stray.bin: no push of this registry wrote it" in r.output
    r = CliRunner().invoke(adapters_app, ["gc", reg_uri])
    assert r.exit_code == 0, r.output  # its claim, config, weights (temp / upload) and content lock
    assert f"gc {reg.uri}: removed 4 objects" in r.output and "1 damaged version" in r.output, r.output
    assert reg.storage.list("bot/") == [] and reg.storage.leftovers("") == []


def test_a_push_taking_over_a_killed_one_cleans_its_temp_files(reg_uri, tmp_path, request):
    reg = open_registry(reg_uri)
    src = make_adapter(tmp_path / "big", seed=3, pad_bytes=11 * MIB)
    killed_push(reg_uri, src, tmp_path)
    assert len(reg.storage.leftovers("bot/1/")) == 1
    v = push(src, f"{reg_uri}/bot")
    assert v.version == 1  # the dead push's number, taken over
    assert reg.storage.leftovers("") == []  # no hidden temp file / billed upload inside the version
    if reg_uri.startswith("s3://"):
        assert _uploads(request.getfixturevalue("s3_endpoint"), reg_uri) == []


_RACE_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from nxd_finetune.errors import NxdError
    from nxd_finetune.registry import open_registry

    role, uri, go, arg = sys.argv[1:5]
    reg = open_registry(uri)
    while not Path(go).exists():
        time.sleep(0.005)
    out = []
    if role == "push":
        v = reg.push(arg, "bot")
        out.append([v.version, v.reused])
    else:
        for i in range(1, int(arg) + 1):
            try:
                if role == "tag":
                    reg.tag("bot", f"t{i}", version=i)
                else:
                    reg.remove("bot", version=i)
                out.append([i, "ok"])
            except NxdError as e:
                out.append([i, str(e)])
    print(json.dumps(out))
    """
)


def _race(tmp_path: Path, jobs: list[list[str]]) -> list[list]:
    """Start one process per job, release them together, return what each printed (JSON)."""
    script = tmp_path / "race.py"
    script.write_text(_RACE_SCRIPT)
    go = tmp_path / f"go-{time.monotonic_ns()}"
    env = worker_env(tmp_path)
    procs = [subprocess.Popen([sys.executable, str(script), job[0], job[1], str(go), *job[2:]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for job in jobs]
    time.sleep(1.0)  # let every process import and wait
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out))
    return outs


def test_identical_pushes_racing_make_one_version(reg_uri, tmp_path):
    src = make_adapter(tmp_path / "a", seed=1, pad_bytes=256 * 1024)
    outs = _race(tmp_path, [["push", reg_uri, str(src)] for _ in range(5)])
    results = [o[0] for o in outs]
    assert [v for v, _ in results] == [1] * 5
    assert sorted(reused for _, reused in results) == [False, True, True, True, True]  # one upload
    reg = open_registry(reg_uri)
    assert reg.versions("bot") == [1] and reg.storage.list("bot/pushing/") == []
    other = make_adapter(tmp_path / "b", seed=2)
    assert push(other, f"{reg_uri}/bot").version == 2  # different content: a new version as before


def test_tag_racing_rm_never_leaves_a_dangling_tag(reg_uri, tmp_path):
    n = 12
    for i in range(n):
        push(make_adapter(tmp_path / f"v{i}", seed=100 + i), f"{reg_uri}/bot")
    tagged, removed = _race(tmp_path, [["tag", reg_uri, str(n)], ["rm", reg_uri, str(n)]])
    assert [r[1] for r in removed] == ["ok"] * n  # rm always wins: every version is gone
    reg = open_registry(reg_uri)
    assert reg.versions("bot") == [] and reg.retired("bot") == list(range(1, n + 1))
    assert reg.list_tags("bot") == {}, "a tag outlived its version"
    for _i, outcome in tagged:  # a refused tag says why in one line
        assert outcome == "ok" or "removed" in outcome or "does not exist" in outcome, outcome


_SLOW_PUSH_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import nxd_finetune.registry.api as api
    from nxd_finetune.cli import main
    from nxd_finetune.registry.core import Registry, open_registry

    src, uri, uploading, go = sys.argv[1:5]
    if uri.startswith("s3://"):  # a multipart upload, paused after its first part
        api.open_registry = lambda u: open_registry(u, multipart_threshold=5 << 20, multipart_chunksize=5 << 20,
                                                    max_concurrency=1)
    push = Registry.push

    def slow_push(self, src, name, tags=(), metadata=None, progress=None):
        def slow(fname, n):
            if progress is not None:
                progress(fname, n)
            if fname.endswith(".safetensors") and not Path(go).exists():
                Path(uploading).touch()  # a long upload, still running: the parent looks now
                while not Path(go).exists():
                    time.sleep(0.02)
        return push(self, src, name, tags, metadata, slow)

    Registry.push = slow_push
    main(["adapters", "push", src, uri + "/bot"])
    """
)

_OTHER_MACHINE_GC_SCRIPT = textwrap.dedent(
    """
    import json, socket, sys
    socket.gethostname = lambda: "another-machine"  # gc run on another machine: the TTL is all it has
    from nxd_finetune.registry import Registry
    from nxd_finetune.registry.gc import collect

    report = collect(Registry(sys.argv[1], claim_ttl=0.0))
    print(json.dumps(sorted(g.key for g in report.removed)))
    """
)


def test_a_live_push_past_the_ttl_keeps_its_claim_on_its_machine(reg_uri, tmp_path, request):
    """A real second process uploading for longer than the claim TTL: on its own machine neither gc
    nor a push takes its version over while it lives; gc on another machine (where the TTL is the
    only signal) does, and the push then ends in its one line, leaving nothing behind."""
    src = make_adapter(tmp_path / "big", seed=3, pad_bytes=11 * MIB)
    uploading, go = tmp_path / "uploading", tmp_path / "go"
    (tmp_path / "slow_push.py").write_text(_SLOW_PUSH_SCRIPT)
    (tmp_path / "other_gc.py").write_text(_OTHER_MACHINE_GC_SCRIPT)
    env = worker_env(tmp_path)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "slow_push.py"), str(src), reg_uri, str(uploading),
                             str(go)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not uploading.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the push never started uploading"
            time.sleep(0.02)
        reg = Registry(reg_uri, claim_ttl=0.0)  # every claim is past this TTL
        claim = reg.storage.list("bot/1/.claim-")
        assert claim == ["bot/1/.claim-1.json"]
        assert reg.push(make_adapter(tmp_path / "other", seed=4), "bot").version == 2  # skips 1
        report = collect(reg)
        assert report.busy == ["bot:1"] and report.removed == []  # its process lives: not taken over
        assert reg.storage.list("bot/1/.claim-") == claim

        out = subprocess.run([sys.executable, str(tmp_path / "other_gc.py"), reg_uri], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        removed = json.loads(out.stdout)
        assert "bot/1/.claim-1.json" in removed and "bot/1/adapter_config.json" in removed, removed
    finally:
        go.touch()
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith("error: push of bot:1 lost its claim"), stderr
    assert reg.versions("bot") == [2]
    assert reg.storage.list("bot/1/") == [] and reg.storage.leftovers("") == []  # nothing left behind
    if reg_uri.startswith("s3://"):
        assert _uploads(request.getfixturevalue("s3_endpoint"), reg_uri) == []


def test_gc_removes_only_the_files_a_dead_push_or_rm_wrote(reg_uri, tmp_path):
    """A user's own file in an orphaned version directory (one a killed push or a killed rm left) is
    left alone, even when its name is one a push could upload: gc removes by the names the claim or
    the retired record lists, and says what it left."""
    reg = open_registry(reg_uri)
    push(make_adapter(tmp_path / "small", seed=4), f"{reg_uri}/gone")
    src = make_adapter(tmp_path / "big", seed=3, pad_bytes=11 * MIB)
    killed_push(reg_uri, src, tmp_path)
    reg.storage.put_bytes("bot/1/notes.txt", b"my notes")
    reg.storage.put_bytes("bot/1/eval.json", b"{}")
    report = collect(reg)
    removed = {g.key for g in report.removed}
    assert "bot/1/.claim-1.json" in removed and removed.isdisjoint({"bot/1/notes.txt", "bot/1/eval.json"})
    assert sorted(reg.storage.list("bot/")) == ["bot/1/eval.json", "bot/1/notes.txt"]
    assert sorted(report.left) == ["bot/1/eval.json", "bot/1/notes.txt"] and report.kept == ["bot/1"]

    # an rm killed after it retired the number and removed the manifest, before the files
    reg.storage.put_bytes("gone/1/mine.json", b"{}")

    def killed(prefix: str) -> None:
        raise KeyboardInterrupt  # the rm dies here

    reg.storage.delete_prefix = killed  # type: ignore[method-assign]
    try:
        reg.remove("gone", 1)
    except KeyboardInterrupt:
        pass
    reg = open_registry(reg_uri)
    report = collect(reg)
    assert reg.storage.list("gone/1/") == ["gone/1/mine.json"]
    assert {g.key for g in report.removed} == {"gone/1/adapter_config.json", "gone/1/adapter_model.safetensors"}
    assert "gone/1/mine.json" in report.left and reg.storage.exists("bot/1/notes.txt")
    assert report.kept == ["bot/1", "gone/1"]

    # the directory goes once nothing but a push's files is in it; gc says in one line why it keeps one
    for key in ("bot/1/eval.json", "gone/1/mine.json"):
        reg.storage.delete(key)
    killed_push(reg_uri, src, tmp_path, name="other")
    r = CliRunner().invoke(adapters_app, ["gc", reg_uri])
    assert r.exit_code == 0, r.output
    assert ("kept bot/1/: no manifest, not a version, but it holds 1 file no push of this registry wrote "
            "(left alone above); remove it to have the directory go\n") in r.output, r.output
    assert "kept other/" not in r.output and "kept gone/" not in r.output
    assert reg.storage.list("other/") == [] and reg.storage.list("gone/1/") == []
    if not reg_uri.startswith("s3://"):
        root = Path(reg_uri)
        assert not (root / "other" / "1").exists() and not (root / "gone" / "1").exists()
        assert (root / "bot" / "1").is_dir()

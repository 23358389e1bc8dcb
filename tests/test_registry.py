"""Adapter registry and storage seam, on a local directory and on a real S3 API (moto over HTTP)."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from nxd_finetune.errors import NxdError
from nxd_finetune.registry import (
    IntegrityError,
    Ref,
    Registry,
    RegistryError,
    open_registry,
    parse_ref,
    pull,
    push,
    remove,
    show,
    tag,
)
from nxd_finetune.registry.cli import adapters_app
from nxd_finetune.storage import (
    StorageBucketNotFoundError,
    StorageCredentialsError,
    StorageError,
    StorageNotFoundError,
    open_storage,
)
from tests.registry_helpers import killed_push, make_adapter, s3_client, same_files
from tests.s3_server import REGISTRY_BUCKET as BUCKET

# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture
def adapter(tmp_path):
    return make_adapter(tmp_path / "adapter", seed=0)


# -- the registry on both backends ---------------------------------------------------------------


def test_push_pull_show_ls(reg_uri, adapter, tmp_path):
    meta = {
        "recipe": {"lora": {"rank": 4}},
        "metrics": {"eval_loss": 1.25},
        "parallel": {"tp": 2, "pp": 1},
        "base_model": {"config_sha256": "f" * 64},
        "lineage": None,
    }
    v1 = push(adapter, f"{reg_uri}/support-bot", metadata=meta)
    assert (v1.version, v1.reused, v1.ref) == (1, False, f"{reg_uri}/support-bot:1")
    m = v1.manifest
    assert set(m["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    assert m["files"]["adapter_model.safetensors"]["size"] == (adapter / "adapter_model.safetensors").stat().st_size
    assert m["base_model"] == {"name_or_path": "builtin:tiny-llama", "revision": "abc123", "config_sha256": "f" * 64}
    assert m["metrics"] == {"eval_loss": 1.25} and m["parallel"] == {"tp": 2, "pp": 1}
    assert m["tool"]["name"] == "nxd-finetune" and m["created"].endswith("Z")

    v2 = push(make_adapter(tmp_path / "a2", seed=1), f"{reg_uri}/support-bot", metadata={"lineage": v1.ref})
    assert v2.version == 2 and v2.manifest["lineage"] == v1.ref
    push(adapter, f"{reg_uri}/other")

    reg = open_registry(reg_uri)
    assert reg.list_names() == ["other", "support-bot"]
    assert [v.version for v in reg.list_versions("support-bot")] == [1, 2]
    assert show(f"{reg_uri}/support-bot").version == 2
    assert show(f"{reg_uri}/support-bot@latest").version == 2
    latest = json.loads(reg.storage.get_bytes("support-bot/aliases/latest.json"))
    assert latest == {"version": 2, "manifest_sha256": reg._manifest_sha("support-bot", 2)}

    dest = tmp_path / "out" / "pulled"
    got = pull(f"{reg_uri}/support-bot:1", dest)
    assert got.version == 1 and same_files(adapter, dest)
    assert json.loads((dest / "manifest.json").read_text())["version"] == 1
    with pytest.raises(RegistryError, match="not an empty directory"):
        pull(f"{reg_uri}/support-bot:1", dest)
    with pytest.raises(RegistryError, match="does not exist"):
        pull(f"{reg_uri}/support-bot:7", tmp_path / "nope")
    with pytest.raises(RegistryError, match="no adapter 'missing'"):
        show(f"{reg_uri}/missing")


def test_idempotent_repush(reg_uri, adapter, tmp_path):
    v1 = push(adapter, f"{reg_uri}/bot")
    again = push(adapter, f"{reg_uri}/bot", tags=["stable"])
    assert (again.version, again.reused, again.tags) == (1, True, ("stable",))
    pulled = tmp_path / "pulled"
    pull(f"{reg_uri}/bot", pulled)  # has a manifest.json, which push ignores
    assert push(pulled, f"{reg_uri}/bot").reused
    assert open_registry(reg_uri).versions("bot") == [v1.version]


def test_tags_and_remove(reg_uri, tmp_path):
    for seed in range(3):
        push(make_adapter(tmp_path / f"a{seed}", seed=seed), f"{reg_uri}/bot", tags=["prod"] if seed == 0 else ())
    assert show(f"{reg_uri}/bot@prod").version == 1
    assert tag(f"{reg_uri}/bot:2", "prod").version == 2  # moves the tag
    tag(f"{reg_uri}/bot@prod", "canary")
    reg = open_registry(reg_uri)
    assert reg.list_tags("bot") == {"prod": 2, "canary": 2}
    with pytest.raises(RegistryError, match="maintained automatically"):
        tag(f"{reg_uri}/bot:1", "latest")
    with pytest.raises(RegistryError, match="has no tag 'beta'"):
        show(f"{reg_uri}/bot@beta")

    gone = remove(f"{reg_uri}/bot@prod")
    assert (gone.version, gone.tags) == (2, ("canary", "prod"))
    assert reg.versions("bot") == [1, 3] and reg.list_tags("bot") == {}
    assert reg.storage.list("bot/2/") == []
    remove(f"{reg_uri}/bot:3")
    assert show(f"{reg_uri}/bot").version == 1
    assert json.loads(reg.storage.get_bytes("bot/aliases/latest.json"))["version"] == 1
    with pytest.raises(RegistryError, match="say which version"):
        remove(f"{reg_uri}/bot")
    remove(f"{reg_uri}/bot:1")
    assert reg.list_names() == [] and not reg.storage.exists("bot/aliases/latest.json")


def test_removed_numbers_are_never_reused(reg_uri, tmp_path):
    """Removing the highest version retires its number: the next push gets a new one, so a REF to
    the removed version (lineage, a copied tag) can never name other weights."""
    for seed in range(3):
        push(make_adapter(tmp_path / f"a{seed}", seed=seed), f"{reg_uri}/bot")
    remove(f"{reg_uri}/bot:3")
    assert push(make_adapter(tmp_path / "b", seed=7), f"{reg_uri}/bot").version == 4
    remove(f"{reg_uri}/bot:4")
    remove(f"{reg_uri}/bot:1")
    reg = open_registry(reg_uri)
    assert reg.versions("bot") == [2] and reg.retired("bot") == [1, 3, 4]
    assert push(make_adapter(tmp_path / "c", seed=8), f"{reg_uri}/bot").version == 5
    with pytest.raises(RegistryError, match=r"bot:4 does not exist \(versions: 2, 5\)"):
        show(f"{reg_uri}/bot:4")


def test_tags_name_the_content_they_were_given(reg_uri, tmp_path):
    """A tag records its version's manifest sha256: pulling through a tag whose version was removed
    behind its back, or whose manifest changed, is refused with one line; tags written before
    (version only) still work; a tag of a version that is gone is not written."""
    for seed in range(2):
        push(make_adapter(tmp_path / f"a{seed}", seed=seed), f"{reg_uri}/bot")
    tag(f"{reg_uri}/bot:1", "prod")
    tag(f"{reg_uri}/bot:2", "canary")
    reg = open_registry(reg_uri)
    alias = json.loads(reg.storage.get_bytes("bot/aliases/prod.json"))
    assert alias["version"] == 1 and len(alias["manifest_sha256"]) == 64
    assert pull(f"{reg_uri}/bot@prod", tmp_path / "p1").version == 1

    manifest = json.loads(reg.storage.get_bytes("bot/1/manifest.json"))  # content changed under the tag
    reg.storage.put_bytes("bot/1/manifest.json", json.dumps({**manifest, "metrics": {"edited": 1}}).encode())
    with pytest.raises(IntegrityError, match="tag 'prod' of .* names version 1, whose manifest changed"):
        pull(f"{reg_uri}/bot@prod", tmp_path / "p2")
    assert not (tmp_path / "p2").exists()

    reg.storage.delete("bot/2/manifest.json")  # removed behind the tag's back (not through rm)
    with pytest.raises(RegistryError, match="tag 'canary' of .* names version 2, which was removed"):
        show(f"{reg_uri}/bot@canary")
    with pytest.raises(RegistryError, match="bot:2 does not exist"):
        tag(f"{reg_uri}/bot:2", "beta")
    assert "beta" not in reg.list_tags("bot")

    reg.storage.put_bytes("bot/aliases/old.json", json.dumps({"version": 1}).encode())  # an older tag
    assert show(f"{reg_uri}/bot@old").version == 1


def test_damaged_version_is_skipped_reported_and_removable(reg_uri, tmp_path):
    """A version whose manifest is truncated: ls, latest, pull and push's unchanged check skip it,
    its number is not given out again, show names it as damaged in one line, rm removes it."""
    for seed in range(3):
        push(make_adapter(tmp_path / f"a{seed}", seed=seed), f"{reg_uri}/bot")
    reg = open_registry(reg_uri)
    data = reg.storage.get_bytes("bot/3/manifest.json")
    reg.storage.put_bytes("bot/3/manifest.json", data[: len(data) // 2])
    assert [v.version for v in reg.list_versions("bot")] == [1, 2]
    assert show(f"{reg_uri}/bot").version == 2
    assert pull(f"{reg_uri}/bot", tmp_path / "latest").version == 2
    with pytest.raises(RegistryError, match=r"bot:3 is damaged \(.*\); remove it with: nxd-finetune adapters rm") as e:
        show(f"{reg_uri}/bot:3")
    assert "\n" not in str(e.value)
    assert push(make_adapter(tmp_path / "a1", seed=1), f"{reg_uri}/bot").reused  # = version 2, the latest usable
    assert push(make_adapter(tmp_path / "b", seed=9), f"{reg_uri}/bot").version == 4
    r = CliRunner().invoke(adapters_app, ["rm", f"{reg_uri}/bot:3", "--yes"])
    assert r.exit_code == 0 and "removed" in r.output and "bot:3" in r.output, r.output
    assert reg.versions("bot") == [1, 2, 4] and 3 in reg.retired("bot")


def test_push_refuses_what_run_and_merge_refuse(tmp_path):
    """An adapter ``lora.init_from`` / ``merge`` would refuse (not LoRA, DoRA) is refused at push,
    with one line naming the directory, and nothing is published."""
    reg = str(tmp_path / "reg")
    for name, change in (("ia3", {"peft_type": "IA3"}), ("dora", {"use_dora": True})):
        d = make_adapter(tmp_path / name)
        cfg = json.loads((d / "adapter_config.json").read_text())
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(RegistryError) as e:
            push(d, f"{reg}/bot")
        assert str(d) in str(e.value) and "\n" not in str(e.value)
    assert not Path(reg).exists() or open_registry(reg).list_names() == []


def test_corrupted_object_fails_loudly_without_dest(reg_uri, adapter, tmp_path, request):
    v = push(adapter, f"{reg_uri}/bot")
    data = bytearray((adapter / "adapter_model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    if reg_uri.startswith("s3://"):
        key = reg_uri[len(f"s3://{BUCKET}/") :] + "/bot/1/adapter_model.safetensors"
        s3_client(request.getfixturevalue("s3_endpoint")).put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    else:
        (Path(reg_uri) / "bot/1/adapter_model.safetensors").write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(IntegrityError, match="adapter_model.safetensors does not match its manifest") as e:
        pull(v.ref, out / "bot")
    assert "\n" not in str(e.value)
    assert list(out.iterdir()) == []  # neither dest nor a partial temp dir


def test_concurrent_pushes_get_distinct_versions(reg_uri, tmp_path):
    dirs = [make_adapter(tmp_path / f"c{i}", seed=10 + i) for i in range(3)]
    barrier = threading.Barrier(len(dirs))
    results: dict[int, int] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            barrier.wait()
            results[i] = push(dirs[i], f"{reg_uri}/bot").version
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(dirs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(results.values()) == [1, 2, 3]
    for i, v in results.items():  # each version holds exactly what its pusher sent
        dest = tmp_path / f"pulled{i}"
        pull(f"{reg_uri}/bot:{v}", dest)
        assert same_files(dirs[i], dest)
    assert open_registry(reg_uri).storage.list("bot/1/.claim-") == []


def test_push_killed_midway_leaves_no_version(reg_uri, tmp_path):
    src = make_adapter(tmp_path / "big", seed=3, pad_bytes=512 * 1024)
    killed_push(reg_uri, src, tmp_path)
    reg = open_registry(reg_uri)
    assert reg.storage.list("bot/1/.claim-") == ["bot/1/.claim-1.json"]  # it did get that far
    assert reg.list_names() == [] and reg.versions("bot") == []
    with pytest.raises(RegistryError, match="no adapter 'bot'"):
        show(f"{reg_uri}/bot")
    v = push(src, f"{reg_uri}/bot")  # takes over the dead push's claim
    assert v.version == 1
    pull(v.ref, tmp_path / "ok")
    assert same_files(src, tmp_path / "ok")


def test_claims_of_live_and_dead_pushes(tmp_path):
    reg = Registry(str(tmp_path / "reg"), claim_ttl=3600)
    src = make_adapter(tmp_path / "a")
    now = time.time()
    live_elsewhere = {"host": "other-host", "pidns": None, "pid": 1, "created": now}
    reg.storage.put_bytes("bot/1/.claim-1.json", json.dumps(live_elsewhere).encode())
    assert reg.push(src, "bot").version == 2  # a live claim is skipped, never overwritten
    expired = {**live_elsewhere, "created": now - 7200}
    reg.storage.put_bytes("bot/3/.claim-1.json", json.dumps(expired).encode())
    assert reg.push(make_adapter(tmp_path / "b", seed=5), "bot").version == 3  # past the TTL: taken over
    files = ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert reg.storage.list("bot/3/") == [f"bot/3/{f}" for f in files]


def test_bad_names_and_refs(tmp_path, adapter):
    reg = str(tmp_path / "reg")
    tails = ["", "-bot", "a..b", "bot:0", "bot:x", "bot@", "bot@p:1", "x" * 101, "bo t", "bot/"]
    for bad in ["bot", "", "s3://bucket", *(f"{reg}/{t}" for t in tails)]:
        with pytest.raises(RegistryError):
            parse_ref(bad)
    assert parse_ref("s3://b/p/q/bot:12") == Ref("s3://b/p/q", "bot", 12)
    assert str(parse_ref("./reg/bot@prod")) == "./reg/bot@prod"
    assert parse_ref("./reg/bot@latest") == Ref("./reg", "bot")  # @latest is the same as no selector
    with pytest.raises(RegistryError, match="without :VERSION"):
        push(adapter, f"{reg}/bot:2")
    with pytest.raises(RegistryError, match="invalid tag"):
        push(adapter, f"{reg}/bot", tags=["../x"])
    with pytest.raises(RegistryError, match="unknown metadata"):
        push(adapter, f"{reg}/bot", metadata={"recipee": {}})
    with pytest.raises(StorageError, match="unsupported storage URI scheme 'gs'"):
        push(adapter, "gs://bucket/bot")


def test_tokenizer_files_travel_with_the_adapter(reg_uri, tmp_path):
    """A run's final directory holds the tokenizer: its non-JSON files are stored and come back
    byte for byte (they are hashed, never parsed); the manifest has the base config hash that the
    safetensors metadata records."""
    d = make_adapter(tmp_path / "tok")
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (d / "merges.txt").write_text("#version: 0.2\na b\n")
    (d / "tokenizer.model").write_bytes(bytes(range(256)))
    weights = d / "adapter_model.safetensors"  # our adapters record the base config's hash here
    save_file(load_file(weights), str(weights), metadata={"format": "pt", "nxd_config_hash": "0123456789abcdef"})
    v = push(d, f"{reg_uri}/tok")
    assert {"chat_template.jinja", "merges.txt", "tokenizer.model"} <= set(v.manifest["files"])
    assert v.manifest["base_model"]["config_hash"] == "0123456789abcdef"
    pull(v.ref, tmp_path / "back")
    for f in d.iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name


def test_refuses_pickles_and_incomplete_dirs(tmp_path):
    reg = str(tmp_path / "reg")
    d = make_adapter(tmp_path / "pt")
    (d / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    (d / "sub").mkdir()
    with pytest.raises(RegistryError, match=r"adapter_model\.bin, sub/ .*pickle"):
        push(d, f"{reg}/bot")
    d2 = make_adapter(tmp_path / "nosafe")
    (d2 / "adapter_model.safetensors").unlink()
    with pytest.raises(RegistryError, match="missing adapter_model.safetensors"):
        push(d2, f"{reg}/bot")
    d3 = make_adapter(tmp_path / "fake")
    (d3 / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(RegistryError, match="not a safetensors file"):
        push(d3, f"{reg}/bot")
    assert not Path(reg).exists() or open_registry(reg).list_names() == []


# -- storage seam --------------------------------------------------------------------------------


def test_storage_contract(reg_uri, tmp_path):
    st = open_storage(reg_uri)
    assert st.put_bytes("a/b/c.json", b"1", if_none_match=True) is True
    assert st.put_bytes("a/b/c.json", b"2", if_none_match=True) is False
    assert st.get_bytes("a/b/c.json") == b"1"
    st.put_bytes("a/b/c.json", b"3")
    st.put_bytes("a/d.json", b"4")
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(3000))
    seen = []
    st.put_file(src, "x/f.bin", progress=seen.append)
    assert sum(seen) == 3000
    st.get_file("x/f.bin", tmp_path / "g.bin")
    assert (tmp_path / "g.bin").read_bytes() == src.read_bytes()
    assert st.list() == ["a/b/c.json", "a/d.json", "x/f.bin"]
    assert st.list("a/") == ["a/b/c.json", "a/d.json"] and st.list("a/b") == ["a/b/c.json"]
    assert st.list_dirs() == ["a", "x"] and st.list_dirs("a/") == ["b"]
    assert st.exists("a/d.json") and not st.exists("a/zzz")
    with pytest.raises(StorageNotFoundError):
        st.get_bytes("a/zzz")
    with pytest.raises(StorageError, match="invalid storage key"):
        st.get_bytes("a/../etc/passwd")
    assert st.delete_prefix("a/") == 2
    st.delete("x/f.bin")
    st.delete("x/f.bin")  # missing is fine
    assert st.list() == [] and st.list_dirs() == []


def test_s3_multipart_upload(s3_endpoint, tmp_path):
    uri = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    reg = open_registry(uri, multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    src = make_adapter(tmp_path / "large", pad_bytes=11 << 20)
    v = reg.push(src, "big")
    key = uri[len(f"s3://{BUCKET}/") :] + "/big/1/adapter_model.safetensors"
    etag = s3_client(s3_endpoint).head_object(Bucket=BUCKET, Key=key)["ETag"]
    assert etag.strip('"').endswith("-3")  # three parts
    reg.pull("big", tmp_path / "back", version=v.version)
    assert same_files(src, tmp_path / "back")


def test_s3_failed_multipart_upload_is_aborted(s3_endpoint, tmp_path):
    """An upload that fails after its first part leaves no incomplete multipart upload behind."""
    from nxd_finetune.storage.s3 import S3Storage

    prefix = uuid.uuid4().hex[:12]
    st = S3Storage(BUCKET, prefix, multipart_threshold=5 << 20, multipart_chunksize=5 << 20,
                   max_concurrency=1)
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(11 << 20))

    def fail_after_first_part(n: int) -> None:
        raise RuntimeError("network gone")

    with pytest.raises(Exception, match="network gone"):
        st.put_file(big, "big.bin", progress=fail_after_first_part)
    uploads = s3_client(s3_endpoint).list_multipart_uploads(Bucket=BUCKET, Prefix=prefix)
    assert uploads.get("Uploads", []) == []
    assert st.list() == []


def test_s3_missing_credentials_one_line(s3_endpoint, monkeypatch, adapter):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/config")
    with pytest.raises(StorageCredentialsError, match="no usable AWS credentials") as e:
        open_registry(f"s3://{BUCKET}/x").list_names()
    assert "\n" not in str(e.value)
    with pytest.raises(StorageCredentialsError):
        push(adapter, f"s3://{BUCKET}/x/bot")
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(StorageCredentialsError, match="AWS profile 'no-such-profile' not found"):
        open_registry(f"s3://{BUCKET}/x").list_names()


def test_s3_missing_bucket_one_line(s3_endpoint, adapter, tmp_path):
    with pytest.raises(StorageBucketNotFoundError, match="S3 bucket 'nxd-no-such-bucket' does not exist") as e:
        open_registry("s3://nxd-no-such-bucket/p").list_names()
    assert "\n" not in str(e.value)
    with pytest.raises(StorageBucketNotFoundError):
        push(adapter, "s3://nxd-no-such-bucket/p/bot")
    with pytest.raises(StorageBucketNotFoundError):
        pull("s3://nxd-no-such-bucket/p/bot:1", tmp_path / "d")


def test_s3_access_denied_is_one_line():
    from botocore.exceptions import ClientError

    from nxd_finetune.storage.errors import StorageAccessDeniedError
    from nxd_finetune.storage.s3 import translate_error

    err = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "PutObject")
    out = translate_error(err, "s3://bkt/p/bot/1/manifest.json", "PutObject")
    assert isinstance(out, StorageAccessDeniedError)
    assert str(out) == "access denied: PutObject on s3://bkt/p/bot/1/manifest.json (check the IAM/bucket policy)"


# -- CLI -----------------------------------------------------------------------------------------


def test_cli(reg_uri, adapter, tmp_path):
    runner = CliRunner()
    r = runner.invoke(adapters_app, ["push", str(adapter), f"{reg_uri}/support-bot", "--tag", "prod"])
    assert r.exit_code == 0, r.output
    assert f"pushed {reg_uri}/support-bot:1 (tags: prod)" in r.output
    r = runner.invoke(adapters_app, ["push", str(adapter), f"{reg_uri}/support-bot"])
    assert r.exit_code == 0 and "unchanged" in r.output
    r = runner.invoke(adapters_app, ["ls", reg_uri])
    assert r.exit_code == 0 and "support-bot" in r.output and "prod->1" in r.output
    r = runner.invoke(adapters_app, ["ls", reg_uri, "support-bot"])
    assert r.exit_code == 0 and "builtin:tiny-llama" in r.output and "latest" in r.output
    r = runner.invoke(adapters_app, ["show", f"{reg_uri}/support-bot@prod"])
    assert r.exit_code == 0 and '"sha256"' in r.output
    r = runner.invoke(adapters_app, ["tag", f"{reg_uri}/support-bot:1", "canary"])
    assert r.exit_code == 0 and "tagged" in r.output
    r = runner.invoke(adapters_app, ["pull", f"{reg_uri}/support-bot@canary", str(tmp_path / "got")])
    assert r.exit_code == 0 and same_files(adapter, tmp_path / "got")
    r = runner.invoke(adapters_app, ["rm", f"{reg_uri}/support-bot:1"])
    assert isinstance(r.exception, NxdError) and "pass --yes" in str(r.exception)
    assert show(f"{reg_uri}/support-bot:1").version == 1
    r = runner.invoke(adapters_app, ["rm", f"{reg_uri}/support-bot:1", "--yes"])
    assert r.exit_code == 0 and "removed" in r.output and "dropped tags: canary, prod" in r.output
    r = runner.invoke(adapters_app, ["show", f"{reg_uri}/support-bot:1"])
    assert isinstance(r.exception, RegistryError)
    r = runner.invoke(adapters_app, ["ls", reg_uri])
    assert r.exit_code == 0 and "no adapters" in r.output

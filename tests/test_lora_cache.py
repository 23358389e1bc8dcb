"""The registry adapter cache behind the vLLM resolver (nxd_finetune/serve/lora_cache.py), without vLLM:
selectors (and why a name is not one), registries searched in order (local and a real moto S3
server), every sha256 checked, corrupted versions; cached copies read-only, never removed or
rewritten (an altered one is replaced under a new path), and ``ensure`` (what every load in vLLM
reads) answering a verified copy of a path handed out earlier, pulling again after ``rm -rf``;
the base-model check. tests/vllm/ runs it inside vLLM."""

from __future__ import annotations

import json
import shutil
import stat
import uuid
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from nxd_finetune.models.config import DecoderConfig
from nxd_finetune.registry import IntegrityError, RegistryError, open_registry, push, remove
from nxd_finetune.serve.lora_cache import AdapterCache, Selector, WrongBaseError, parse_selector, read_selector
from tests.registry_helpers import make_adapter

BUCKET = "nxd-test"


def with_config_hash(path: Path, config_hash: str) -> Path:
    """Record ``config_hash`` in the adapter's safetensors metadata, as ``run`` does."""
    weights = path / "adapter_model.safetensors"
    save_file(load_file(str(weights)), str(weights), metadata={"nxd_config_hash": config_hash})
    return path


def corrupt(path: Path) -> None:
    path.chmod(0o644)  # cached copies are read-only (root writes anyway)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(data))


def test_parse_selector():
    assert parse_selector("bot") == Selector("bot")
    assert parse_selector("bot:3") == Selector("bot", version=3)
    assert parse_selector("bot@prod") == Selector("bot", tag="prod")
    assert parse_selector("bot@latest") == Selector("bot")
    for other in ("", "org/model", "/abs/path", "bot:x", "bot:0", "../bot", "bad name"):
        assert parse_selector(other) is None, other
    for text, reason in (("org/model", "'org/model' is not a registry adapter name: expected NAME, NAME:VERSION"),
                         ("bot:0", "invalid version '0': versions are integers"),
                         ("bad name", "invalid adapter name 'bad name'"), ("bot@", "invalid tag ''")):
        with pytest.raises(RegistryError) as e:
            read_selector(text)
        assert str(e.value).startswith(reason), (text, str(e.value))


def test_from_env(tmp_path):
    assert AdapterCache.from_env({}) is None
    env = {"NXD_FINETUNE_LORA_REGISTRY": " ./a , s3://b/c ", "NXD_FINETUNE_CACHE": str(tmp_path)}
    cache = AdapterCache.from_env(env)
    assert cache.registries == ["./a", "s3://b/c"] and cache.cache_dir == tmp_path / "lora-cache"
    cache = AdapterCache.from_env({"NXD_FINETUNE_LORA_REGISTRY": "./a", "NXD_FINETUNE_LORA_CACHE": str(tmp_path / "c")})
    assert cache.cache_dir == tmp_path / "c"


def test_local_and_s3_registries_in_order(moto_s3, tmp_path):
    local, s3 = str(tmp_path / "reg"), f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    a1, a2, b1 = (make_adapter(tmp_path / n, seed=i) for i, n in enumerate(("a1", "a2", "b1")))
    push(a1, f"{local}/bot")
    push(a2, f"{local}/bot", tags=["prod"])
    push(b1, f"{s3}/bot")  # shadowed by the local registry, which comes first
    push(b1, f"{s3}/s3bot", tags=["prod"])
    cache = AdapterCache([local, s3], tmp_path / "cache")

    latest, v1, prod = cache.fetch("bot"), cache.fetch("bot:1"), cache.fetch("bot@prod")
    assert (latest.version, v1.version, prod.version) == (2, 1, 2) and latest.path == prod.path
    assert latest.ref == f"{local}/bot:2"
    for got, src in ((v1, a1), (latest, a2)):
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert (got.path / name).read_bytes() == (src / name).read_bytes()
    from_s3 = cache.fetch("s3bot@prod")
    assert from_s3.ref == f"{s3}/s3bot:1" and (from_s3.path / "adapter_model.safetensors").read_bytes() == (
        b1 / "adapter_model.safetensors"
    ).read_bytes()
    assert from_s3.path.is_relative_to(tmp_path / "cache")

    assert cache.fetch("nobody") is None and cache.fetch("org/model") is None
    with pytest.raises(RegistryError, match=r"bot:9 does not exist \(versions: 1, 2\)"):
        cache.fetch("bot:9")
    with pytest.raises(RegistryError, match="has no tag 'nope'"):
        cache.fetch("bot@nope")


def test_corrupted_version_is_refused_and_not_cached(moto_s3, tmp_path):
    import boto3

    local, s3 = str(tmp_path / "reg"), f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    adapter = make_adapter(tmp_path / "a")
    push(adapter, f"{local}/bot")
    push(adapter, f"{s3}/bot")
    corrupt(Path(local) / "bot/1/adapter_model.safetensors")
    cache_dir = tmp_path / "cache"
    with pytest.raises(IntegrityError, match="adapter_model.safetensors does not match its manifest"):
        AdapterCache([local], cache_dir).fetch("bot:1")
    key = s3.removeprefix(f"s3://{BUCKET}/") + "/bot/1/adapter_model.safetensors"
    client = boto3.session.Session().client("s3", endpoint_url=moto_s3, region_name="us-east-1")
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    with pytest.raises(IntegrityError, match="adapter_model.safetensors does not match its manifest"):
        AdapterCache([s3], cache_dir).fetch("bot")
    assert not [p for p in cache_dir.rglob("*") if p.is_file()]  # nothing cached, no partial copy


def test_cached_copy_is_reused_read_only_and_never_stale(tmp_path):
    reg = str(tmp_path / "reg")
    push(make_adapter(tmp_path / "a"), f"{reg}/bot")
    cache = AdapterCache([reg], tmp_path / "cache")
    first = cache.fetch("bot:1")
    weights = first.path / "adapter_model.safetensors"
    assert {stat.S_IMODE(f.stat().st_mode) for f in first.path.iterdir()} == {0o444}  # not writable in place
    stamp = weights.stat().st_mtime_ns
    assert cache.fetch("bot:1").path == first.path
    assert weights.stat().st_mtime_ns == stamp  # not pulled again

    # version 1 published again with other content (as a registry that reused numbers could):
    # the cache holds copies by content, so it fetches a new one
    remove(f"{reg}/bot:1")
    assert push(make_adapter(tmp_path / "b", seed=5), f"{reg}/bot").version == 2  # numbers are never reused
    storage = open_registry(reg).storage
    keys = sorted(storage.list("bot/2/"), key=lambda k: k.endswith("manifest.json"))  # manifest last
    for key in keys:
        data = storage.get_bytes(key)
        if key.endswith("manifest.json"):
            data = json.dumps({**json.loads(data), "version": 1}).encode()
        storage.put_bytes("bot/1/" + key.rsplit("/", 1)[1], data)
    other = cache.fetch("bot:1")
    assert other.path != first.path and (other.path / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "b/adapter_model.safetensors"
    ).read_bytes()
    assert weights.read_bytes() == (tmp_path / "a/adapter_model.safetensors").read_bytes()  # the old copy stays


def test_an_altered_copy_is_left_in_place_and_replaced_under_a_new_path(tmp_path):
    """A server may read a copy again at any time: an altered one is never removed or rewritten."""
    reg = str(tmp_path / "reg")
    src = make_adapter(tmp_path / "a")
    push(src, f"{reg}/bot")
    cache = AdapterCache([reg], tmp_path / "cache")
    first = cache.fetch("bot:1").path
    corrupt(first / "adapter_model.safetensors")
    altered = (first / "adapter_model.safetensors").read_bytes()

    again = cache.fetch("bot:1").path
    assert again == first.with_name(first.name + ".1")
    assert (again / "adapter_model.safetensors").read_bytes() == (src / "adapter_model.safetensors").read_bytes()
    assert (first / "adapter_model.safetensors").read_bytes() == altered
    assert cache.fetch("bot:1").path == again  # the first verified copy, not a third one
    # a load of the path handed out first reads the replacement, in this process or any other
    for loader in (cache, AdapterCache([reg], tmp_path / "cache")):
        assert loader.ensure(first) == again
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, again.name]  # no temp dir left


def test_ensure_pulls_a_copy_removed_by_hand_again(moto_s3, tmp_path):
    s3 = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    src = make_adapter(tmp_path / "a")
    push(src, f"{s3}/bot")
    cache_dir = tmp_path / "cache"
    path = AdapterCache([s3], cache_dir).fetch("bot").path
    assert AdapterCache([s3], cache_dir).ensure(path) == path  # intact: the same path
    shutil.rmtree(cache_dir)  # rm -rf of the cache while a server holds the path

    loader = AdapterCache([s3], cache_dir)  # as in the engine process: nothing in memory
    assert loader.ensure(path) == path
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (path / name).read_bytes() == (src / name).read_bytes()
    outside = make_adapter(tmp_path / "elsewhere")
    assert loader.ensure(outside) == outside  # not a cached copy: not this cache's business
    assert loader.holds(path) and not loader.holds(outside) and not loader.holds(cache_dir)


def test_ensure_refuses_what_the_registry_cannot_give_again(tmp_path):
    reg = str(tmp_path / "reg")
    push(make_adapter(tmp_path / "a"), f"{reg}/bot")
    push(make_adapter(tmp_path / "b", seed=1), f"{reg}/bot")
    cache_dir = tmp_path / "cache"
    cache = AdapterCache([reg], cache_dir)
    v1, v2 = cache.fetch("bot:1").path, cache.fetch("bot:2").path

    corrupt(v1 / "adapter_model.safetensors")
    remove(f"{reg}/bot:1")
    with pytest.raises(RegistryError, match=r"bot:1 does not exist"):
        cache.ensure(v1)
    corrupt(v2 / "adapter_model.safetensors")
    with pytest.raises(IntegrityError, match="came from a registry this cache is not given"):
        AdapterCache([str(tmp_path / "other")], cache_dir).ensure(v2)


def test_base_model_check(tmp_path, tiny_llama_dir, make_tiny_hf):
    reg = str(tmp_path / "reg")
    right = DecoderConfig.from_hf(tiny_llama_dir).config_hash()
    push(with_config_hash(make_adapter(tmp_path / "a"), right), f"{reg}/bot")
    cache = AdapterCache([reg], tmp_path / "cache")
    assert cache.fetch("bot", base_model=str(tiny_llama_dir)).version == 1
    assert cache.fetch("bot", base_model="org/some-hub-model").version == 1  # not a local directory: not checked
    other_dir = make_tiny_hf("llama", num_hidden_layers=3)[1]
    with pytest.raises(WrongBaseError, match=f"does not fit the served base {other_dir}: the adapter was trained on a "
                       f"base with config hash {right}"):
        cache.fetch("bot", base_model=str(other_dir))

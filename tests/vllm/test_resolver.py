"""The resolver plugin inside vLLM's own objects, without a server: what a refusal becomes in vLLM's
error response (status and message), and when the resolver leaves a name to the resolvers after it.
test_vllm_serve.py checks the same answers through a live server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.entrypoints.serve.exception_handling.error_response import create_error_response  # noqa: E402
from vllm.lora.resolver import LoRAResolverRegistry  # noqa: E402
from vllm.plugins.lora_resolvers.filesystem_resolver import FilesystemResolver  # noqa: E402

from nxd_finetune.registry import push  # noqa: E402
from nxd_finetune.serve.lora_cache import AdapterCache  # noqa: E402
from nxd_finetune.serve.vllm_resolver import RESOLVER_NAME, RegistryLoRAResolver  # noqa: E402
from tests.registry_helpers import make_adapter  # noqa: E402


@pytest.fixture
def resolver(tmp_path, monkeypatch) -> RegistryLoRAResolver:
    """This resolver, registered alone in vLLM's resolver registry, on a local registry holding
    ``bot`` versions 1 and 2 (2 tagged prod) and ``broken`` (one altered file)."""
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})
    reg = str(tmp_path / "reg")
    push(make_adapter(tmp_path / "a"), f"{reg}/bot")
    push(make_adapter(tmp_path / "b", seed=1), f"{reg}/bot", tags=["prod"])
    push(make_adapter(tmp_path / "c"), f"{reg}/broken")
    weights = Path(reg) / "broken/1/adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    found = RegistryLoRAResolver(AdapterCache([reg], tmp_path / "cache"))
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, found)
    return found


def answer(resolver: RegistryLoRAResolver, name: str):
    """vLLM's error response for what resolving ``name`` raises, or the LoRARequest."""
    try:
        return asyncio.run(resolver.resolve_lora("base", name))
    except Exception as e:  # what vLLM's API server hands to its exception handler
        return create_error_response(e).error


def test_refusals_carry_their_status_and_reason(resolver, tmp_path):
    for name, code, reason in (
        ("nobody", 404, "The model `nobody` does not exist: no adapter 'nobody' in the served registries."),
        ("bot:0", 404, "The model `bot:0` does not exist: invalid version '0': versions are integers 1, 2, 3, ..."),
        ("org/model", 404, "'org/model' is not a registry adapter name: expected NAME, NAME:VERSION or NAME@TAG"),
        ("bot:7", 404, "bot:7 does not exist (versions: 1, 2)"),
        ("bot@staging", 404, "bot has no tag 'staging'"),
        ("broken", 400, "LoRA adapter refused: broken:1: adapter_model.safetensors does not match its manifest"),
    ):
        error = answer(resolver, name)
        assert error.code == code, (name, error)
        assert reason in error.message and str(tmp_path) not in error.message, (name, error.message)

    good = answer(resolver, "bot@prod")
    assert Path(good.lora_path).parents[2] == tmp_path / "cache" and good.lora_name == "bot@prod"


def test_unreadable_registry_is_503(moto_s3, tmp_path, monkeypatch):
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})
    resolver = RegistryLoRAResolver(AdapterCache(["s3://no-such-bucket/reg"], tmp_path / "cache"))
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, resolver)
    error = answer(resolver, "bot")
    assert error.code == 503 and error.message.startswith("the adapter registry cannot be read: "), error


def test_names_it_does_not_hold_are_left_to_later_resolvers(resolver, tmp_path):
    """With vLLM's filesystem resolver registered after it, an unknown or non-registry name is
    answered None (vLLM then asks the filesystem resolver), while a refusal of a name the registry
    holds still raises."""
    other = FilesystemResolver(str(tmp_path / "loras"))
    LoRAResolverRegistry.register_resolver("Filesystem Resolver", other)
    adapter = make_adapter(tmp_path / "loras" / "local-bot")
    assert answer(resolver, "nobody") is None and answer(resolver, "bot:0") is None
    assert asyncio.run(other.resolve_lora("builtin:tiny-llama", "local-bot")).lora_path == str(adapter)
    assert answer(resolver, "bot:7").code == 404 and answer(resolver, "broken").code == 400


def test_register_wraps_vllm_once(tmp_path, monkeypatch):
    """With the registry set, ``register`` (run by vLLM in each of its processes, perhaps twice)
    adds the resolver and wraps vLLM's adapter load and name resolution exactly once."""
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.lora.worker_manager import WorkerLoRAManager

    from nxd_finetune.serve import vllm_resolver

    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})
    monkeypatch.setattr(WorkerLoRAManager, "_load_adapter", WorkerLoRAManager._load_adapter)
    original = OpenAIServingModels.resolve_lora
    monkeypatch.setattr(OpenAIServingModels, "resolve_lora", original)
    monkeypatch.delenv("NXD_FINETUNE_LORA_REGISTRY", raising=False)
    vllm_resolver.register()
    assert not LoRAResolverRegistry.resolvers and not hasattr(OpenAIServingModels.resolve_lora, "_nxd_one_slot")

    monkeypatch.setenv("NXD_FINETUNE_LORA_REGISTRY", str(tmp_path / "reg"))
    monkeypatch.setenv("NXD_FINETUNE_LORA_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        vllm_resolver.register()
    assert list(LoRAResolverRegistry.resolvers) == [RESOLVER_NAME]
    assert WorkerLoRAManager._load_adapter is vllm_resolver._checked_load_adapter
    wrapped = OpenAIServingModels.resolve_lora
    assert [c.cell_contents for c in wrapped.__closure__] == [original]  # vLLM's own, wrapped once
    assert wrapped._nxd_one_slot and vllm_resolver._load_cache.holds(tmp_path / "cache/k/bot/1-0123456789abcdef")

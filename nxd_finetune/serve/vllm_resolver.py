"""A vLLM LoRA resolver serving nxd-finetune registry adapters by name.

vLLM imports this module through the ``vllm.general_plugins`` entry point (pyproject.toml) in each
process it starts, and calls :func:`register`; nothing else imports it, so vLLM stays an optional
dependency of nxd-finetune. With ``NXD_FINETUNE_LORA_REGISTRY`` set, :func:`register` adds
:class:`RegistryLoRAResolver` to vLLM's ``LoRAResolverRegistry``. Then::

    NXD_FINETUNE_LORA_REGISTRY=s3://team-adapters VLLM_ALLOW_RUNTIME_LORA_UPDATING=True \\
        vllm serve BASE_MODEL_DIR --enable-lora --max-lora-rank 16

serves a request whose ``model`` is ``NAME``, ``NAME:VERSION`` or ``NAME@TAG``: vLLM asks its
resolvers for an adapter of that name, this one pulls the version into the local cache (every
file's sha256 checked against the version's manifest, see :mod:`nxd_finetune.serve.lora_cache`)
and returns a ``LoRARequest`` for the copy.

What vLLM 0.32's interface leaves to it, and what this module does about it:

- vLLM asks resolvers only for a name it has not loaded, keeps the answer under that name until
  ``POST /v1/unload_lora_adapter`` removes it, and numbers adapters after the resolver answers. So
  ``NAME`` and ``NAME@TAG`` stay the version they named at their first request (docs/serving.md says how
  to unload). So that names of one version take one LoRA slot, :func:`register` wraps
  ``OpenAIServingModels.resolve_lora`` (in the API server): a name resolved to the cached copy that
  another loaded name uses takes that name's adapter id.
- vLLM keeps only the copy's path, and reads the files again from it in its engine process when it
  loads an adapter it had evicted from its CPU cache. :func:`register` therefore wraps vLLM's
  ``WorkerLoRAManager._load_adapter`` (in the engine processes it is loaded into) so that every
  load of a cached copy checks its files first (:meth:`AdapterCache.ensure`) and reads a verified
  copy: an altered file or a cache removed by hand is pulled again from the registry instead of
  being served or taking the engine down. Where that method is missing (another vLLM), one warning
  says the check is off; the copies' files are read-only and never removed either way.
- The reason a name is refused reaches the client: a registry answer that is not a servable
  adapter raises a vLLM client error, which vLLM's API server turns into the HTTP status and
  message (404: no such name, version or tag, or not a registry name; 400: a version that fails
  its check or was trained on another base; 503: a registry that cannot be read). A name that is
  not a registry name, or that no registry holds, is left to the resolvers registered after this
  one (None) when there are any. The server log has the reason in one line either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Protocol, TypeVar

import msgspec
from vllm.exceptions import GracefulHTTPError, VLLMClientError, VLLMError, VLLMNotFoundError
from vllm.logger import init_logger
from vllm.lora.lora_model import LoRAModel
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry
from vllm.lora.worker_manager import WorkerLoRAManager

from nxd_finetune.errors import NxdError
from nxd_finetune.registry.errors import IntegrityError, RegistryError
from nxd_finetune.serve.lora_cache import ENV_REGISTRY, AdapterCache, WrongBaseError, read_selector

RESOLVER_NAME = "nxd-finetune registry"

# under "vllm." so that vLLM's logging configuration (handlers, format, VLLM_LOGGING_LEVEL) applies
logger = init_logger("vllm.plugins.nxd_finetune")

_vllm_load_adapter = getattr(WorkerLoRAManager, "_load_adapter", None)
_load_cache: AdapterCache | None = None  # the cache whose copies every load checks (this process's)
ResolvedT = TypeVar("ResolvedT")  # what vLLM's resolve_lora answers: a LoRARequest or an error response


class ServingModels(Protocol):
    """What :func:`_one_slot_per_copy` reads of vLLM's ``OpenAIServingModels``."""

    lora_requests: dict[str, LoRARequest]


class RegistryLoRAResolver(LoRAResolver):
    """vLLM's ``LoRAResolver`` over an :class:`~nxd_finetune.serve.lora_cache.AdapterCache`."""

    def __init__(self, cache: AdapterCache):
        self.cache = cache

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """The ``LoRARequest`` for a verified cached copy of ``lora_name`` (``NAME[:VERSION|@TAG]``).

        None when ``lora_name`` is not a registry name or no registry holds it and another resolver
        comes after this one; otherwise a refusal raises the :class:`vllm.exceptions.VLLMError` whose
        status and message vLLM's API server answers with (see the module docstring)."""
        try:
            found = await asyncio.to_thread(self.cache.fetch, lora_name, base_model_name)
        except NxdError as e:
            logger.error("nxd-finetune registry: refused LoRA adapter %r: %s", lora_name, e)
            raise client_error(e, self.cache.registries) from None
        if found is None:
            try:
                reason = f"no adapter {read_selector(lora_name).name!r} in the served registries"
            except RegistryError as e:
                reason = str(e)
            logger.info("nxd-finetune registry: not serving %r: %s", lora_name, reason)
            if not _last_resolver():
                return None
            raise VLLMNotFoundError(f"The model `{lora_name}` does not exist: {reason}.")
        logger.info("nxd-finetune registry: serving %r as %s from %s", lora_name, found.ref, found.path)
        # vLLM assigns its own id when it loads a resolved adapter; this one is only a valid placeholder
        return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=str(found.path),
                           base_model_name=base_model_name)


def client_error(e: NxdError, registries: list[str]) -> VLLMError:
    """The vLLM error a refusal answers with: 503 for a registry that cannot be read, 400 for a
    version that fails its check or does not fit the base, 404 for an unknown version or tag. The
    message leaves out registry locations (the server log has them)."""
    message = str(e)
    for uri in sorted(registries, key=len, reverse=True):
        message = message.replace(uri.rstrip("/") + "/", "")
    if not isinstance(e, RegistryError):
        return GracefulHTTPError(f"the adapter registry cannot be read: {message}", HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(e, (IntegrityError, WrongBaseError)):
        return VLLMClientError(f"LoRA adapter refused: {message}")
    return VLLMNotFoundError(message)


def _last_resolver() -> bool:
    """No resolver is registered after this one (vLLM asks them in registration order)."""
    names = list(LoRAResolverRegistry.get_supported_resolvers())
    return bool(names) and names[-1] == RESOLVER_NAME


def _checked_load_adapter(self: WorkerLoRAManager, lora_request: LoRARequest) -> LoRAModel:
    """vLLM's ``WorkerLoRAManager._load_adapter``, reading a verified copy of a cached adapter."""
    assert _vllm_load_adapter is not None
    if _load_cache is not None and _load_cache.holds(lora_request.lora_path):
        try:
            path = _load_cache.ensure(lora_request.lora_path)
        except NxdError as e:
            logger.error("nxd-finetune registry: cannot load LoRA adapter %r again: %s", lora_request.lora_name, e)
            raise
        logger.info("nxd-finetune registry: loading LoRA adapter %r (id %d) from %s, files checked",
                    lora_request.lora_name, lora_request.lora_int_id, path)
        if str(path) != lora_request.lora_path:
            lora_request = msgspec.structs.replace(lora_request, lora_path=str(path))
    return _vllm_load_adapter(self, lora_request)


def _one_slot_per_copy(
    resolve_lora: Callable[[ServingModels, str], Awaitable[ResolvedT]],
) -> Callable[[ServingModels, str], Awaitable[ResolvedT]]:
    """Wrap vLLM's ``OpenAIServingModels.resolve_lora``: a name this resolver answered with a copy
    that another loaded name already uses takes that name's adapter id (vLLM gives every name a new
    one after the resolver answers), so that ``NAME``, ``NAME@TAG`` and ``NAME:VERSION`` of one
    version take one LoRA slot. vLLM has by then loaded the copy once under the new id; that entry
    of its CPU cache is never asked for again and ages out."""

    async def resolve(models: ServingModels, lora_name: str) -> ResolvedT:
        found = await resolve_lora(models, lora_name)
        if isinstance(found, LoRARequest) and _load_cache is not None and _load_cache.holds(found.lora_path):
            same = next((r for n, r in models.lora_requests.items() if n != lora_name and r.lora_path == found.lora_path
                         and r.lora_int_id != found.lora_int_id), None)
            if same is not None:
                logger.info("nxd-finetune registry: %r takes the LoRA slot of %r (id %d, the same copy)",
                            lora_name, same.lora_name, same.lora_int_id)
                found.lora_int_id = same.lora_int_id
        return found

    resolve._nxd_one_slot = True  # type: ignore[attr-defined]
    return resolve


def register() -> None:
    """vLLM's plugin hook: register :class:`RegistryLoRAResolver` and check every load of a cached
    copy, when ``NXD_FINETUNE_LORA_REGISTRY`` is set (vLLM calls it in every process it starts;
    registering again replaces the instance)."""
    global _load_cache
    cache = AdapterCache.from_env()
    if cache is None:
        logger.debug("nxd-finetune registry LoRA resolver not enabled: %s is not set", ENV_REGISTRY)
        return
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, RegistryLoRAResolver(cache))
    _load_cache = AdapterCache(cache.registries, cache.cache_dir)  # the engine's loads: their own instance
    if _vllm_load_adapter is None:
        logger.warning("nxd-finetune registry: this vLLM has no WorkerLoRAManager._load_adapter; an adapter "
                       "evicted and loaded again is read from its cached copy without a check")
    else:
        WorkerLoRAManager._load_adapter = _checked_load_adapter  # type: ignore[method-assign]
    try:  # the API server's layer; an optional part of vLLM for this plugin
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:
        return
    current = getattr(OpenAIServingModels, "resolve_lora", None)
    if current is None:
        logger.warning("nxd-finetune registry: this vLLM has no OpenAIServingModels.resolve_lora; names of one "
                       "version take a LoRA slot each")
    elif not getattr(current, "_nxd_one_slot", False):
        OpenAIServingModels.resolve_lora = _one_slot_per_copy(current)  # type: ignore[method-assign]

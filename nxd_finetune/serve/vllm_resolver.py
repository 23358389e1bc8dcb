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
and returns a ``LoRARequest`` for the copy. vLLM keeps a resolved adapter under the name it was
asked for, so a bare ``NAME`` stays the version that was latest at its first request; ask for
``NAME:VERSION`` to pin one.

A version whose stored files do not match its manifest, an unknown version or tag, an adapter
trained on another base and an unreadable registry are refused: the resolver logs the one-line
reason and answers None, so the client gets vLLM's "model does not exist" (404) and nothing is
cached or loaded.
"""

from __future__ import annotations

import asyncio
import hashlib

from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry

from nxd_finetune.errors import NxdError
from nxd_finetune.serve.lora_cache import ENV_REGISTRY, AdapterCache

RESOLVER_NAME = "nxd-finetune registry"

# under "vllm." so that vLLM's logging configuration (handlers, format, VLLM_LOGGING_LEVEL) applies
logger = init_logger("vllm.plugins.nxd_finetune")


class RegistryLoRAResolver(LoRAResolver):
    """vLLM's ``LoRAResolver`` over an :class:`~nxd_finetune.serve.lora_cache.AdapterCache`."""

    def __init__(self, cache: AdapterCache):
        self.cache = cache

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        """The ``LoRARequest`` for the cached copy of ``lora_name`` (``NAME[:VERSION|@TAG]``), or None
        when no registry holds it or it is refused (the reason is logged)."""
        try:
            found = await asyncio.to_thread(self.cache.fetch, lora_name, base_model_name)
        except NxdError as e:
            logger.error("nxd-finetune registry: refused LoRA adapter %r: %s", lora_name, e)
            return None
        if found is None:
            return None
        logger.info("nxd-finetune registry: serving %r as %s from %s", lora_name, found.ref, found.path)
        # vLLM assigns its own id when it loads a resolved adapter; this one is only a valid placeholder
        lora_id = int(hashlib.sha256(found.ref.encode()).hexdigest()[:8], 16) + 1
        return LoRARequest(
            lora_name=lora_name, lora_int_id=lora_id, lora_path=str(found.path), base_model_name=base_model_name
        )


def register() -> None:
    """vLLM's plugin hook: register :class:`RegistryLoRAResolver` when ``NXD_FINETUNE_LORA_REGISTRY``
    is set (vLLM calls it in every process it starts; registering again replaces the instance)."""
    cache = AdapterCache.from_env()
    if cache is None:
        logger.debug("nxd-finetune registry LoRA resolver not enabled: %s is not set", ENV_REGISTRY)
        return
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, RegistryLoRAResolver(cache))

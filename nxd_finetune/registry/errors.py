"""Errors of the adapter registry, one-line :class:`NxdError` subclasses.

The storage errors it also raises live in :mod:`nxd_finetune.storage.errors`.
"""

from nxd_finetune.errors import NxdError


class RegistryError(NxdError):
    """A registry request is invalid: bad REF or name, unknown version or tag, unacceptable adapter dir."""


class IntegrityError(RegistryError):
    """Stored content does not match its manifest (sha256 or size)."""

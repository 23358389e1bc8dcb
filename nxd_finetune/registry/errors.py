"""Errors of the storage seam and the adapter registry; all are one-line :class:`NxdError` subclasses."""

from nxd_finetune.errors import NxdError


class StorageError(NxdError):
    """A storage operation failed for a reason the user can fix (bad URI, permissions, ...)."""


class StorageNotFoundError(StorageError):
    """The key does not exist."""


class StorageCredentialsError(StorageError):
    """No usable credentials (none found, unknown profile, or rejected keys)."""


class StorageBucketNotFoundError(StorageError):
    """The bucket named in an ``s3://`` URI does not exist."""


class StorageAccessDeniedError(StorageError):
    """The credentials are valid but not allowed to do this."""


class RegistryError(NxdError):
    """A registry request is invalid: bad REF or name, unknown version or tag, unacceptable adapter dir."""


class IntegrityError(RegistryError):
    """Stored content does not match its manifest (sha256 or size)."""

"""Errors of the storage layer; all are one-line :class:`NxdError` subclasses."""

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

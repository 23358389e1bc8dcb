"""The URL schemes of the storage layer: one record per scheme, the one place that says what a
``SCHEME://`` URI is.

A record tells how a storage root on the scheme opens (:func:`open_storage`: the adapter registry,
training checkpoints, adapter sources, the LoRA cache of ``serve``) and whether data files on it
(``data.train`` / ``data.eval``) are fetched into the data cache (:func:`nxd_finetune.storage.fetch.
fetch_object`, used alike by ``run`` and by ``validate``'s data checks). A plain path (no
``://``) is the local directory tree.

A new scheme is its backend module (a :class:`~nxd_finetune.storage.base.Storage`; with
:meth:`~nxd_finetune.storage.base.Storage.head` where its data files are fetched) and its
:func:`register_scheme` line at the end of this module; nothing else branches on a scheme. A
record's ``open`` imports its backend, so a backend's client library (boto3 for ``s3://``) is
imported only when a URI of its scheme is opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

from nxd_finetune.storage.base import Storage
from nxd_finetune.storage.errors import StorageError
from nxd_finetune.storage.local import LocalStorage

SEPARATOR = "://"


class Opener(Protocol):
    """Opens the storage root ``uri`` (``SCHEME://...``) with backend ``options``; a bad URI or an
    option the backend does not take raise :class:`StorageError` (one line)."""

    def __call__(self, uri: str, /, **options: object) -> Storage: ...


@dataclass(frozen=True)
class Scheme:
    """What a URL scheme is to nxd-finetune.

    ``name``: the scheme (``s3`` for ``s3://...``); ``open``: a storage root on it; ``data``: whether
    data files on it are fetched into the data cache (its storage must implement ``head``)."""

    name: str
    open: Opener
    data: bool = False

    @property
    def prefix(self) -> str:
        return self.name + SEPARATOR


SCHEMES: dict[str, Scheme] = {}
"""The registered schemes by name, in registration order."""


def register_scheme(scheme: Scheme) -> None:
    """Add ``scheme``; a name already registered is a :class:`ValueError`."""
    if scheme.name in SCHEMES:
        raise ValueError(f"URL scheme {scheme.name!r} is already registered")
    SCHEMES[scheme.name] = scheme


def find_scheme(uri: str) -> Scheme | None:
    """The registered scheme of ``uri``; None for a plain path or a scheme nobody registered."""
    name, sep, _ = uri.partition(SEPARATOR)
    return SCHEMES.get(name) if sep else None


def data_scheme(uri: str) -> Scheme | None:
    """The scheme of ``uri`` where data files on it are fetched into the data cache, else None."""
    scheme = find_scheme(uri)
    return scheme if scheme is not None and scheme.data else None


def data_forms() -> list[str]:
    """How a data file on each fetched scheme is named (``s3://<bucket>/<key>``), for messages."""
    return [f"{s.prefix}<bucket>/<key>" for s in SCHEMES.values() if s.data]


def open_storage(uri: str | os.PathLike[str], **options: object) -> Storage:
    """Open a storage root: a local path or ``SCHEME://...`` of a registered scheme (built in:
    ``file://PATH``, ``s3://BUCKET[/PREFIX]``).

    ``options`` go to the backend (for S3: ``endpoint_url``, ``region``, ``multipart_threshold``,
    ``multipart_chunksize``, ``max_attempts``; see :class:`nxd_finetune.storage.s3.S3Storage`).
    Other schemes raise :class:`StorageError`.
    """
    text = os.fspath(uri)
    if SEPARATOR not in text:
        return _open_local(text, **options)
    scheme = find_scheme(text)
    if scheme is None:
        prefixes = [s.prefix for s in SCHEMES.values()]
        names = f"{', '.join(prefixes[:-1])} or {prefixes[-1]}" if len(prefixes) > 1 else "".join(prefixes)
        raise StorageError(f"unsupported storage URI scheme {text.split(SEPARATOR, 1)[0]!r} in {text!r} "
                           f"(use a local path, {names})")
    return scheme.open(text, **options)


def _open_local(uri: str, /, **options: object) -> Storage:
    """A local path, or ``file://PATH``."""
    text = uri.removeprefix("file" + SEPARATOR)
    if options:
        raise StorageError(f"local storage takes no options, got {sorted(options)}")
    if not text:
        raise StorageError("empty storage path")
    return LocalStorage(text)


def _open_s3(uri: str, /, **options: object) -> Storage:
    from nxd_finetune.storage.s3 import S3Storage  # the only route to boto3

    return S3Storage.from_uri(uri, **options)


register_scheme(Scheme("file", _open_local))
register_scheme(Scheme("s3", _open_s3, data=True))

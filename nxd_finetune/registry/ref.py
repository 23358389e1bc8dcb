"""Adapter references: ``REGISTRY/NAME[:VERSION|@TAG]`` and the name rules.

``REGISTRY`` is any storage root accepted by :func:`nxd_finetune.storage.open_storage`
(``./reg``, ``/abs/reg``, ``file:///abs/reg``, ``s3://bucket``, ``s3://bucket/prefix``); the last
``/``-separated component is the adapter. Examples::

    s3://team-adapters/support-bot        latest version
    s3://team-adapters/nlp/support-bot:3  version 3
    ./reg/support-bot@prod                the version tagged "prod"
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nxd_finetune.registry.errors import RegistryError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
VERSION_RE = re.compile(r"[1-9][0-9]{0,17}")
"""A version number as text: ASCII digits only (``str.isdigit`` also takes ``²``), below 10**18."""
LATEST = "latest"


def check_name(value: str, what: str = "adapter name") -> str:
    """Return ``value`` if it matches ``[A-Za-z0-9][A-Za-z0-9._-]{0,99}`` without ``..``, else raise."""
    if not NAME_RE.fullmatch(value) or ".." in value:
        raise RegistryError(
            f"invalid {what} {value!r}: use 1-100 characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, no '..'"
        )
    return value


def check_tag(value: str) -> str:
    """Tags follow the name rules."""
    return check_name(value, "tag")


@dataclass(frozen=True)
class Ref:
    """A parsed REF. At most one of ``version`` and ``tag`` is set; neither means "latest"."""

    registry: str
    name: str
    version: int | None = None
    tag: str | None = None

    def __str__(self) -> str:
        suffix = f":{self.version}" if self.version is not None else f"@{self.tag}" if self.tag else ""
        return f"{self.registry.rstrip('/')}/{self.name}{suffix}"

    def at(self, version: int) -> Ref:
        """The same adapter pinned to ``version``."""
        return Ref(self.registry, self.name, version)


def parse_ref(text: str) -> Ref:
    """Parse ``REGISTRY/NAME[:VERSION|@TAG]``; every malformed part raises :class:`RegistryError`."""
    text = text.strip()
    head, sep, tail = text.rpartition("/")
    if not sep or not head or head.endswith(":/") or head.endswith(":"):
        raise RegistryError(f"invalid REF {text!r}: expected REGISTRY/NAME[:VERSION|@TAG], e.g. ./reg/support-bot:3")
    version: int | None = None
    tag: str | None = None
    if "@" in tail:
        tail, _, tag = tail.partition("@")
        check_tag(tag)
        if tag == LATEST:
            tag = None
    elif ":" in tail:
        tail, _, raw = tail.partition(":")
        if not VERSION_RE.fullmatch(raw):
            raise RegistryError(f"invalid version {raw!r} in REF {text!r}: versions are integers 1, 2, 3, ...")
        version = int(raw)
    check_name(tail)
    return Ref(registry=head, name=tail, version=version, tag=tag)

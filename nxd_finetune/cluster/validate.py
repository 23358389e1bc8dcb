"""The ``k8s`` generators' flags against the syntax Kubernetes accepts, before any manifest is written.

A value Kubernetes would reject at ``kubectl apply`` (an image reference with a space, a namespace
with a newline, ``--cpu lots``, ``--memory '480 GiB; rm'``, a service account ``Bad Account!``) is
one NxdError line naming the flag and the rule, so no manifest carries it.

The rules are Kubernetes' own (k8s.io/apimachinery ``validation``): namespaces are RFC 1123 labels,
service accounts and volume claims RFC 1123 subdomains, node label values (``--instance-type``) label
values, CPU and memory resource quantities (``resource.Quantity``); the image is a container image
reference (the distribution ``reference`` grammar: ``[host[:port]/]path[:tag][@digest]``).
"""

from __future__ import annotations

import re

from nxd_finetune.errors import NxdError

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = re.compile(_LABEL)
DNS1123_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
# a DNS-1035 label of at most 52 characters: the training operator names Services after a job
JOB_NAME = re.compile(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
# resource.Quantity: <signedNumber><suffix>, suffix binary (Ki..Ei), decimal (n u m k M G T P E) or an exponent
QUANTITY = re.compile(r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?")
_COMPONENT = r"[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*"
_HOST = r"[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*(:[0-9]+)?"
IMAGE = re.compile(rf"({_HOST}/)?{_COMPONENT}(/{_COMPONENT})*(:[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
                   r"(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")


def _check(flag: str, value: str, rule: re.Pattern[str], max_len: int, what: str) -> None:
    if len(value) > max_len or not rule.fullmatch(value):
        raise NxdError(f"{flag} {value!r} is not {what} (at most {max_len} characters)")


def check_image(value: str) -> None:
    """``--image``: a container image reference."""
    _check("--image", value, IMAGE, 255, "a container image reference: [HOST[:PORT]/]NAME[:TAG][@DIGEST], "
           "NAME of lowercase letters, digits and . _ - separated by '/', no spaces")


def check_namespace(value: str) -> None:
    """``--namespace``: an RFC 1123 label."""
    _check("--namespace", value, DNS1123_LABEL, 63, "a Kubernetes namespace: lowercase letters, digits and '-', "
           "starting and ending with a letter or digit")


def check_subdomain(flag: str, value: str) -> None:
    """``--service-account`` / ``--pvc``: an RFC 1123 subdomain."""
    _check(flag, value, DNS1123_SUBDOMAIN, 253, "a Kubernetes object name: lowercase letters, digits, '-' and '.', "
           "starting and ending with a letter or digit")


def check_quantity(flag: str, value: str) -> None:
    """``--cpu`` / ``--memory``: a positive Kubernetes resource quantity."""
    _check(flag, value, QUANTITY, 64, "a Kubernetes quantity such as 8, 500m, 480Gi or 1e3 "
           "(a number, then optionally one of Ki Mi Gi Ti Pi Ei, n u m k M G T P E or an exponent)")


def check_label_value(flag: str, value: str) -> None:
    """``--instance-type``: a node label value."""
    _check(flag, value, LABEL_VALUE, 63, "a Kubernetes label value: letters, digits, '-', '_' and '.', "
           "starting and ending with a letter or digit")


def check_mount_path(value: str) -> None:
    """``--mount-path``: an absolute path without ':' or control characters."""
    if not value.startswith("/") or ":" in value or any(ord(c) < 32 for c in value) or len(value) > 4096:
        raise NxdError(f"--mount-path {value!r} is not a container mount path: an absolute path without ':' "
                       "or control characters")


def check_name(name: str, flag: str = "--name") -> str:
    """``name`` if it is a DNS-1035 label (what the training operator accepts: lowercase letters,
    digits and ``-``, starting with a letter, ending with a letter or digit), else NxdError naming
    ``flag``, the option that gave it."""
    if not JOB_NAME.fullmatch(name):
        raise NxdError(f"{flag} {name!r} is not a Kubernetes name: lowercase letters, digits and '-', "
                       "starting with a letter and ending with a letter or digit, at most 52 characters")
    return name

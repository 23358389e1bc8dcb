"""JSON as types: what ``json.loads`` returns and what ``json.dumps`` takes.

:data:`JsonValue` is recursive (a list or object holds JSON values again), so a reader narrows a
value (``isinstance``) before it uses it as a number, a string or a container; :func:`json_object`
and :func:`json_str` are the narrowings most readers need. A function that only writes a mapping
out takes ``Mapping[str, object]``. Ground floor: imports nothing from the package.
"""

from __future__ import annotations

from typing import TypeAlias

JsonValue: TypeAlias = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject: TypeAlias = dict[str, JsonValue]


def json_object(value: object) -> JsonObject:
    """``value`` when it is a JSON object (a dict), else an empty one."""
    return value if isinstance(value, dict) else {}


def json_str(value: object) -> str | None:
    """``value`` when it is a string, else None."""
    return value if isinstance(value, str) else None


__all__ = ["JsonObject", "JsonValue", "json_object", "json_str"]

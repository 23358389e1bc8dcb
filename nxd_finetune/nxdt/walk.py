"""The walk over a flattened NxDT config that :mod:`nxd_finetune.nxdt.keys` translates: the values
read with their type checked (one :class:`RecipeError` line naming the key where a value has the
wrong type or shape: ``lr: abc``, ``devices: eight``, ``betas: 0.9``), the recipe being built, and
the report (every key mapped or not carried over, once)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

from nxd_finetune.errors import RecipeError

if TYPE_CHECKING:
    from nxd_finetune.recipe import RecipeDict
    from nxd_finetune.recipe.yaml_loader import YamlValue

_INT_LIMIT = 2**63  # NxDT's counts and sizes; a larger integer is a mistake (and no step count)


def _numeric(value: YamlValue) -> int | float | None:
    """A number, or a string that reads as one (YAML 1.1 reads ``1e-4`` as a string); else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):
        for parse in (int, float):
            try:
                return parse(value.strip())
            except ValueError:  # also an integer of more than 4300 digits
                pass
    return None


def shown(value: YamlValue) -> str:
    """``value`` for an error line: its repr, shortened where long."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


@dataclasses.dataclass
class KeyWalk:
    """The flattened config (dotted key -> leaf value), the recipe being built and the report."""

    flat: dict[str, YamlValue]
    base: Path  # relative NxDT paths are relative to the directory training starts in
    recipe: RecipeDict = dataclasses.field(default_factory=dict)
    mapped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    dropped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    used: set[str] = dataclasses.field(default_factory=set)

    def get(self, key: str, default: YamlValue = None) -> YamlValue:
        value = self.flat.get(key, default)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.flat.get(key) is not None

    def _wrong(self, key: str, what: str) -> RecipeError:
        return RecipeError(f"{key}: expected {what}, found {shown(self.flat.get(key))}")

    def integer(self, key: str, default: int = 0) -> int:
        """``key`` as an integer (``8``, ``8.0``, ``'8'``); ``default`` where unset."""
        value = self.get(key)
        if value is None:
            return default
        n = _numeric(value)
        if n is None or isinstance(n, float) and not (math.isfinite(n) and n.is_integer()) or abs(n) >= _INT_LIMIT:
            raise self._wrong(key, "an integer")
        return int(n)

    def number(self, key: str, default: float = 0.0) -> float:
        """``key`` as a finite number (``1.5e-4``, ``'1e-4'``); ``default`` where unset."""
        value = self.get(key)
        if value is None:
            return default
        n = _numeric(value)
        if n is None or isinstance(n, int) and abs(n) >= _INT_LIMIT or not math.isfinite(n):
            raise self._wrong(key, "a number")
        return float(n)

    def numbers(self, key: str) -> list[float]:
        """``key`` as a list of finite numbers (``betas: [0.9, 0.999]``)."""
        value = self.get(key)
        if not isinstance(value, list) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                  and math.isfinite(v) for v in value):
            raise self._wrong(key, "a list of numbers")
        return [float(v) for v in value]

    def flag(self, key: str, default: bool = False) -> bool:
        """``key`` as true / false (also ``1`` / ``0`` and their strings, as OmegaConf reads them)."""
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        words = {"true": True, "false": False, "1": True, "0": False}
        if isinstance(value, int | str) and str(value).strip().lower() in words:
            return words[str(value).strip().lower()]
        raise self._wrong(key, "true or false")

    def text(self, key: str, default: str = "") -> str:
        """``key`` as a string (a number is written as it reads); a list or mapping is refused."""
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, list | dict):
            raise self._wrong(key, "a string")
        return str(value)

    def names(self, key: str, default: list[str]) -> list[str]:
        """``key`` as a list of names (one name alone counts as a list of one)."""
        value = self.get(key)
        if value is None:
            return default
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, list | dict) or v is None for v in items):
            raise self._wrong(key, "a name or a list of names")
        return [str(v) for v in items]

    def _keys(self, key: str) -> list[str]:
        return [k for k in self.flat if (k == key or k.startswith(key + ".")) and k not in self.used]

    def put(self, recipe_key: str, value: YamlValue, *keys: str) -> None:
        """Set ``recipe_key`` (dotted) to ``value``; ``keys`` are the NxDT keys it comes from."""
        node = self.recipe
        *parents, last = recipe_key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        for key in keys:
            for k in self._keys(key):
                self.used.add(k)
                self.mapped.append((k, recipe_key))

    def keep(self, key: str, note: str) -> None:
        """``key`` needs no recipe key of its own (already covered, or a default that agrees)."""
        for k in self._keys(key):
            self.used.add(k)
            self.mapped.append((k, note))

    def drop(self, key: str, reason: str) -> None:
        """``key`` (and everything under it) is not carried over, for ``reason``."""
        for k in self._keys(key):
            self.used.add(k)
            self.dropped.append((k, reason))

    def path(self, value: str, key: str = "") -> str:
        """An NxDT path made absolute (NxDT reads relative paths from the working directory);
        ``key``, where the path comes from, names it in the error line of an impossible path."""
        try:
            p = Path(str(value)).expanduser()
            return str(p if p.is_absolute() else (self.base / p).resolve())
        except (ValueError, OSError, RuntimeError) as e:  # a NUL byte, a name over the limit, a loop
            raise RecipeError(f"{key or 'a path'}: {shown(value)} is not a usable path ({e})") from None

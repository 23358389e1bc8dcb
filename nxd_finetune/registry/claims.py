"""Version claims: how concurrent pushes get distinct version numbers without overwriting each other.

"Upload, then conditionally create the manifest" alone is not enough: two pushes that pick the
same number would overwrite each other's files before one of them loses the manifest race, and the
winner's files would no longer match its manifest. So a push first *claims* the number with a
conditional create of ``<name>/<v>/.claim-1.json`` and only then uploads; the loser of a claim moves
to the next number before writing anything.

A claim left by a dead push is taken over by creating the next generation
(``.claim-<gen+1>.json``, again a conditional create, so exactly one taker wins). Whether a claim
is dead:

- its holder ran on this machine (same hostname and PID namespace): dead exactly when that process
  is gone (its PID no longer runs, or runs a process started at another time: a reused PID). The
  TTL plays no part: an upload however long is never taken over while its process lives;
- its holder ran on another machine: dead when older than the TTL, the only signal there is.

Hence a SIGKILLed push is invisible and the next push on the same machine reuses its number;
numbers only grow, and may skip one held by a push that died elsewhere. A holder checks that it
still owns its claim before writing the manifest (a push on another machine slower than the TTL can
lose it; an upload that fails because the taker removed its files ends the same way, in one line),
and the manifest create stays conditional as the last line of defence. Claims are deleted once the
manifest exists.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nxd_finetune.registry.errors import RegistryError
from nxd_finetune.registry.manifest import MANIFEST, dumps
from nxd_finetune.storage import Storage, StorageNotFoundError

CLAIM_RE = re.compile(r"\.claim-([1-9][0-9]*)\.json")


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22); None
    where there is no ``/proc`` or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat[stat.rindex(")") + 2:].split()[19])  # fields after "pid (comm)": state is 3
    except (ValueError, IndexError):
        return None


def _pid_alive(pid: object, started: object = None) -> bool:
    """Whether process ``pid`` runs and, where its start time was recorded, is the same process."""
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # exists, owned by someone else (EPERM)
    if type(started) is int:
        now = _start_time(pid)
        return now is None or now == started
    return True


class Claims:
    """Claims on version numbers under one registry storage; ``ttl`` in seconds."""

    def __init__(self, storage: Storage, ttl: float):
        self.storage = storage
        self.ttl = ttl

    def _key(self, name: str, v: int | str, gen: int) -> str:
        return f"{name}/{v}/.claim-{gen}.json"

    def generations(self, name: str, v: int | str) -> list[int]:
        """Claim generations present at ``name/v``, ascending."""
        gens = []
        for key in self.storage.list(f"{name}/{v}/.claim-"):
            m = CLAIM_RE.fullmatch(key.rsplit("/", 1)[1])
            if m:
                gens.append(int(m.group(1)))
        return sorted(gens)

    def owns(self, name: str, v: int, gen: int) -> bool:
        """Whether generation ``gen`` is still the newest claim at ``name/v``."""
        return self.generations(name, v)[-1:] == [gen]

    def is_stale(self, holder: object) -> bool:
        """Whether a claim's content shows a dead holder (see the module docstring)."""
        if not isinstance(holder, dict):
            return True
        if holder.get("host") == socket.gethostname() and holder.get("pidns") == _pid_namespace():
            return not _pid_alive(holder.get("pid"), holder.get("started"))
        created = holder.get("created")
        return not isinstance(created, int | float) or time.time() - created > self.ttl

    def _holder(self, push_id: str, files: Iterable[str] = ()) -> dict[str, Any]:
        pid = os.getpid()
        return {"push_id": push_id, "host": socket.gethostname(), "pidns": _pid_namespace(), "pid": pid,
                "started": _start_time(pid), "created": time.time(), "files": sorted(files)}

    def take(self, name: str, v: int | str, push_id: str, files: Iterable[str] = ()) -> int | None:
        """Claim ``name/v`` if it is free (no claim, or a dead holder's): the new generation, or None
        when a live holder has it. ``v`` may also be a non-numeric lock name (see :meth:`Registry.push`).
        ``files``: the names the holder will write under ``name/v`` (recorded in the claim: they are
        all ``adapters gc`` removes there if the holder dies)."""
        for _ in range(100):
            gens = self.generations(name, v)
            if gens:
                try:
                    current = json.loads(self.storage.get_bytes(self._key(name, v, gens[-1])))
                except StorageNotFoundError:
                    continue  # released meanwhile: look again
                except ValueError:
                    current = None
                if not self.is_stale(current):
                    return None
            gen = gens[-1] + 1 if gens else 1
            if self.storage.put_bytes(self._key(name, v, gen), dumps(self._holder(push_id, files)), if_none_match=True):
                return gen
        return None

    def drop(self, name: str, v: int | str, gen: int) -> None:
        """Delete our own claim generation ``gen`` and the dead ones below it."""
        for g in self.generations(name, v):
            if g <= gen:
                self.storage.delete(self._key(name, v, g))

    def claim(self, name: str, push_id: str, start: int, files: Iterable[str] = ()) -> tuple[int, int]:
        """Claim the lowest free version number >= ``start`` for writing ``files``; return
        ``(version, generation)``."""
        v = start
        for _ in range(10_000):
            if self.storage.exists(f"{name}/{v}/{MANIFEST}"):
                v += 1
                continue
            gen = self.take(name, v, push_id, files)
            if gen is None:
                v += 1
                continue
            if not self.storage.exists(f"{name}/{v}/{MANIFEST}"):
                return v, gen
            self.storage.delete(self._key(name, v, gen))  # published under our feet
            v += 1
        raise RegistryError(f"could not claim a version of {name} in {self.storage.uri}")

    def release(self, name: str, v: int, gen: int, uploaded: Iterable[str], push_id: str) -> None:
        """Best effort after a failed push: drop our files and claim if ``v`` is unpublished and
        still ours -- or ours again: a push that lost its claim takes it back where nobody live
        holds it (the taker finished or gave up), so files it wrote after the taker cleaned up do
        not linger without a claim."""
        try:
            if not self.owns(name, v, gen):
                gen = self.take(name, v, push_id) or 0
            if gen and not self.storage.exists(f"{name}/{v}/{MANIFEST}"):
                for fname in uploaded:
                    self.storage.delete(f"{name}/{v}/{fname}")
            if gen:
                self.drop(name, v, gen)
        except Exception:  # noqa: BLE001 - never mask the error that made the push fail
            pass

    def clear(self, name: str, v: int) -> None:
        """Delete every claim at ``name/v`` (after its manifest is written)."""
        for gen in self.generations(name, v):
            self.storage.delete(self._key(name, v, gen))

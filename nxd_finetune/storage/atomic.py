"""Publish a local directory (or one file) atomically: the one helper every writer of a whole
directory uses, and :func:`publish_file` for a command's output file (``-o``).

A reader of ``dest`` sees nothing (or an empty directory) until the writer is done, then the
complete directory; a writer that fails or is killed leaves at most a hidden temp sibling
(``.<name>.partial-*``) behind, never a half-written ``dest``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from nxd_finetune.storage.errors import StorageError
from nxd_finetune.storage.local import _file_in_the_way, in_dir

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _renameat2() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.renameat2  # type: ignore[no-any-return]  # glibc 2.28+
    except (OSError, AttributeError):
        return None


def exchange_dirs(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``): at every instant
    each path holds one of the two. False where the system or filesystem cannot (nothing moved)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _replace(tmp: Path, dest: Path) -> None:
    """Put the finished ``tmp`` at an existing ``dest``: swapped atomically where the system can,
    so ``dest`` is the old or the new directory at every instant, and the old one is removed after
    (a kill in between leaves it as the hidden ``tmp`` sibling). Elsewhere the old one is first
    renamed aside (``dest`` is briefly absent, never half-written)."""
    if not exchange_dirs(tmp, dest):
        aside = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.rename(dest, aside / dest.name)
        os.rename(tmp, dest)
        tmp.mkdir()
        shutil.rmtree(aside, ignore_errors=True)


def remove_leftovers(dest: str | os.PathLike) -> list[Path]:
    """Remove the hidden siblings that killed writers of ``dest`` left (``.<name>.partial-*``,
    ``.<name>.old-*``); only for a ``dest`` with a single writer at a time (a run's ``final/``)."""
    dest = Path(dest)
    found = [p for pattern in (f".{dest.name}.partial-*", f".{dest.name}.old-*") for p in dest.parent.glob(pattern)]
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


@contextlib.contextmanager
def publish_dir(
    dest: str | os.PathLike, *, already_published: Callable[[Path], bool] | None = None, replace: bool = False,
    before_swap: Callable[[], None] | None = None, after_swap: Callable[[], None] | None = None,
) -> Iterator[Path]:
    """Yield a fresh temp directory beside ``dest``; on a clean exit rename it to ``dest``.

    ``dest`` must be absent or an empty directory when the block ends (an empty one is replaced);
    otherwise the rename raises ``OSError`` -- unless ``already_published(dest)`` says that a
    concurrent writer published the same content first (caches keyed by a content hash), in
    which case this writer's copy is dropped. The published directory has mode 0755. On any
    exception in the block, or a failed rename, the temp directory is removed and the exception
    propagates; ``dest`` is left as it was. Temp and ``dest`` share a parent, so the rename is one
    atomic ``rename(2)`` on the same filesystem.
    """
    dest = Path(dest)
    tmp = in_dir(dest.parent, lambda: Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent)))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        try:
            if dest.is_dir() and not any(dest.iterdir()):
                dest.rmdir()
            if replace and dest.is_dir():
                if before_swap is not None:
                    before_swap()
                _replace(tmp, dest)  # tmp now holds the old directory, removed below
                if after_swap is not None:
                    after_swap()
            else:
                os.rename(tmp, dest)
        except OSError:
            if already_published is None or not already_published(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def publish_file(dest: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to the file ``dest`` atomically: into a temp sibling (``.<name>.partial-*``,
    synced), renamed onto ``dest``, so ``dest`` is the old file or the new one at every instant (a
    full disk leaves the old one whole) and keeps its mode. Missing parent directories are made.

    Raises StorageError (one line) where ``dest`` cannot be written (a directory, under a file, no
    permission...); a full disk raises ``OSError`` ENOSPC / EDQUOT naming ``dest``.
    """
    dest = Path(dest)
    try:
        if dest.is_dir():
            raise StorageError(f"cannot write {dest}: it is a directory (name a file)")
        mode = stat.S_IMODE(dest.stat().st_mode) if dest.is_file() else None
        tmp = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex}")
        fd = in_dir(dest.parent, lambda: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if mode is not None:
                os.chmod(tmp, mode)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise write_error(e, dest) from None


def write_error(e: OSError, dest: Path) -> OSError | StorageError:
    """What to raise for ``e``, met while writing ``dest``: a full disk stays ``OSError`` (ENOSPC /
    EDQUOT) naming ``dest`` (a failed ``write(2)`` names no file); anything else becomes one
    StorageError line ("cannot write DEST: reason", or the file that stands where a directory must)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OSError(e.errno, e.strerror, str(dest))
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and (file := _file_in_the_way(e.filename)):
        return StorageError(f"cannot write {dest}: {file} is a file, not a directory")
    return StorageError(f"cannot write {dest}: {e.strerror or e}")

"""Publish a local directory atomically: the one helper every writer of a whole directory uses.

A reader of ``dest`` sees nothing (or an empty directory) until the writer is done, then the
complete directory; a writer that fails or is killed leaves at most a hidden temp sibling
(``.<name>.partial-*``) behind, never a half-written ``dest``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def publish_dir(
    dest: str | os.PathLike, *, already_published: Callable[[Path], bool] | None = None
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
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        try:
            if dest.is_dir() and not any(dest.iterdir()):
                dest.rmdir()
            os.rename(tmp, dest)
        except OSError:
            if already_published is None or not already_published(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

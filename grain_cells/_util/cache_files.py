"""The user's cache folder (`$GRAIN_CELLS_CACHE`), and files written into it atomically.

Design notes: docs/reference/design.md#util-cache-files.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # not POSIX: no locks
    fcntl = None


def cache_root(*, xdg: bool = True) -> str:
    """`$GRAIN_CELLS_CACHE`, else `grain_cells` in `$XDG_CACHE_HOME` or `~/.cache`.

    The obs and synthetic caches never honoured `$XDG_CACHE_HOME` (`xdg=False`).
    """
    folder = os.environ.get("GRAIN_CELLS_CACHE")
    if folder:
        return folder
    base = (xdg and os.environ.get("XDG_CACHE_HOME")) or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(base, "grain_cells")


def write_atomic(
    path: str | os.PathLike,
    write: Callable[[BinaryIO], object],
    *,
    fsync: bool = False,
    prefix: str | None = None,
) -> None:
    """Writes `path` through `write(file)` in a temporary file, then renames it.

    Mode 0644 (`mkstemp`'s 0600 would hide a shared cache from other users).
    """
    folder = os.path.dirname(os.fspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    name = os.path.basename(os.fspath(path))
    fd, tmp = tempfile.mkstemp(
        dir=folder, prefix=f".{name}." if prefix is None else prefix, suffix=".tmp"
    )
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), 0o644)
            write(fh)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: str | os.PathLike | None):
    """Holds an exclusive `flock` on `path` where one can be made (else nothing)."""
    fd = None
    if path is not None and fcntl is not None:
        try:
            os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            fd = None
    if fd is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


__all__ = ["cache_root", "file_lock", "write_atomic"]

"""The cache folder (`$GRAIN_CELLS_CACHE`), files written atomically, file locks."""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable
from typing import BinaryIO

_WRITES = itertools.count()  # numbers this process's temporary files

try:
    import fcntl
except ImportError:  # not POSIX: no locks
    fcntl = None


def cache_root(*, xdg: bool = True) -> str:
    """`$GRAIN_CELLS_CACHE`, else grain_cells in `$XDG_CACHE_HOME` (xdg) or ~/.cache."""
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
    """Writes `path` (mode 0644) through `write(file)` in a temporary file, renamed."""
    folder = os.path.dirname(os.fspath(path)) or "."
    name = os.path.basename(os.fspath(path))
    # This process and thread's own name: cheaper than `mkstemp` (issue 33).
    tmp = os.path.join(
        folder,
        f"{f'.{name}.' if prefix is None else prefix}{os.getpid()}."
        f"{threading.get_ident()}.{next(_WRITES)}.tmp",
    )
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, flags, 0o600)
    except FileExistsError:  # left by a dead process of the same pid
        os.unlink(tmp)
        fd = os.open(tmp, flags, 0o600)
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


def write_new(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to `path` (mode 0644), created in place when it is new.

    Only for entries a reader takes as a miss unless whole (design.md).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:  # there already, or no folder yet
        write_atomic(path, lambda out: out.write(data))
        return
    try:
        os.fchmod(fd, 0o644)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):  # not a newer one
                os.unlink(path)
        raise
    finally:
        os.close(fd)


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

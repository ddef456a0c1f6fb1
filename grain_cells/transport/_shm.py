"""Shared-memory segments in `/dev/shm`: their names, mappings, and contents.

Names are `gcells_<pid>_t<start>_<token>_<what>`: the creator's pid and start
time tell which outlived it (`remove_stale`). Segments are mapped without a
descriptor each. Design notes: docs/reference/design.md#transport-shm-names,
#transport-segments, #transport-mapping.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Mapping

import numpy as np

from grain_cells import errors
from grain_cells._util.pids import alive as alive
from grain_cells._util.pids import gone, start_time

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared-memory names
STEM = "gcells_"
ALIGN = 64  # bytes: where each array of a slot starts
_OWNER = re.compile(rf"/*{STEM}(\d+)(?=_|$)(?:_t(\d+)(?=_|$))?", re.ASCII)
_own_start: tuple[int, int | None] | None = None  # (pid, start) of this process
_libc = ctypes.CDLL(None, use_errno=True)
_mmap, _munmap = _libc.mmap, _libc.munmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # the same on every Linux architecture; not in `mmap`
_CHUNK = 1 << 20  # bytes copied at a time by `privatise` (bounded extra memory)
_RW = mmap.PROT_READ | mmap.PROT_WRITE
Segment = ctypes.Array  # a mapped segment: a `ctypes` array of bytes


def new_prefix() -> str:
    """A fresh name prefix owned by this process: `/gcells_<pid>_t<start>_<token>`."""
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:  # a forked child: its own
        _own_start = (pid, start_time(pid))
    start = _own_start[1]
    stamp = "" if start is None else f"t{start}_"
    return f"/{STEM}{pid}_{stamp}{secrets.token_hex(4)}"


def owner(name: str) -> tuple[int, int | None] | None:
    """(pid, start time or None) of a `gcells_...` name, or None."""
    found = _OWNER.match(name)
    if found is None:
        return None
    return int(found[1]), None if found[2] is None else int(found[2])


def path_of(name: str) -> str:
    """The file in `SHM_DIR` that `shm_open(name)` opens (Linux)."""
    return os.path.join(SHM_DIR, name.lstrip("/"))


def unlink(name: str) -> None:
    """Unlinks a shared-memory name; a name already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path_of(name))


def unlink_prefix(prefix: str) -> None:
    """Unlinks every name that starts with `prefix` + `_`."""
    stem = prefix.lstrip("/") + "_"
    for entry in _entries():
        if entry.startswith(stem):
            unlink("/" + entry)


def remove_stale() -> list[str]:
    """Removes the names of gone grain_cells processes; returns them (no `/`)."""
    removed, verdict = [], {}
    for entry in _entries():
        if (made_by := owner(entry)) is None:
            continue
        if made_by not in verdict:
            verdict[made_by] = gone(*made_by)
        if verdict[made_by]:
            unlink("/" + entry)
            removed.append(entry)
    return removed


def _entries() -> list[str]:
    if not os.path.isdir(SHM_DIR):
        return []
    return [e for e in os.listdir(SHM_DIR) if e.startswith(STEM)]


def privatise(addr: int, size: int) -> None:
    """Makes the mapping at `addr` private memory with the same bytes (`OSError`)."""
    if addr % mmap.PAGESIZE:
        raise ValueError(f"address {addr:#x} is not page-aligned")
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED
    for start in range(addr, addr + size, _CHUNK):
        n = min(_CHUNK, addr + size - start)
        held = ctypes.string_at(start, n)
        span = -(-n // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages
        if _mmap(start, span, _RW, flags, -1, 0) != start:
            err = ctypes.get_errno()
            raise OSError(err, f"private remap at {start:#x}: {os.strerror(err)}")
        ctypes.memmove(start, held, n)


def open_segment(name: str, size: int, new: bool = False) -> Segment:
    """`size` bytes of segment `name` mapped shared, unmapped when unreferenced.

    `new`: made here, its pages reserved (`SharedMemoryFullError`); else
    `FileNotFoundError` if gone.
    """
    path = path_of(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR if new else os.O_RDWR, 0o600)
    try:
        if new:
            os.ftruncate(fd, size)
        if new and hasattr(os, "posix_fallocate"):  # not on macOS
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                    raise full_error(os.path.dirname(path), size) from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise  # else no fallocate here: pages come when written
        addr = _mmap(None, size, _RW, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes: {os.strerror(err)}")
        buf = (ctypes.c_ubyte * size).from_address(addr)
        # Not at exit: a thread may still read it while the interpreter exits.
        weakref.finalize(buf, _munmap, addr, size).atexit = False
        return buf
    except BaseException:
        if new:
            unlink(name)
        raise
    finally:
        os.close(fd)


create = functools.partial(open_segment, new=True)


def full_error(folder: str, requested: int) -> errors.SharedMemoryFullError:
    """The error for `requested` bytes that shared memory in `folder` lacks."""
    try:
        st = os.statvfs(folder)
        total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        room = f"{_size(total)} in all, {_size(free)} free"
    except OSError:
        total = free = None
        room = "size unknown"
    return errors.SharedMemoryFullError(
        f"shared memory ({folder}: {room}) has no room for a minibatch slot of "
        f"{_size(requested)}: each worker process sends its minibatches through "
        "a ring of slots in shared memory, up to about four fetches' worth per "
        "worker (more with a larger worker_buffer_size). Give the machine or "
        "container more shared memory (docker "
        "run --shm-size=8g; Kubernetes: an emptyDir volume with medium: Memory "
        "mounted at /dev/shm), or use fewer workers (worker_count), a smaller "
        "worker_buffer_size or smaller fetches (fetch_factor, batch_size).",
        requested=requested,
        size=total,
        free=free,
    )


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def nbytes(arrays: Mapping[str, np.ndarray]) -> int:
    """The bytes `arrays` need in a slot, each at an `ALIGN`ed offset (at least 1)."""
    total = 0
    for arr in arrays.values():
        total = -(-total // ALIGN) * ALIGN + arr.nbytes
    return max(total, 1)


def views(mm, places) -> dict[str, np.ndarray]:
    """The arrays at `places` (`(key, offset, dtype, shape)`) inside `mm` (or uint8)."""
    raw = mm if isinstance(mm, np.ndarray) else np.frombuffer(mm, np.uint8)
    return {
        key: np.ndarray(shape, dtype, raw, off) for key, off, dtype, shape in places
    }


def read(mm: Segment, places) -> dict[str, np.ndarray]:
    """Copies the arrays at `places` out of `mm` into new private arrays."""
    return {key: view.copy() for key, view in views(mm, places).items()}

"""Shared-memory segments in `/dev/shm`, and the arrays laid out in them.

Design notes: docs/reference/design.md#transport-segments.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Mapping

import numpy as np

from grain_cells import errors
from grain_cells.transport import _shm_names
from grain_cells.transport._mapping import Segment, map_shared

ALIGN = 64  # bytes: where each array of a slot starts (slot_writer too)


def create(name: str, size: int) -> Segment:
    """A new segment `name` of `size` bytes, reserved and mapped.

    `SharedMemoryFullError` (the name removed again) when there is no room.
    """
    path = _shm_names.path_of(name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        _reserve(fd, path, size)
        return map_shared(fd, size)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def _reserve(fd: int, path: str, size: int) -> None:
    """Allocates the segment's pages now, so that writes cannot fail later."""
    fallocate = getattr(os, "posix_fallocate", None)  # not on macOS
    if fallocate is None:
        return
    try:
        fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return  # no fallocate here: pages are allocated when written
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
            raise
        raise full_error(os.path.dirname(path), size) from None


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
    """Bytes in words: `256 KiB`, `1.5 GiB`."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} bytes"


def open_segment(name: str, size: int) -> Segment:
    """The first `size` bytes of the segment `name` (`FileNotFoundError`: gone)."""
    fd = os.open(_shm_names.path_of(name), os.O_RDWR)
    try:
        return map_shared(fd, size)
    finally:
        os.close(fd)


def layout(arrays: Mapping[str, np.ndarray]) -> tuple[list, int]:
    """`(key, offset, dtype, shape)` of each array, and the bytes they need."""
    places, total = [], 0
    for key, arr in arrays.items():
        offset = -(-total // ALIGN) * ALIGN
        places.append((key, offset, arr.dtype.str, arr.shape))
        total = offset + arr.nbytes
    return places, max(total, 1)


def write(mm: Segment, places, arrays: Mapping[str, np.ndarray]) -> None:
    """Copies `arrays` into `mm` at their `layout` places."""
    for (_, offset, dtype, shape), arr in zip(places, arrays.values(), strict=True):
        count = math.prod(shape)
        if count:
            dst = np.frombuffer(mm, dtype=dtype, count=count, offset=offset)
            dst[:] = arr.reshape(-1)


def read(mm: Segment, places) -> dict[str, np.ndarray]:
    """Copies the arrays at `places` out of `mm` into new private arrays."""
    out = {}
    for key, offset, dtype, shape in places:
        count = math.prod(shape)
        arr = np.empty(shape, dtype)
        if count:
            arr.reshape(-1)[:] = np.frombuffer(
                mm, dtype=dtype, count=count, offset=offset
            )
        out[key] = arr
    return out


__all__ = ["ALIGN", "Segment", "create", "layout", "open_segment", "read", "write"]

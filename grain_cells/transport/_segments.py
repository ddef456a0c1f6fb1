"""Shared-memory segments and the arrays laid out in them.

A segment is a POSIX shared-memory object, named `/gcells_<pid>_<token>_<n>`
(`shm_names`), made and opened here through public APIs: on Linux such an
object is a file in `/dev/shm`, so `os.open` with `O_CREAT | O_EXCL`,
`os.ftruncate` and `mmap` make it, and `os.unlink` removes it, exactly what
`shm_open`/`shm_unlink` do. (`multiprocessing.shared_memory` would register
every segment with its resource tracker, which unlinks and warns at exit in
the process that did not create it.)

A minibatch is a mapping of named arrays; `layout` places each at a 64-byte
aligned offset, `write` copies them in and `read` copies them out into
private memory.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Mapping

import numpy as np

from grain_cells.transport import _shm_names as shm_names

ALIGN = 64  # bytes: where each array of a slot starts (slot_writer too)


def create(name: str, size: int) -> mmap.mmap:
    """A new segment `name` of `size` bytes, mapped; fails if it exists."""
    fd = os.open(shm_names.path_of(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def open_segment(name: str, size: int) -> mmap.mmap:
    """The first `size` bytes of the existing segment `name`, mapped.

    Raises:
        FileNotFoundError: The segment is gone (its worker exited).
    """
    fd = os.open(shm_names.path_of(name), os.O_RDWR)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
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


def write(mm: mmap.mmap, places, arrays: Mapping[str, np.ndarray]) -> None:
    """Copies `arrays` into `mm` at their `layout` places."""
    for (_, offset, dtype, shape), arr in zip(places, arrays.values(), strict=True):
        count = math.prod(shape)
        if count:
            dst = np.frombuffer(mm, dtype=dtype, count=count, offset=offset)
            dst[:] = arr.reshape(-1)


def read(mm: mmap.mmap, places) -> dict[str, np.ndarray]:
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


__all__ = ["ALIGN", "create", "layout", "open_segment", "read", "write"]

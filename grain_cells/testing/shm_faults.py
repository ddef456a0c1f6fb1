"""A full `/dev/shm` in Grain's worker processes, without root.

A worker reserves every shared-memory slot it sends minibatches through
(`os.posix_fallocate`, see `grain_cells.transport._shm`); on a full
`/dev/shm` that reservation fails with ENOSPC and the trainer gets
`errors.SharedMemoryFullError`. Shrinking `/dev/shm` needs root (a mount),
so tests put `SharedMemoryLimit(limit_bytes)` first in a `grain.DataLoader`'s
operations instead: an identity transform that, when Grain unpickles it in a
worker, makes that worker's reservations fail with ENOSPC once they exceed
`limit_bytes`, as a file system of that size would. The trainer's process
is untouched (with `worker_count=0` nothing is limited).

Example:
  >>> loader = grain.DataLoader(  # doctest: +SKIP
  ...     data_source=source, sampler=sampler, worker_count=2,
  ...     operations=[SharedMemoryLimit(256 << 10),
  ...                 *grain_cells.fetch_operations(source, batch_size=64)])
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import threading

import grain

_lock = threading.Lock()
_reserved = [0]


def limit_reservations(limit_bytes: int) -> None:
    """Makes this process's `os.posix_fallocate` fail past `limit_bytes` in all.

    Only in a child process (a worker): a no-op in the trainer's.
    """
    if multiprocessing.parent_process() is None:
        return
    real = getattr(os.posix_fallocate, "real", os.posix_fallocate)

    def fallocate(fd: int, offset: int, length: int) -> None:
        with _lock:
            if _reserved[0] + length > limit_bytes:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            _reserved[0] += length
        real(fd, offset, length)

    fallocate.real = real
    os.posix_fallocate = fallocate


class SharedMemoryLimit(grain.transforms.Map):
    """Identity transform: unpickled in a worker, limits its shared memory.

    Attributes:
        limit_bytes: Bytes of segments the worker may reserve in all.
    """

    def __init__(self, limit_bytes: int):
        """Limits each worker to `limit_bytes` of reserved segments."""
        self.limit_bytes = int(limit_bytes)

    def __setstate__(self, state):
        self.__dict__.update(state)
        limit_reservations(self.limit_bytes)

    def map(self, element):
        """The element, unchanged."""
        return element

    def __repr__(self) -> str:
        return f"SharedMemoryLimit({self.limit_bytes})"

"""How many threads a process should read and decode with (design.md#util-cores)."""

from __future__ import annotations

import multiprocessing
import os
import warnings

from grain_cells import errors
from grain_cells._util import stack

MAX_READ_THREADS = 4

_worker_count: int | None = None


def available() -> int:
    """Cores this process may run on (Linux: its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def set_worker_count(count: int) -> None:
    """Records that this process is one of `count` workers (0: unknown)."""
    global _worker_count
    _worker_count = int(count) if count and count > 0 else None


def processes_sharing() -> int:
    """Reading processes this one shares its cores with, itself included."""
    if _worker_count is not None:
        return _worker_count
    if multiprocessing.parent_process() is not None:  # a worker never told
        return available()
    return 1


def read_threads(requested: int | str = "auto") -> int:
    """The read threads of this process for a `read_threads` argument."""
    if requested != "auto":
        return int(requested)
    return max(1, min(MAX_READ_THREADS, available() // processes_sharing()))


def warn_if_oversubscribed(worker_count: int) -> None:
    """Warns (`errors.WorkerCountWarning`) if `worker_count` exceeds the cores."""
    cores = available()
    if worker_count <= cores:
        return
    warnings.warn(
        f"worker_count={worker_count} is more than the {cores} cores this "
        "process may run on (os.sched_getaffinity): more worker processes "
        "than cores slow reading down (they take turns on the cores, and "
        "each holds its own read buffers and fetches in flight). Pass "
        f"worker_count={cores} or fewer.",
        errors.WorkerCountWarning,
        stacklevel=stack.stacklevel_outside_package(),
    )

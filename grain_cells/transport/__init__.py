"""Worker processes and the shared-memory slot ring minibatches travel in (private).

Module notes: docs/reference/design.md#transport-ring and the sections after it.
"""

from grain_cells._util.absl_flags import allow_unparsed as allow_unparsed_flags
from grain_cells._util.main_guard import main_thread_site
from grain_cells.transport._processes import (
    WorkerWatch,
    check_main_guard,
    death_error,
    fetch_starting,
    in_child_process,
    in_worker,
    main_guard_error,
    worker_init,
)
from grain_cells.transport._ring import release_dead_rings, ring_for, send, send_all
from grain_cells.transport._shm import remove_stale

__all__ = [
    "WorkerWatch",
    "allow_unparsed_flags",
    "check_main_guard",
    "death_error",
    "fetch_starting",
    "in_child_process",
    "in_worker",
    "main_guard_error",
    "main_thread_site",
    "release_dead_rings",
    "remove_stale",
    "ring_for",
    "send",
    "send_all",
    "worker_init",
]

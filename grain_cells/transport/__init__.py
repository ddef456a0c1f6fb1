"""Worker processes and the shared-memory slot ring minibatches travel in (private).

Module notes: docs/reference/design.md#transport-ring and the sections after it.
"""

from grain_cells._util.absl_flags import allow_unparsed as allow_unparsed_flags
from grain_cells.transport._children import WorkerWatch, death_error
from grain_cells.transport._main_guard import (
    check_main_guard,
    main_guard_error,
    main_thread_site,
)
from grain_cells.transport._ring import release_dead_rings
from grain_cells.transport._shm_names import remove_stale
from grain_cells.transport._slot_writer import (
    fetch_starting,
    in_worker,
    ring_for,
    send,
    send_all,
    worker_init,
)
from grain_cells.transport._worker import in_child_process

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

"""What a grain_cells worker process knows about itself and its parent.

Design notes: docs/reference/design.md#transport-worker.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable

from grain_cells._util import fork

# Exit status of a worker that outlived its parent (EX_SOFTWARE).
ORPHAN_EXIT_CODE = 70

_lock = threading.Lock()
_watcher: threading.Thread | None = None
_cleanups: list[Callable[[], None]] = []
_fetches_seen = 0  # fetches started in this process


@fork.in_child
def _forget_parent() -> None:
    """A forked child counts its own fetches (and owns no lock of the parent's)."""
    global _fetches_seen, _lock
    _fetches_seen = 0
    _lock = threading.Lock()


def in_child_process() -> bool:
    """Whether this process was started by `multiprocessing` (a worker)."""
    return multiprocessing.parent_process() is not None


def fetch_starting() -> None:
    """In a worker, freezes the GC's old objects once, at the second fetch."""
    global _fetches_seen
    if not in_child_process():
        return
    with _lock:
        _fetches_seen += 1
        seen = _fetches_seen
    if seen == 2:  # the imports are long-lived (see the design notes)
        gc.collect()
        gc.freeze()


def on_orphaned(cleanup: Callable[[], None]) -> None:
    """Runs `cleanup` before this process exits because its parent died."""
    with _lock:
        _cleanups.append(cleanup)


def exit_with_parent() -> None:
    """In a `multiprocessing` child: exit as soon as the parent is gone (idempotent)."""
    global _watcher
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    with _lock:
        if _watcher is None or not _watcher.is_alive():
            name = "grain_cells-exit-with-parent"
            _watcher = threading.Thread(
                target=_watch, args=(parent.sentinel,), name=name
            )
            _watcher.daemon = True
            _watcher.start()


def _watch(sentinel) -> None:
    multiprocessing.connection.wait([sentinel])
    with _lock:
        cleanups = list(_cleanups)
    for cleanup in cleanups:
        with contextlib.suppress(Exception):  # exiting anyway: free what we can
            cleanup()
    os._exit(ORPHAN_EXIT_CODE)

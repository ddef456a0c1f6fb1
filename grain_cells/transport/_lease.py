"""Minibatches handed to the user as arrays inside a worker's slot (leases).

Design notes: docs/reference/design.md#transport-lease.
"""

from __future__ import annotations

import logging
import os
import select
import weakref
from collections.abc import Callable

import numpy as np

from grain_cells.transport import _mapping
from grain_cells.transport._mapping import Segment

_log = logging.getLogger(__name__)
# id -> weak reference to the array a lease's views are cut from, while any
# view lives (NumPy arrays are not hashable: no WeakSet).
_LEASED: dict[int, weakref.ref] = {}


def _forget(ref: weakref.ref) -> None:
    _LEASED.pop(id(ref), None)


def lease(mm: Segment, places, on_release: Callable[[], None]) -> tuple[dict, object]:
    """The arrays at `places` of `mm` as views, and the weak reference to keep.

    `on_release` is called once, in whichever thread drops the last array, while
    the caller keeps the returned reference alive.
    """
    raw = np.frombuffer(mm, np.uint8)
    held = weakref.ref(raw, _forget)
    _LEASED[id(held)] = held
    out = {
        key: np.ndarray(shape, dtype, raw, offset)
        for key, offset, dtype, shape in places
    }
    return out, weakref.ref(raw, lambda _: on_release())


# The parent waits, right after a fork, until the child has made its leases
# private: until then the parent must not hand a slot back (the worker would
# rewrite it under the child's copy). A pipe made just before the fork: the
# child writes one byte once done; an exec closes its end (os.pipe is
# close-on-exec), a dead child's end closes at its exit: no wait for ever.
_fork_pipe: tuple[int, int] | None = None
_FORK_WAIT_S = 30.0


def _before_fork() -> None:
    global _fork_pipe
    _fork_pipe = os.pipe() if _LEASED else None


def _after_fork_in_parent() -> None:
    global _fork_pipe
    if _fork_pipe is None:
        return
    r, w = _fork_pipe
    _fork_pipe = None
    os.close(w)
    try:
        poller = select.poll()
        poller.register(r, select.POLLIN | select.POLLHUP)
        if not poller.poll(_FORK_WAIT_S * 1000):
            _log.warning(
                "grain_cells: a forked child did not copy its leased minibatches "
                "within %.0f s; the parent reads on",
                _FORK_WAIT_S,
            )
    finally:
        os.close(r)


def _privatise_leases() -> None:
    """In a forked child: every inherited leased slot becomes private memory."""
    global _fork_pipe
    try:
        for held in list(_LEASED.values()):
            raw = held()
            if raw is None:
                continue
            try:
                _mapping.privatise(raw.ctypes.data, raw.nbytes)
            except OSError:
                _log.exception("grain_cells: a forked child shares a leased slot")
    finally:
        if _fork_pipe is not None:
            r, w = _fork_pipe
            _fork_pipe = None
            os.close(r)
            try:
                os.write(w, b"x")
            finally:
                os.close(w)


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_privatise_leases,
)


__all__ = ["lease"]

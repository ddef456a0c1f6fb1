"""The trainer's side of the slot rings: one view per worker's ring, and leases.

A lease is a minibatch handed to the user as arrays inside a worker's slot.
Design notes: docs/reference/design.md#transport-views, #transport-lease.
"""

from __future__ import annotations

import array
import atexit
import collections
import contextlib
import logging
import os
import select
import socket
import threading
import weakref
from functools import partial

import numpy as np

from grain_cells._util import fork
from grain_cells.transport import _shm

_log = logging.getLogger(__name__)
RINGS: dict[str, _RingView] = {}  # ring name -> view; dead workers' are pruned
_RINGS_LOCK = threading.Lock()  # Grain may unpickle in several threads
_PRUNE_EVERY = 256
_opened = 0
_at_exit = None
_NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # a dead worker: raise, no SIGPIPE
MAX_SLOTS = 65535  # slot numbers travel as two-byte unsigned integers
_GROUP = 16  # most slots of ended leases held back to go in one send


def address(ring: str) -> str:
    """The abstract Unix socket name on which a ring takes slots back."""
    return "\0" + ring.lstrip("/")


def view_of(ring: str, pid: int) -> _RingView:
    """The view of worker `pid`'s ring `ring`, made on its first minibatch."""
    global _opened, _at_exit
    _opened += 1
    if _opened % _PRUNE_EVERY == 0:
        release_dead_rings()
    view = RINGS.get(ring)
    if view is None:
        with _RINGS_LOCK:
            view = RINGS.get(ring)
            if view is None:
                release_dead_rings()
                # Sockets closed before the interpreter goes (once per process).
                _at_exit = _at_exit or atexit.register(_close_views)
                view = RINGS[ring] = _RingView(ring, pid)
    return view


class _RingView:
    """The trainer's mappings of one worker's ring."""

    def __init__(self, ring: str, pid: int):
        self.pid = pid  # the worker's
        self.trainer = os.getpid()  # a forked child must hand nothing back
        self.prefix = ring[: -len("_ring")]
        self.sock: socket.socket | None = socket.socket(
            socket.AF_UNIX, socket.SOCK_SEQPACKET
        )
        try:
            self.sock.connect(address(ring))
        except OSError:  # the worker (and its socket) is gone
            self.close()
        self.slots: dict[int, tuple[str, _shm.Segment]] = {}
        self.leased: dict[int, object] = {}  # slot -> weakref handing it back
        self.pending: collections.deque[int] = collections.deque()  # to hand back
        self.group = 1  # ended leases sent together (a quarter of the budget)

    def open(self, slot: int, segment: str, size: int, layout, leases: int) -> dict:
        """A minibatch's arrays: leased within the budget, else copied out."""
        held = self.slots.get(slot)
        if held is None or held[0] != segment:
            held = self.slots[slot] = (segment, _shm.open_segment(segment, size))
            _shm.unlink(segment)
        mm = held[1]
        self.group = max(1, min(_GROUP, leases // 4))
        if len(self.pending) >= self.group:
            self.hand_back()  # a group, or what a full socket did not take
        # Slots waiting to go back are the trainer's too: within the budget.
        if len(self.leased) + len(self.pending) < leases:
            out, self.leased[slot] = lease(mm, layout, partial(self.lease_ended, slot))
            return out
        out = _shm.read(mm, layout)
        self.hand_back(slot)
        return out

    def lease_ended(self, slot: int) -> None:
        """The last array of a leased slot died (any thread): hand it back, grouped."""
        self.leased.pop(slot, None)
        if os.getpid() != self.trainer:
            return  # a forked child hands nothing back (see hand_back)
        self.pending.append(slot)
        if len(self.pending) >= self.group:
            self.hand_back()

    def hand_back(self, slot: int | None = None) -> None:
        """Returns a slot (and any pending) to the worker; never blocks, any thread."""
        if os.getpid() != self.trainer:
            return
        if slot is not None:
            self.pending.append(slot)
        freed = array.array("H")
        with contextlib.suppress(IndexError):  # popleft is atomic
            while True:
                freed.append(self.pending.popleft())
        sock = self.sock  # another thread may close the view meanwhile
        if not freed or sock is None:
            return
        try:  # one message: all of it or, the socket full, none (sent later)
            sock.send(freed.tobytes(), _NO_SIGNAL | socket.MSG_DONTWAIT)
        except BlockingIOError:
            self.pending.extend(freed)
        except OSError:  # the worker has exited, or closed its ring
            self.close()

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def release(self) -> None:  # leases keep their own mappings
        self.close()
        for held in (self.slots, self.leased, self.pending):
            held.clear()


def release_dead_rings() -> None:
    """Drops the views (each maps an fd) and names of workers that have exited."""
    views, poller = list(RINGS.items()), select.poll()
    for _, view in views:  # readable: the worker's end closed (it never writes)
        with contextlib.suppress(TypeError, ValueError, OSError):  # closed meanwhile
            poller.register(view.sock, select.POLLIN)
    hung_up = {fd for fd, _ in poller.poll(0)}
    for name, view in views:
        gone = (sock := view.sock) is None or sock.fileno() in hung_up
        if (gone or not _shm.alive(view.pid)) and RINGS.pop(name, None) is view:
            view.release()
            _shm.unlink_prefix(view.prefix)


@fork.in_child
def _forget_rings() -> None:
    """A forked child drops the parent's views and lock (a thread may have held it)."""
    global _RINGS_LOCK
    _RINGS_LOCK = threading.Lock()
    _close_views()
    RINGS.clear()


def _close_views() -> None:
    for view in list(RINGS.values()):
        view.close()


# id -> weakref to the array a lease's views are cut from (arrays: no WeakSet).
_LEASED: dict[int, weakref.ref] = {}


def lease(mm, places, on_release) -> tuple[dict, object]:
    """Views of `mm` at `places`; keep the weakref: it calls `on_release()` once."""
    raw = np.frombuffer(mm, np.uint8)
    held = weakref.ref(raw, lambda ref: _LEASED.pop(id(ref), None))
    _LEASED[id(held)] = held
    return _shm.views(raw, places), weakref.ref(raw, lambda _: on_release())


# After a fork the parent waits (on a pipe the child writes, closes on exec or
# exit) until the child has made its leases private before handing slots back.
_fork_pipe: tuple[int, int] | None = None
_FORK_WAIT_S = 30.0


def _before_fork() -> None:
    global _fork_pipe
    _fork_pipe = os.pipe() if _LEASED else None


def _after_fork_in_parent() -> None:
    global _fork_pipe
    if _fork_pipe is None:
        return
    (r, w), _fork_pipe = _fork_pipe, None
    os.close(w)
    poller = select.poll()
    poller.register(r, select.POLLIN)  # the child's end closed: POLLHUP
    if not poller.poll(_FORK_WAIT_S * 1000):
        _log.warning(
            "grain_cells: a forked child did not copy its leased minibatches "
            "within %.0f s; the parent reads on",
            _FORK_WAIT_S,
        )
    os.close(r)


def _privatise_leases() -> None:
    """In a forked child: every inherited leased slot becomes private memory."""
    global _fork_pipe
    try:
        for held in list(_LEASED.values()):
            if (raw := held()) is not None:
                try:
                    _shm.privatise(raw.ctypes.data, raw.nbytes)
                except OSError:
                    _log.exception("grain_cells: a forked child shares a leased slot")
    finally:
        if _fork_pipe is not None:  # done: the parent reads on
            (r, w), _fork_pipe = _fork_pipe, None
            os.close(r)
            os.close(w)


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_privatise_leases,
)

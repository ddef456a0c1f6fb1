"""The trainer's side of the slot rings: one view per worker's ring.

Design notes: docs/reference/design.md#transport-views.
"""

from __future__ import annotations

import array
import atexit
import collections
import contextlib
import os
import select
import socket
import threading
from functools import partial

from grain_cells._util import fork
from grain_cells.transport import _segments, _shm_names
from grain_cells.transport._lease import lease
from grain_cells.transport._mapping import Segment

# Ring name -> _RingView. Rings of dead workers are pruned.
RINGS: dict[str, _RingView] = {}
_RINGS_LOCK = threading.Lock()  # Grain may unpickle in several threads
_PRUNE_EVERY = 256
_opened = 0
# A send to a worker that has exited must raise, not raise SIGPIPE.
_NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
# Slots a ring may hold: numbers travel as two-byte unsigned integers.
MAX_SLOTS = 65535
# Most slots of ended leases held back to go in one send.
_GROUP = 16


def _group(leases: int) -> int:
    """Ended leases sent back together, for a ring lending `leases` slots."""
    return max(1, min(_GROUP, leases // 4))


def slot_numbers(data: bytes) -> memoryview:
    """The slot numbers in hand-back bytes (an even count of them)."""
    return memoryview(data).cast("H")


def address(ring: str) -> str:
    """The abstract Unix socket name on which a ring takes slots back."""
    return "\0" + ring.lstrip("/")


def view_of(ring: str, pid: int) -> _RingView:
    """The view of worker `pid`'s ring `ring`, made on its first minibatch."""
    global _opened
    _opened += 1
    if _opened % _PRUNE_EVERY == 0:
        _prune()
    view = RINGS.get(ring)
    if view is None:
        with _RINGS_LOCK:
            view = RINGS.get(ring)
            if view is None:
                _prune()
                _close_views_at_exit()
                view = RINGS[ring] = _RingView(ring, pid)
    return view


class _RingView:
    """The trainer's mappings of one worker's ring."""

    def __init__(self, ring: str, pid: int):
        self.pid = pid  # the worker's
        self.trainer = os.getpid()  # a forked child must hand nothing back
        self.prefix = ring[: -len("_ring")]
        self.sock: socket.socket | None = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM
        )
        try:
            self.sock.connect(address(ring))
        except OSError:  # the worker (and its socket) is gone
            self.close()
        self.slots: dict[int, tuple[str, Segment]] = {}
        # Slots whose arrays the user may hold, and the weak reference that
        # hands each back when they die.
        self.leased: dict[int, object] = {}
        self.pending: collections.deque[int] = collections.deque()  # to hand back
        self.group = 1  # ended leases sent together (`_group` of the budget)
        self.unsent = b""  # the tail of a send the socket took only part of
        self.sending = threading.Lock()  # one sender at a time (unsent's order)
        self.wanted = False  # a hand-back came while another thread sent

    def segment(self, slot: int, name: str, size: int) -> Segment:
        held = self.slots.get(slot)
        if held is None or held[0] != name:
            mm = _segments.open_segment(name, size)
            _shm_names.unlink(name)
            self.slots[slot] = (name, mm)
            return mm
        return held[1]

    def open(self, slot: int, segment: str, size: int, layout, leases: int) -> dict:
        """A minibatch's arrays: leased within the budget, else copied out."""
        mm = self.segment(slot, segment, size)
        self.group = _group(leases)
        if self.unsent or len(self.pending) >= self.group:
            self.hand_back()  # what the socket could not take at once, or a group
        # Slots waiting to go back are the trainer's too: within the budget.
        if len(self.leased) + len(self.pending) < leases:
            out, self.leased[slot] = lease(mm, layout, partial(self.lease_ended, slot))
            return out
        out = _segments.read(mm, layout)
        self.hand_back(slot)
        return out

    def lease_ended(self, slot: int) -> None:
        """The last array of a leased slot died (any thread): hand it back (grouped)."""
        self.leased.pop(slot, None)
        if os.getpid() != self.trainer:
            return  # a forked child hands nothing back (see hand_back)
        self.pending.append(slot)
        if len(self.pending) >= self.group:
            self.hand_back()

    def hand_back(self, slot: int | None = None) -> None:
        """Returns a slot (and any pending) to the worker; never blocks.

        May run from a finalizer in any thread; a forked child hands nothing back.
        """
        if os.getpid() != self.trainer:
            return
        if slot is not None:
            self.pending.append(slot)
        # A number is two bytes and a send may take one: a sender finishes
        # what it began before anything else goes. Another sender (another
        # thread, or a finalizer run inside this call) leaves its slot
        # pending and raises `wanted`; the sender, once it lets go, sends
        # again for it (else a slot that ended just as a send finished would
        # wait for the next minibatch).
        while True:
            self.wanted = True
            if not self.sending.acquire(blocking=False):
                return
            try:
                self.wanted = False
                self._send_pending()
            finally:
                self.sending.release()
            if not self.wanted or self.unsent or self.sock is None:
                return

    def _send_pending(self) -> None:
        while True:
            sock = self.sock  # another thread may close the view meanwhile
            if sock is None:
                self.pending.clear()
                return
            freed = array.array("H")
            with contextlib.suppress(IndexError):  # popleft is atomic
                while True:
                    freed.append(self.pending.popleft())
            data = self.unsent + freed.tobytes()
            if not data:
                return
            try:
                sent = sock.send(data, _NO_SIGNAL | socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:  # the worker has exited, or closed its ring
                self.close()
                return
            self.unsent = data[sent:]
            if self.unsent or not self.pending:
                return

    def close(self) -> None:
        """Closes the socket to the worker (its mappings go with the view)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def release(self) -> None:
        """Closes the socket and drops the mappings (leases keep their own)."""
        self.close()
        self.slots.clear()
        self.leased.clear()
        self.pending.clear()
        self.unsent = b""


def release_dead_rings() -> None:
    """Unmaps the slot rings of workers that have exited (each maps an fd)."""
    _prune()


def _prune() -> None:
    """Drops the rings whose worker has exited, and unlinks its names left over."""
    views = list(RINGS.items())
    hung_up = _hung_up([view.sock for _, view in views])
    for name, view in views:
        gone = view.sock is None or view.sock in hung_up
        if (gone or not _shm_names.alive(view.pid)) and RINGS.pop(name, None) is view:
            view.release()
            _shm_names.unlink_prefix(view.prefix)


def _hung_up(socks) -> set:
    """The sockets whose worker end is closed (the worker never writes)."""
    poller = select.poll()
    for sock in socks:
        if sock is not None:
            with contextlib.suppress(ValueError, OSError):  # closed meanwhile
                poller.register(sock, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(0)}
    return {sock for sock in socks if sock is not None and sock.fileno() in ready}


@fork.in_child
def _forget_rings() -> None:
    """A forked child drops the parent's views and lock (a thread may have held it)."""
    global _RINGS_LOCK
    _RINGS_LOCK = threading.Lock()
    for view in list(RINGS.values()):
        view.close()
    RINGS.clear()


def _close_views() -> None:
    for view in list(RINGS.values()):
        view.close()


def _close_views_at_exit() -> None:
    """Closes the views' sockets before the interpreter goes (once per process)."""
    global _at_exit
    if not _at_exit:
        atexit.register(_close_views)
        _at_exit = True


_at_exit = False

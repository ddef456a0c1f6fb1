"""A worker's slot ring, the handles minibatches travel as, and `SlotWriter`.

Design notes: docs/reference/design.md#transport-ring, #transport-slot-writer,
#transport-send.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing.util
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from grain_cells.transport import _processes, _shm, _views

_WAIT_S = 2.0
# Trainer side: ring name -> its view (`_views`), the same dict.
_RINGS = _views.RINGS
release_dead_rings = _views.release_dead_rings


class SlotRing:
    """A worker's reusable shared-memory slots (one ring per worker)."""

    def __init__(self, max_slots: int = 8, leases: int = 0):
        _shm.remove_stale()
        self._max_slots = min(max_slots, _views.MAX_SLOTS)  # grown by reserve()
        self._leases = min(leases, self._max_slots)
        self._prefix = _shm.new_prefix()
        self.name = self._prefix + "_ring"
        self._names: list[str] = []
        # `close` (the exit-with-parent thread) and name creation: one at a time.
        self._names_lock = threading.Lock()
        self._closed = False
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(_views.address(self.name))
        self._listener.listen(4)
        self._listener.setblocking(False)
        self._peers: list[socket.socket] = []
        self._slots: list[tuple[str, _shm.Segment, int]] = []  # name, map, size
        self._busy: list[bool] = []
        self._serial = 0
        self._largest = 0  # bytes of the largest minibatch sent
        self._starved = False  # a wait for a slot timed out; none handed back since
        multiprocessing.util.Finalize(self, self.close, exitpriority=10)
        _processes.on_orphaned(self.close)

    def reserve(self, n: int, leases: int = 0) -> None:
        """Lets the ring grow to `n` slots in flight plus `leases` lent (capped)."""
        self._max_slots = max(self._max_slots, min(n + leases, _views.MAX_SLOTS))
        lent = max(0, min(leases, self._max_slots - n))
        self._leases = max(self._leases, lent)

    def close(self) -> None:
        """Unlinks every name this ring made; no segment is made after this."""
        with self._names_lock:
            self._closed = True
            names, self._names = self._names, []
            for name in names:
                _shm.unlink(name)
            peers, self._peers = self._peers, []
            for sock in [self._listener, *peers]:
                with contextlib.suppress(OSError):
                    sock.close()

    def _create_named(self, size: int) -> tuple[str, _shm.Segment]:
        with self._names_lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: closed (the worker is exiting)")
            self._serial += 1
            name = f"{self._prefix}_{self._serial}"
            self._names.append(name)
            return name, _shm.create(name, size)

    def _collect(self, timeout: float) -> None:
        """Marks the slots handed back free, waiting up to `timeout` for one."""
        socks = {s.fileno(): s for s in [self._listener, *self._peers]}
        poller = select.poll()
        for fd in socks:
            poller.register(fd, select.POLLIN)
        ready = [socks[fd] for fd, _ in poller.poll(max(0, math.ceil(timeout * 1000)))]
        for sock in ready:
            if sock is self._listener:
                with contextlib.suppress(BlockingIOError):
                    peer = self._listener.accept()[0]
                    peer.setblocking(False)
                    self._peers.append(peer)
                continue
            while True:  # each message: whole two-byte slot numbers
                try:
                    freed = sock.recv(2 * _views.MAX_SLOTS)
                except BlockingIOError:
                    break
                except OSError:
                    freed = b""
                if not freed:  # the trainer closed its end
                    self._peers.remove(sock)
                    sock.close()
                    break
                for slot in memoryview(freed).cast("H"):
                    self._busy[slot] = False
                self._starved = False

    def _free_slot(self, nbytes: int, wait_s: float, avoid=None) -> int | None:
        self._collect(0)
        if self._starved:
            wait_s = 0.0  # waited in vain once: no more until a slot comes back
        deadline = None
        while True:
            free = [i for i, busy in enumerate(self._busy) if not busy and i != avoid]
            fits = [i for i in free if self._slots[i][2] >= nbytes]
            if fits:
                return fits[0]
            if free or len(self._slots) < self._max_slots:
                # A free slot too small gets a new segment, else a new slot.
                size = max(nbytes + nbytes // 4, 1 << 16)  # room to vary
                made = (*self._create_named(size), size)
                if free:
                    self._slots[free[0]] = made
                    return free[0]
                self._slots.append(made)
                self._busy.append(False)
                return len(self._slots) - 1
            deadline = deadline or time.monotonic() + wait_s
            left = deadline - time.monotonic()
            if left <= 0:
                self._starved = True
                return None
            self._collect(left)

    def room(self, nbytes: int = 0, wait_s: float | None = None, avoid=None):
        """`(slot, segment, one_off)` to write a minibatch of `nbytes` in.

        A free slot (not `avoid`; `nbytes` 0: the largest minibatch's size) within
        `wait_s`; else, `nbytes` given, a segment `one_off = (name, nbytes)` for
        this minibatch alone; else `(None, None, None)`.
        """
        wait_s = _WAIT_S if wait_s is None else wait_s
        size = nbytes or self._largest
        slot = self._free_slot(size, wait_s, avoid) if size else None
        if slot is not None:
            return slot, self._slots[slot][1], None
        if not nbytes:
            return None, None, None
        name, segment = self._create_named(nbytes)
        return None, segment, (name, nbytes)

    def put(self, arrays: Mapping, wait_s=None, avoid=None) -> SlotHandle:
        """`arrays` in a free slot (not `avoid`), else in a one-off segment."""
        return SlotWriter(self, _shm.nbytes(arrays), wait_s, avoid).send(arrays)

    def handle(self, slot, layout, nbytes: int, one_off=None) -> SlotHandle:
        """The handle of a minibatch written at `layout` in `slot` (or `one_off`)."""
        self._largest = max(self._largest, nbytes)
        if one_off is not None:
            return SlotHandle(None, -1, *one_off, layout, os.getpid(), 0)
        name, _, size = self._slots[slot]
        self._busy[slot] = True
        return SlotHandle(
            self.name, slot, name, size, layout, os.getpid(), self._leases
        )


class SlotHandle:
    """A minibatch waiting in a worker's slot; unpickles to a dict of arrays."""

    __slots__ = ("layout", "leases", "pid", "ring", "segment", "size", "slot")

    def __init__(self, ring, slot, segment, size, layout, pid, leases=0):
        self.ring, self.slot, self.segment = ring, slot, segment
        self.size, self.layout, self.pid = size, layout, pid
        self.leases = leases  # slots of the ring the trainer may hold

    def __reduce__(self):
        args = (self.ring, self.slot, self.segment, self.size, self.layout)
        return _receive, (*args, self.pid, self.leases)

    def __getitem__(self, key):
        raise TypeError(
            "this minibatch is a grain_cells shared-memory handle, meant to be "
            "pickled to the process that started the worker; it reached code "
            "in the worker itself. The fetch transform uses the slot ring when "
            "it is unpickled in a multiprocessing child: build the pipeline in "
            "the process that iterates it."
        )


class ExpiredBatch(dict):
    """A minibatch whose worker exited before it was received (Grain drops it)."""

    def __getitem__(self, key):
        raise RuntimeError(
            "this minibatch's shared memory was released before it was "
            "received: its Grain worker process exited (or was stopped)"
        )


def _receive(ring, slot, segment, size, layout, pid, leases=0) -> dict:
    """A minibatch out of shared memory: leased, or copied and handed back."""
    try:
        if ring is None:
            mm = _shm.open_segment(segment, size)
            _shm.unlink(segment)
            return _shm.read(mm, layout)  # unmapped when `mm` goes
        if _local_ring is not None and ring == _local_ring.name:
            _local_ring._busy[slot] = False  # Grain drains a worker's own queue
            return {}
        return _views.view_of(ring, pid).open(slot, segment, size, layout, leases)
    except FileNotFoundError:
        return ExpiredBatch()


_local_ring: SlotRing | None = None


def worker_ring(min_slots: int, leases: int = 0) -> SlotRing:
    """This process's ring, with room for `min_slots` plus `leases` lent slots."""
    global _local_ring
    if _local_ring is None:
        _local_ring = SlotRing()
    _local_ring.reserve(min_slots, leases)
    return _local_ring


# A fetch's minibatches are formatted as `format(i, empty) -> dict`.
Formatter = Callable[[int, Callable[..., np.ndarray]], dict]


def ring_for(minibatches_per_fetch: int) -> SlotRing:
    """This worker's ring: about four fetches in flight, three fetches and 8 leases."""
    n = int(minibatches_per_fetch)
    return worker_ring(max(4 * n + 8, 2 * n + 24), leases=3 * n + 8)


def send(format_minibatch: Formatter, i: int, ring: SlotRing) -> SlotHandle:
    """Minibatch `i` formatted straight into a slot of `ring`; its handle."""
    writer = SlotWriter(ring)
    return writer.send(format_minibatch(i, writer.empty))


def send_all(format_minibatch: Formatter, count: int) -> list[SlotHandle]:
    """A fetch's `count` minibatches, each written into a slot as formatted."""
    ring = ring_for(count)
    return [send(format_minibatch, i, ring) for i in range(count)]


class SlotWriter:
    """One minibatch formatted in a free slot of `ring` if one fits (no copy after).

    `empty` hands out arrays inside the slot (private memory once it is full);
    `send` copies in only the others. Arrays must not be used after `send`.
    `nbytes`: the minibatch's, known (`SlotRing.put`); else the largest sent.
    """

    def __init__(self, ring: SlotRing, nbytes=0, wait_s=None, avoid=None):
        self._ring = ring
        self._slot, segment, self._one_off = ring.room(nbytes, wait_s, avoid)
        self._used = self._size = self._base = 0
        if segment is not None:
            self._buf = np.frombuffer(segment, np.uint8)
            self._size = self._buf.size
            self._base = self._buf.__array_interface__["data"][0]

    def _take(self, nbytes: int) -> int | None:
        """The offset of `nbytes` more bytes of the slot, if they fit."""
        offset = -(-self._used // _shm.ALIGN) * _shm.ALIGN
        if not self._size or offset + nbytes > self._size:
            return None
        self._used = offset + nbytes
        return offset

    def empty(self, shape, dtype) -> np.ndarray:
        """An uninitialised array inside the slot (private when full)."""
        dtype = np.dtype(dtype)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        offset = None if dtype.hasobject else self._take(nbytes)
        if offset is None:
            return np.empty(shape, dtype)
        return self._buf[offset : offset + nbytes].view(dtype).reshape(shape)

    def send(self, arrays: Mapping[str, np.ndarray]) -> SlotHandle:
        """The handle of the minibatch `arrays` (written in the slot if not yet)."""
        layout = []
        for key, arr in arrays.items():
            arr = np.asarray(arr)
            offset = None
            if self._size and arr.flags.c_contiguous:  # in the slot?
                offset = arr.__array_interface__["data"][0] - self._base
                if offset < 0 or offset + arr.nbytes > self._used:
                    offset = None
            if offset is None:
                offset = self._take(arr.nbytes)
                if offset is None:  # full: everything into a slot that fits
                    wait_s = None if self._slot is None else 0.0
                    return self._ring.put(arrays, wait_s, avoid=self._slot)
                if arr.nbytes:
                    dst = self._buf[offset : offset + arr.nbytes].view(arr.dtype)
                    dst[:] = arr.reshape(-1)
            layout.append((key, offset, arr.dtype.str, arr.shape))
        return self._ring.handle(self._slot, layout, self._used, self._one_off)

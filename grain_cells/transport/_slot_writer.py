"""How a worker sends minibatches: formatted straight into a slot of its ring.

Design notes: docs/reference/design.md#transport-slot-writer, #transport-send.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from grain_cells._util import cores
from grain_cells.transport import _worker
from grain_cells.transport._ring import SlotHandle, SlotRing, worker_ring
from grain_cells.transport._segments import ALIGN

_in_worker = False
# A fetch's minibatches are formatted as `format(i, empty) -> dict`.
Formatter = Callable[[int, Callable[..., np.ndarray]], dict]


def worker_init(worker_index: int = 0, worker_count: int = 0) -> None:
    """Sets up a worker process (`mp_prefetch`'s `worker_init_fn`; idempotent)."""
    global _in_worker
    if _worker.in_child_process():
        cores.set_worker_count(worker_count)  # sizes read_threads="auto"
        _in_worker = True
        _worker.exit_with_parent()


def in_worker() -> bool:
    """Whether `worker_init` ran in this process (minibatches go via slots)."""
    return _in_worker


def fetch_starting() -> None:
    """Called as a worker starts a fetch (freezes the GC after the first)."""
    if _in_worker:
        _worker.fetch_starting()


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
    """

    def __init__(self, ring: SlotRing):
        self._ring = ring
        self._slot, segment, self._wait = ring.slot_to_write()
        self._used = self._size = self._base = 0
        if self._slot is not None:
            self._buf = np.frombuffer(segment, np.uint8)
            self._size = self._buf.size
            self._base = self._buf.__array_interface__["data"][0]

    def _take(self, nbytes: int) -> int | None:
        """The offset of `nbytes` more bytes of the slot, if they fit."""
        offset = -(-self._used // ALIGN) * ALIGN
        if self._slot is None or offset + nbytes > self._size:
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
            if self._slot is not None and arr.flags.c_contiguous:  # in the slot?
                offset = arr.__array_interface__["data"][0] - self._base
                if offset < 0 or offset + arr.nbytes > self._used:
                    offset = None
            if offset is None:
                offset = self._take(arr.nbytes)
                if offset is None:  # full: everything into a slot that fits
                    return self._ring.put(arrays, wait=self._wait, avoid=self._slot)
                if arr.nbytes:
                    dst = self._buf[offset : offset + arr.nbytes].view(arr.dtype)
                    dst[:] = arr.reshape(-1)
            layout.append((key, offset, arr.dtype.str, arr.shape))
        return self._ring.send_slot(self._slot, layout, self._used)


writer_for = SlotWriter

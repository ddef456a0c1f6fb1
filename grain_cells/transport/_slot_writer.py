"""Minibatches formatted straight into a worker's shared-memory slot.

Design notes: docs/reference/design.md#transport-slot-writer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from grain_cells.transport._mapping import Segment
from grain_cells.transport._ring import SlotHandle, SlotRing
from grain_cells.transport._segments import ALIGN


def writer_for(ring: SlotRing) -> SlotWriter:
    """A writer of the next minibatch, in a free slot of `ring` if one fits."""
    slot, segment, wait = ring.slot_to_write()
    return SlotWriter(ring, slot, segment, wait=wait)


class SlotWriter:
    """One minibatch formatted straight into a slot of the ring (no copy after).

    `empty` hands out arrays inside the slot (private memory once it is full);
    `send` copies in only the others. Arrays must not be used after `send`.
    """

    def __init__(
        self, ring: SlotRing, slot: int | None, segment: Segment | None, wait=True
    ):
        """Binds `slot` (None: all private) of `ring`; `wait` as `SlotRing.put`'s."""
        self._ring = ring
        self._slot = slot
        self._wait = wait
        self._used = 0
        self._size = 0
        self._base = 0
        if slot is not None:
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
        count = math.prod(shape)
        offset = None if dtype.hasobject else self._take(count * dtype.itemsize)
        if offset is None:
            return np.empty(shape, dtype)
        return (
            self._buf[offset : offset + count * dtype.itemsize]
            .view(dtype)
            .reshape(shape)
        )

    def _offset(self, arr: np.ndarray) -> int | None:
        """Where `arr` lies in the slot, if it is a contiguous piece of it."""
        if self._slot is None or not arr.flags.c_contiguous:
            return None
        offset = arr.__array_interface__["data"][0] - self._base
        if offset >= 0 and offset + arr.nbytes <= self._used:
            return offset
        return None

    def send(self, arrays: Mapping[str, np.ndarray]) -> SlotHandle:
        """The handle of the minibatch `arrays` (written in the slot if not yet)."""
        layout = []
        for key, arr in arrays.items():
            arr = np.asarray(arr)
            offset = self._offset(arr)
            if offset is None:
                offset = self._take(arr.nbytes)
                if offset is None:  # full: everything into a slot that fits
                    return self._ring.put(arrays, wait=self._wait, avoid=self._slot)
                if arr.nbytes:
                    dst = self._buf[offset : offset + arr.nbytes].view(arr.dtype)
                    dst[:] = arr.reshape(-1)
            layout.append((key, offset, arr.dtype.str, arr.shape))
        return self._ring.send_slot(self._slot, layout, self._used)

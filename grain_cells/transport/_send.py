"""What the pipeline sets up in a worker, and how a worker sends minibatches.

Design notes: docs/reference/design.md#transport-send.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from grain_cells._util import cores
from grain_cells.transport import _worker
from grain_cells.transport._ring import SlotHandle, SlotRing, worker_ring
from grain_cells.transport._slot_writer import writer_for

_in_worker = False

# A fetch's minibatches are formatted as `format(i, empty) -> dict`.
Formatter = Callable[[int, Callable[..., np.ndarray]], dict]


def worker_init(worker_index: int = 0, worker_count: int = 0) -> None:
    """Sets up a worker process (`mp_prefetch`'s `worker_init_fn`; idempotent).

    The count sizes the read threads; a fetch does not depend on the worker.
    """
    global _in_worker
    del worker_index
    if not _worker.in_child_process():
        return
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
    """This worker's ring: about four fetches in flight, three fetches and 8 leases.

    Slots are made only as they are needed.
    """
    n = int(minibatches_per_fetch)
    return worker_ring(max(4 * n + 8, 2 * n + 24), leases=3 * n + 8)


def send(format_minibatch: Formatter, i: int, ring: SlotRing) -> SlotHandle:
    """Minibatch `i` formatted straight into a slot of `ring`; its handle."""
    writer = writer_for(ring)
    return writer.send(format_minibatch(i, writer.empty))


def send_all(format_minibatch: Formatter, count: int) -> list[SlotHandle]:
    """A fetch's `count` minibatches, each written into a slot as formatted."""
    ring = ring_for(count)
    return [send(format_minibatch, i, ring) for i in range(count)]

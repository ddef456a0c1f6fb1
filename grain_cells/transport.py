"""Moving minibatches from Grain worker processes to the trainer, cheaply.

Grain copies every NumPy leaf of every element into a fresh POSIX
shared-memory segment. Fresh shared pages cost about 3.5 µs each to fault in,
so a 64-cell CSR minibatch (about 800 KB in 6 leaves) costs about 1.2 ms to
move: more than reading and shuffling it. Here each worker keeps a small ring
of slots, shared segments that stay mapped in both processes, and writes a
minibatch's arrays into one slot; what crosses Grain's queue is a small
handle. Unpickling the handle in the trainer maps the slot (once per slot),
copies the arrays out into ordinary private memory and frees the slot, so the
arrays a user holds never alias memory a worker will overwrite.

Lifetimes: a segment's name is unlinked as soon as the trainer has mapped it
(the mapping outlives the name), and every name a worker created is unlinked
when the worker exits. Segments of a worker that was SIGKILLed before it
handed them over are unlinked by the trainer when it notices the worker is
gone (Linux; it knows the ring's name from the worker's first minibatch).
When every slot is busy for `_WAIT_S` (the trainer is not consuming), the
worker sends a one-off segment that the trainer unlinks on receipt, so a
slow consumer never deadlocks a worker.
"""

from __future__ import annotations

import _posixshmem  # the stdlib's POSIX shm binding (multiprocessing uses it)
import contextlib
import mmap
import multiprocessing.util
import os
import secrets
import time
from collections.abc import Mapping

import numpy as np

# Slots a ring may grow to. Grain's DataLoader materialises a whole fetch
# (fan-out minibatches) before queueing any, so a ring needs about that many
# plus the queue's depth; beyond the cap a worker falls back to one-off segments.
_MAX_SLOTS = 128
_WAIT_S = 2.0
_ALIGN = 64

# Trainer side: ring name -> _RingView. Rings of dead workers are pruned.
_RINGS: dict[str, _RingView] = {}
_PRUNE_EVERY = 256
_unpacked = 0


def _layout(arrays: Mapping[str, np.ndarray]):
    layout, total = [], 0
    for key, arr in arrays.items():
        offset = -(-total // _ALIGN) * _ALIGN
        layout.append((key, offset, arr.dtype.str, arr.shape))
        total = offset + arr.nbytes
    return layout, max(total, 1)


def _create(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def _open(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_RDWR, 0o600)
    try:
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(name)


def _write(mm: mmap.mmap, layout, arrays: Mapping[str, np.ndarray]) -> None:
    for (_, offset, dtype, shape), arr in zip(layout, arrays.values(), strict=True):
        count = int(np.prod(shape, dtype=np.int64))
        if count:
            dst = np.frombuffer(mm, dtype=dtype, count=count, offset=offset)
            dst[:] = arr.reshape(-1)


def _read(mm: mmap.mmap, layout) -> dict[str, np.ndarray]:
    out = {}
    for key, offset, dtype, shape in layout:
        count = int(np.prod(shape, dtype=np.int64))
        arr = np.empty(shape, dtype)
        if count:
            arr.reshape(-1)[:] = np.frombuffer(
                mm, dtype=dtype, count=count, offset=offset
            )
        out[key] = arr
    return out


def in_grain_worker() -> bool:
    """Whether this code runs inside a Grain worker process right now.

    Only there are outputs pickled to the trainer, so only there may they
    travel as slot handles. Asked of Grain itself (its process-prefetch
    module sets a flag in its workers); if Grain ever drops that function,
    outputs stay plain dicts, which is always correct.
    """
    try:
        from grain._src.python.dataset.transformations import process_prefetch
    except ImportError:  # pragma: no cover - other Grain layouts
        return False
    check = getattr(process_prefetch, "is_in_worker_process", None)
    return bool(check()) if callable(check) else False


class SlotRing:
    """A worker's reusable shared-memory slots (one ring per worker)."""

    def __init__(self, max_slots: int = 8):
        self._max_slots = min(max_slots, _MAX_SLOTS)  # grown by reserve()
        self._prefix = f"/gcells_{os.getpid()}_{secrets.token_hex(4)}"
        self.state_name = self._prefix + "_state"
        self._state_mm = _create(self.state_name, _MAX_SLOTS)
        self._state = np.frombuffer(self._state_mm, np.uint8)
        self._slots: list[tuple[str, int, mmap.mmap]] = []
        self._names = [self.state_name]
        self._serial = 0
        multiprocessing.util.Finalize(self, self.close, exitpriority=10)

    def reserve(self, n: int) -> None:
        """Lets the ring grow to at least `n` slots (up to the hard cap)."""
        self._max_slots = max(self._max_slots, min(n, _MAX_SLOTS))

    def close(self) -> None:
        """Unlinks every name this ring created (mappings die with the process)."""
        for name in self._names:
            _unlink(name)
        self._names = []

    def _new_name(self) -> str:
        self._serial += 1
        name = f"{self._prefix}_{self._serial}"
        self._names.append(name)
        return name

    def _free_slot(self, nbytes: int) -> int | None:
        deadline = None
        while True:
            free = np.flatnonzero(self._state[: len(self._slots)] == 0)
            fits = [i for i in free.tolist() if self._slots[i][1] >= nbytes]
            if fits:
                return fits[0]
            if free.size:  # a free slot too small: replace its segment
                i = int(free[0])
                self._slots[i] = self._segment(nbytes)
                return i
            if len(self._slots) < self._max_slots:
                self._slots.append(self._segment(nbytes))
                return len(self._slots) - 1
            deadline = deadline or time.monotonic() + _WAIT_S
            if time.monotonic() > deadline:
                return None
            time.sleep(0.0005)

    def _segment(self, nbytes: int) -> tuple[str, int, mmap.mmap]:
        size = max(nbytes + nbytes // 4, 1 << 16)  # headroom for variable sizes
        name = self._new_name()
        return name, size, _create(name, size)

    def put(self, arrays: Mapping[str, np.ndarray]) -> SlotHandle:
        """Writes `arrays` into a free slot; returns the handle to send."""
        layout, nbytes = _layout(arrays)
        slot = self._free_slot(nbytes)
        if slot is None:  # every slot busy: a one-off segment
            name = self._new_name()
            mm = _create(name, nbytes)
            _write(mm, layout, arrays)
            mm.close()
            return SlotHandle(None, -1, name, nbytes, layout, os.getpid())
        name, size, mm = self._slots[slot]
        _write(mm, layout, arrays)
        self._state[slot] = 1
        return SlotHandle(self.state_name, slot, name, size, layout, os.getpid())


class SlotHandle:
    """A minibatch waiting in a worker's slot; unpickles to a dict of arrays."""

    __slots__ = ("layout", "pid", "ring", "segment", "size", "slot")

    def __init__(self, ring, slot, segment, size, layout, pid):
        self.ring, self.slot, self.segment = ring, slot, segment
        self.size, self.layout, self.pid = size, layout, pid

    def __reduce__(self):
        return (
            _receive,
            (self.ring, self.slot, self.segment, self.size, self.layout, self.pid),
        )


class _RingView:
    """The trainer's mappings of one worker's ring."""

    def __init__(self, state_name: str, pid: int):
        self.pid = pid
        self.prefix = state_name[: -len("_state")]
        self.state_mm = _open(state_name, _MAX_SLOTS)
        _unlink(state_name)
        self.state = np.frombuffer(self.state_mm, np.uint8)
        self.slots: dict[int, tuple[str, mmap.mmap]] = {}

    def segment(self, slot: int, name: str, size: int) -> mmap.mmap:
        held = self.slots.get(slot)
        if held is None or held[0] != name:
            mm = _open(name, size)
            _unlink(name)
            self.slots[slot] = (name, mm)
            return mm
        return held[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ExpiredBatch(dict):
    """Stands for a minibatch whose worker exited before it was received.

    Grain drains its queues when an iterator stops, after the worker has
    unlinked its segments; what is drained is discarded. If one ever reaches
    user code, touching it says what happened instead of returning data.
    """

    def __getitem__(self, key):
        raise RuntimeError(
            "this minibatch's shared memory was released before it was "
            "received: its Grain worker process exited (or was stopped)"
        )


def _receive(ring, slot, segment, size, layout, pid) -> dict[str, np.ndarray]:
    """Copies a minibatch out of shared memory and frees its slot."""
    try:
        return _receive_or_raise(ring, slot, segment, size, layout, pid)
    except FileNotFoundError:
        return ExpiredBatch()


def _receive_or_raise(ring, slot, segment, size, layout, pid):
    global _unpacked
    if ring is None:
        mm = _open(segment, size)
        _unlink(segment)
        try:
            return _read(mm, layout)
        finally:
            mm.close()
    if ring == getattr(_local_ring, "state_name", None):
        # Unpickled by the worker itself (Grain drains its own queue on stop).
        _local_ring._state[slot] = 0
        return {}
    view = _RINGS.get(ring)
    if view is None:
        _prune()
        view = _RINGS[ring] = _RingView(ring, pid)
    out = _read(view.segment(slot, segment, size), layout)
    view.state[slot] = 0
    _unpacked += 1
    if _unpacked % _PRUNE_EVERY == 0:
        _prune()
    return out


def release_dead_rings() -> None:
    """Unmaps the slot rings of workers that have exited (each maps an fd)."""
    _prune()


def _prune() -> None:
    """Drops the mappings of rings whose worker has exited.

    A worker that was killed could not unlink the segments it had made but not
    yet handed over; their names share the ring's prefix, so they go too.
    """
    for name, view in list(_RINGS.items()):
        if not _alive(view.pid):
            del _RINGS[name]
            _unlink_prefix(view.prefix)


def _unlink_prefix(prefix: str) -> None:
    """Unlinks every shared-memory name that starts with `prefix`."""
    folder = "/dev/shm"  # where Linux keeps POSIX shared memory names
    if not os.path.isdir(folder):
        return
    stem = prefix.lstrip("/")
    for entry in os.listdir(folder):
        if entry.startswith(stem + "_"):
            _unlink("/" + entry)


_local_ring: SlotRing | None = None


def worker_ring(min_slots: int) -> SlotRing:
    """This process's ring, created on first use with room for `min_slots`."""
    global _local_ring
    if _local_ring is None:
        _local_ring = SlotRing()
    _local_ring.reserve(min_slots)
    return _local_ring

"""What format readers share: positional reads at a `ByteLayout`, a chunk LRU.

Design notes: docs/reference/design.md#formats-positional.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import threading

import numpy as np

from grain_cells import errors
from grain_cells._util import fork
from grain_cells._util.ranges import chunk_pieces, nonempty
from grain_cells.formats._protocol import checked_ranges, naming_errors, run_parts
from grain_cells.storage import ByteReader, ShortReadError

_MIN_BYTES_PER_THREAD = 1 << 20  # below, a thread pool costs more than it saves
# What one layout costs beyond its offsets (object, dtype, tuples).
LAYOUT_OVERHEAD_BYTES = 512


@dataclasses.dataclass(frozen=True, eq=False)
class ByteLayout:
    """`chunk_rows` rows at each of `offsets` (contiguous: `chunk_length` None)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunk_rows: int
    offsets: np.ndarray
    chunk_length: int | None

    @property
    def nbytes(self) -> int:
        """Memory this layout holds (for bounds)."""
        return int(self.offsets.nbytes) + LAYOUT_OVERHEAD_BYTES


class PositionalReader:
    """A `RangeReader` of positional reads at a `ByteLayout` (`fd` not owned)."""

    decoded = False
    direct = True

    def __init__(self, layout: ByteLayout, path: str, fd: ByteReader):
        self.layout = self.byte_layout = layout  # what the layout cache keeps
        self.name = layout.name
        self.path = path
        self.dtype = layout.dtype
        self.shape = layout.shape
        self.row_shape = layout.shape[1:]
        self._row_bytes = math.prod(self.row_shape) * self.dtype.itemsize
        self._fd = fd
        self.remote = bool(getattr(fd, "remote", False))
        self.chunk_length = layout.chunk_length

    def pin(self) -> None:
        with naming_errors(self):
            self._fd.pin(*self.pin_pieces())

    def pin_pieces(self) -> tuple[list[int], list[int]]:
        """`(offsets, nbytes)` of every chunk: what `pin` reads."""
        length = min(self.layout.chunk_rows, max(self.shape[0], 1)) * self._row_bytes
        offsets = self.layout.offsets.tolist()
        return offsets, [length] * len(offsets)

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        starts, stops = nonempty(starts, stops)
        if starts.size:
            offsets, nbytes = self.pieces(starts, stops)
            self._fd.advise(offsets.tolist(), nbytes.tolist())

    def read(self, starts, stops, out, pool=None, pending=None) -> None:
        starts, stops = checked_ranges(self, starts, stops)
        if not starts.size:
            return  # (every read completes before returning: no `pending`)
        offsets, nbytes = self.pieces(starts, stops)
        dest = dest_bytes(out, nbytes)
        dest_starts = np.cumsum(nbytes) - nbytes
        o, n, d = offsets.tolist(), nbytes.tolist(), dest_starts.tolist()

        def task(a, b):
            self._pread_all(dest, o[a:b], n[a:b], d[a:b])

        # A remote reader runs its own GETs concurrently: pool threads would
        # only add GIL hand-offs.
        pool = None if self._fd.remote else pool
        limits = dict(
            max_tasks=getattr(pool, "threads", 4), min_bytes=_MIN_BYTES_PER_THREAD
        )
        with naming_errors(self):
            for a, b in run_parts(pool, nbytes.size, task, sizes=nbytes, **limits):
                task(a, b)

    def pieces(self, starts: np.ndarray, stops: np.ndarray):
        """Ranges cut at chunk boundaries, adjacent pieces merged: (offsets, nbytes)."""
        chunk, src, _, rows = pieces(starts, stops, self.layout.chunk_rows)
        offsets = self.layout.offsets[chunk] + src * self._row_bytes
        nbytes = rows * self._row_bytes
        if offsets.size > 1:
            joins = offsets[1:] == offsets[:-1] + nbytes[:-1]
            if joins.any():
                heads = np.concatenate([[0], np.flatnonzero(~joins) + 1])
                nbytes = np.add.reduceat(nbytes, heads)
                offsets = offsets[heads]
        return offsets, nbytes

    def _pread_all(self, dest, offsets, nbytes, dest_starts) -> None:
        try:
            self._fd.read_into(dest, offsets, nbytes, dest_starts)
        except ShortReadError as e:
            raise truncated(self, e) from None


def pieces(starts, stops, c: int):
    """`(chunk, first row in it, in the destination, rows)` of each `c`-row piece."""
    chunk, p_start, p_stop = chunk_pieces(starts, stops, c)
    n = p_stop - p_start
    return chunk, p_start - chunk * c, np.cumsum(n) - n, n


def dest_bytes(out: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """`out` as bytes, checked to hold `nbytes` (`ValueError`)."""
    dest, total = out.reshape(-1).view(np.uint8), int(nbytes.sum())
    if total > dest.size:
        raise ValueError(
            f"destination holds {dest.size} bytes, the ranges need {total}"
        )
    return dest


def truncated(reader, e: ShortReadError, what: str = "data") -> errors.CorruptDataError:
    """The error of a read past the end of `reader`'s file."""
    return errors.CorruptDataError(
        f"{reader.path}: {reader.name} ends at byte {e.end_of_file} of the "
        f"file but HDF5 places {what} up to byte {e.needed}: the file is "
        "truncated."
    )


class ChunkCache:
    """Decoded chunks keyed by (reader token, chunk), least recently used evicted."""

    def __init__(self):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self.nbytes = 0  # decoded bytes held
        self._lock = threading.Lock()
        self._dropped: list[int] = []  # readers closed, their chunks not yet gone
        self.token = itertools.count().__next__  # a key prefix per reader
        fork.in_child_of(self, ChunkCache._empty)

    def _empty(self) -> None:
        """A forked child's cache: empty, with a lock no parent thread holds."""
        self._entries = collections.OrderedDict()
        self.nbytes = 0
        self._dropped = []
        self._lock = threading.Lock()

    def get(self, token: int, k: int) -> np.ndarray | None:
        """Chunk `k` of reader `token`, or None; marks it recently used."""
        with self._lock:
            self._forget()
            chunk = self._entries.get((token, k))
            if chunk is not None:
                self._entries.move_to_end((token, k))
            return chunk

    def put(self, token: int, k: int, chunk: np.ndarray, budget: int) -> None:
        """Keeps `chunk`, evicting the least recently used past `budget` bytes."""
        if chunk.nbytes > budget:
            return
        with self._lock:
            self._forget()
            old = self._entries.pop((token, k), None)
            self.nbytes += chunk.nbytes - (0 if old is None else old.nbytes)
            self._entries[(token, k)] = chunk
            while self.nbytes > budget:
                self.nbytes -= self._entries.popitem(last=False)[1].nbytes

    def drop(self, token: int) -> None:
        """Forgets reader `token`'s chunks (closed); a busy lock leaves it to `get`."""
        self._dropped.append(token)  # atomic: needs no lock
        if self._lock.acquire(blocking=False):
            try:
                self._forget()
            finally:
                self._lock.release()

    def _forget(self) -> None:
        """Removes the chunks of dropped readers (the lock held)."""
        while self._dropped:
            token = self._dropped.pop()
            for key in [key for key in self._entries if key[0] == token]:
                self.nbytes -= self._entries.pop(key).nbytes

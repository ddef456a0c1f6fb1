"""Positional reads of an array whose bytes lie at known file offsets.

`ByteLayout` says where (pure data, valid across a reopen of the same
bytes), `PositionalReader` reads ranges there through a `ByteReader`, and
`run_parts` splits any reader's work over a pool.

Design notes: docs/reference/design.md#formats-positional.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import chunk_pieces, nonempty
from grain_cells.formats._protocol import checked_ranges, wait_all
from grain_cells.storage import ByteReader, ShortReadError

# Below this many bytes a thread pool costs more than it saves.
_MIN_BYTES_PER_THREAD = 1 << 20
# What one layout costs beyond its offsets (object, dtype, tuples): for
# the bound on the layouts a process remembers.
LAYOUT_OVERHEAD_BYTES = 512


def run_parts(
    pool,
    n: int,
    task,
    pending: list | None = None,
    *,
    max_tasks: int = 16,
    sizes: np.ndarray | None = None,
    min_bytes: int = 1,
) -> list[tuple[int, int]]:
    """Splits `task(a, b)` over `[0, n)` into parts run in `pool`.

    At most `max_tasks` parts of equal count, or of equal `sizes` (bytes per
    item) of at least `min_bytes` each. The futures go to `pending` when
    given (the caller waits), else are waited for here (`wait_all`). Returns
    the part the caller runs in its own thread (`[(0, n)]`: no pool, or too
    little work; else none), so that this layer never calls a format's code:
    `for a, b in run_parts(pool, n, task): task(a, b)`.
    """
    total = 0 if sizes is None else int(sizes.sum())
    n_tasks = (
        min(n, max_tasks) if sizes is None else min(max_tasks, n, total // min_bytes)
    )
    if pool is None or n_tasks < 2:
        return [(0, n)] if n else []
    if sizes is None:
        bounds = np.linspace(0, n, n_tasks + 1).astype(int).tolist()
    else:
        targets = np.linspace(0, total, n_tasks + 1)[1:-1]
        bounds = [0, *np.searchsorted(np.cumsum(sizes), targets).tolist(), n]
    futures = [pool.submit(task, a, b) for a, b in itertools.pairwise(bounds) if b > a]
    if pending is not None:
        pending.extend(futures)
    else:
        wait_all(futures)  # none still writes into the caller's buffer
    return []


@dataclasses.dataclass(frozen=True, eq=False)
class ByteLayout:
    """Where an array's bytes lie in its file.

    Attributes:
        name: The array's path inside the file, for messages.
        dtype: The stored (and read) dtype: native order, no conversion.
        shape: The array's shape.
        chunk_rows: Rows per piece at `offsets[i]` (contiguous: all, >= 1).
        offsets: File offset of each piece (int64).
        chunk_length: Rows per stored chunk; None when contiguous.
    """

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
    """A `formats.RangeReader` of positional reads at a `ByteLayout`.

    Thread-safe (positional reads share one `ByteReader`).
    """

    decoded = False
    direct = True

    def __init__(self, layout: ByteLayout, path: str, fd: ByteReader):
        """Reads nothing; `fd` is the file's `ByteReader` (its owner closes it)."""
        self.layout = layout
        self.name = layout.name
        self.path = path
        self.dtype = layout.dtype
        self.shape = layout.shape
        self.row_shape = layout.shape[1:]
        self._row_bytes = math.prod(self.row_shape) * self.dtype.itemsize
        self._fd = fd

    @property
    def remote(self) -> bool:
        """Whether bytes come from an object store."""
        return bool(getattr(self._fd, "remote", False))

    @property
    def chunk_length(self) -> int | None:
        """Rows per stored chunk; None when contiguous."""
        return self.layout.chunk_length

    def pin(self) -> None:
        """Asks the storage to keep the whole array at hand (`ByteReader.pin`)."""
        layout = self.layout
        length = min(layout.chunk_rows, max(self.shape[0], 1)) * self._row_bytes
        offsets = layout.offsets.tolist()
        self._fd.pin(offsets, [length] * len(offsets))

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Hints the storage to start reading these ranges (returns at once)."""
        starts, stops = nonempty(starts, stops)
        if starts.size == 0:
            return
        offsets, nbytes = self.pieces(starts, stops)
        self._fd.advise(offsets.tolist(), nbytes.tolist())

    def read(self, starts, stops, out, pool=None, pending=None) -> None:
        """`formats.RangeReader.read` with positional reads.

        Raises:
            errors.CorruptDataError: Rows outside the array, or a truncated file.
        """
        del pending  # every read completes before returning
        starts, stops = checked_ranges(self, starts, stops)
        if starts.size == 0:
            return
        self.read_merged(starts, stops, out, pool)

    def pieces(self, starts: np.ndarray, stops: np.ndarray):
        """Splits ranges at chunk boundaries: (file offsets, byte counts)."""
        c = self.layout.chunk_rows
        chunk, p_start, p_stop = chunk_pieces(starts, stops, c)
        offsets = self.layout.offsets[chunk] + (p_start - chunk * c) * self._row_bytes
        nbytes = (p_stop - p_start) * self._row_bytes
        # Pieces adjacent both in the file and in the destination merge.
        if offsets.size > 1:
            joins = offsets[1:] == offsets[:-1] + nbytes[:-1]
            if joins.any():
                heads = np.concatenate([[0], np.flatnonzero(~joins) + 1])
                nbytes = np.add.reduceat(nbytes, heads)
                offsets = offsets[heads]
        return offsets, nbytes

    def read_merged(self, starts, stops, out, pool) -> None:
        """Reads checked, merged ranges into `out` (threads for large reads)."""
        offsets, nbytes = self.pieces(starts, stops)
        dest = out.reshape(-1).view(np.uint8)
        total = int(nbytes.sum())
        if total > dest.size:
            raise ValueError(
                f"destination holds {dest.size} bytes, the ranges need {total}"
            )
        dest_starts = np.cumsum(nbytes) - nbytes

        # A remote reader runs its own GETs concurrently and copies what
        # read-ahead holds with the GIL held: splitting its read over the
        # pool's threads only adds GIL hand-offs (a third of a 0-worker
        # reader's time went waiting on them).
        def task(a, b):
            self._pread_all(
                dest,
                offsets[a:b].tolist(),
                nbytes[a:b].tolist(),
                dest_starts[a:b].tolist(),
            )

        for a, b in run_parts(
            None if self._fd.remote else pool,
            nbytes.size,
            task,
            max_tasks=getattr(pool, "threads", 4),  # file_set.ReadPool
            sizes=nbytes,
            min_bytes=_MIN_BYTES_PER_THREAD,
        ):
            task(a, b)

    def _pread_all(
        self,
        dest: np.ndarray,
        offsets: Sequence[int],
        nbytes: Sequence[int],
        dest_starts: Sequence[int],
    ) -> None:
        try:
            self._fd.read_into(dest, offsets, nbytes, dest_starts)
        except ShortReadError as e:
            raise errors.CorruptDataError(
                f"{self.path}: {self.name} ends at byte {e.end_of_file} of the "
                f"file but HDF5 places data up to byte {e.needed}: the file is "
                "truncated."
            ) from None


__all__ = ["ByteLayout", "PositionalReader", "run_parts"]

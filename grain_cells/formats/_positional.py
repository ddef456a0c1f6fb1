"""Positional reads of an array whose bytes lie at known file offsets.

An array stored uncompressed (contiguous, or in whole-row chunks at known
offsets) is read with positional reads of its file's `ByteReader`, with no
format library in between. `ByteLayout` is where those bytes are: pure
data (a few ints and one offset per chunk), so a process that learnt it
once can read the array again, after the file was closed and reopened, from
the `ByteReader` alone (`grain_cells.io._file_set`). `PositionalReader` is
the `RangeReader` over it; a format's reader hands its direct reads to one
(`grain_cells.hdf5._reads.RangeReader`).

Design notes: docs/reference/design.md#formats-positional.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import nonempty
from grain_cells.formats._protocol import checked_ranges, wait_all
from grain_cells.storage import ByteReader, ShortReadError

# Below this many bytes a thread pool costs more than it saves.
_MIN_BYTES_PER_THREAD = 1 << 20
# What one layout costs beyond its offsets (object, dtype, tuples): for
# the bound on the layouts a process remembers.
LAYOUT_OVERHEAD_BYTES = 512


@dataclasses.dataclass(frozen=True, eq=False)
class ByteLayout:
    """Where an array's bytes lie in its file.

    Attributes:
        name: The array's path inside the file, for messages.
        dtype: The stored (and read) dtype: native order, no conversion.
        shape: The array's shape.
        chunk_rows: First-axis rows per piece at `offsets[i]` (the whole
            array, at least 1, when contiguous).
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
        """Reads nothing.

        Args:
            layout: Where the bytes are.
            path: The file, for messages.
            fd: The file's `ByteReader` (not owned: its owner closes it).
        """
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
            errors.CorruptDataError: Rows outside the array, or the file
                ends before the data does (truncated).
        """
        del pending  # every read completes before returning
        starts, stops = checked_ranges(self, starts, stops)
        if starts.size == 0:
            return
        self.read_merged(starts, stops, out, pool)

    def pieces(self, starts: np.ndarray, stops: np.ndarray):
        """Splits ranges at chunk boundaries: (file offsets, byte counts)."""
        c = self.layout.chunk_rows
        row_bytes = self._row_bytes
        first = starts // c
        last = (stops - 1) // c
        n_pieces = last - first + 1
        total = int(n_pieces.sum())
        if total == starts.size:
            chunk = first
            p_start, p_stop = starts, stops
        else:
            owner = np.repeat(np.arange(starts.size), n_pieces)
            within = np.arange(total) - np.repeat(
                np.cumsum(n_pieces) - n_pieces, n_pieces
            )
            chunk = first[owner] + within
            p_start = np.maximum(starts[owner], chunk * c)
            p_stop = np.minimum(stops[owner], (chunk + 1) * c)
        offsets = self.layout.offsets[chunk] + (p_start - chunk * c) * row_bytes
        nbytes = (p_stop - p_start) * row_bytes
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
        ends = np.cumsum(nbytes)
        total = int(ends[-1]) if ends.size else 0
        if total > dest.size:
            raise ValueError(
                f"destination holds {dest.size} bytes, the ranges need {total}"
            )
        fd = self._fd
        # A remote reader runs its own GETs concurrently and copies what
        # read-ahead holds with the GIL held: splitting its read over the
        # pool's threads only adds GIL hand-offs (a third of a 0-worker
        # reader's time went waiting on them).
        if (
            pool is None
            or total < 2 * _MIN_BYTES_PER_THREAD
            or nbytes.size < 2
            or fd.remote
        ):
            dest_starts = (ends - nbytes).tolist()
            self._pread_all(dest, offsets.tolist(), nbytes.tolist(), dest_starts)
            return
        dest_starts = ends - nbytes
        n_jobs = min(
            getattr(pool, "threads", 4),  # file_set.ReadPool
            nbytes.size,
            total // _MIN_BYTES_PER_THREAD,
        )
        cuts = np.searchsorted(ends, np.linspace(0, total, n_jobs + 1)[1:-1])
        bounds = [0, *cuts.tolist(), nbytes.size]
        futures = [
            pool.submit(
                self._pread_all,
                dest,
                offsets[a:b].tolist(),
                nbytes[a:b].tolist(),
                dest_starts[a:b].tolist(),
            )
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]
        wait_all(futures)  # none still writes into `out` once this returns

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


__all__ = ["ByteLayout", "PositionalReader"]

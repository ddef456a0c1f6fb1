"""Batched reads of many element ranges from one zarr array.

A `RangeReader` has the interface of `grain_cells.hdf5._reads.RangeReader`,
so `grain_cells.io` reads CSR and dense matrices of zarr stores with the same
code as those of `.h5ad` files: sorted, disjoint ranges of the first axis
into one contiguous destination.

This first version reads each run of touching chunks with one zarr-python
slice (zarr fetches and decodes that run's chunks concurrently).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import zarr

from grain_cells import errors
from grain_cells._util.ranges import merge_touching


class RangeReader:
    """Reads sorted, disjoint ranges of a zarr array's first axis.

    Example:
        >>> reader = RangeReader(group["X/data"], "/data/a.zarr")
        >>> out = np.empty(30, reader.dtype)
        >>> reader.read(np.array([0, 100]), np.array([10, 120]), out)
    """

    def __init__(self, array: zarr.Array, path: str, fd=None, *, cache_bytes: int = 0):
        """Inspects the array's metadata once.

        Args:
            array: An open 1-D or 2-D zarr array.
            path: The store's path or URL, for error messages.
            fd: Unused (the h5ad reader's byte reader); zarr reads through
                the array's own store.
            cache_bytes: Decoded bytes kept in an LRU cache (for small
                arrays every read touches, such as `indptr`).
        """
        del fd, cache_bytes
        self.name = "/" + array.path if not array.path.startswith("/") else array.path
        self.path = path
        self.dtype = np.dtype(array.dtype).newbyteorder("=")
        self.shape = tuple(array.shape)
        self.row_shape = self.shape[1:]
        self._array = array

    @property
    def direct(self) -> bool:
        """Whether reads bypass the format library (never, for zarr)."""
        return False

    @property
    def remote(self) -> bool:
        """Whether bytes come from an object store (each read a round trip)."""
        return False

    @property
    def chunk_length(self) -> int | None:
        """Rows (first-axis elements) per chunk (inner chunk when sharded)."""
        return int(self._array.chunks[0])

    @property
    def decoded(self) -> bool:
        """Whether compressed chunks are decoded here, in threads."""
        return False

    def will_need(self) -> None:
        """Warms caches for an array every batch touches (a no-op for now)."""

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Hints that these ranges will be read soon (a no-op for now)."""

    def read(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        out: np.ndarray,
        pool: concurrent.futures.Executor | None = None,
        pending: list[concurrent.futures.Future] | None = None,
    ) -> None:
        """Reads rows `[starts[i], stops[i])` for all i, concatenated, into `out`.

        Args:
            starts: Sorted first rows of each range (int64).
            stops: Matching ends, exclusive; ranges must not overlap.
            out: Contiguous destination with at least `sum(stops - starts)`
                rows of this array's dtype and row shape.
            pool: Unused for now.
            pending: Unused: reads complete before returning.

        Raises:
            errors.CorruptDataError: Rows outside the array were asked for.
        """
        del pool, pending
        starts = np.asarray(starts, np.int64)
        stops = np.asarray(stops, np.int64)
        keep = stops > starts
        starts, stops = starts[keep], stops[keep]
        if starts.size == 0:
            return
        if stops[-1] > self.shape[0] or starts[0] < 0:
            raise errors.CorruptDataError(
                f"{self.path}: {self.name} has {self.shape[0]} elements but rows "
                f"[{starts.min()}, {stops.max()}) were asked for."
            )
        starts, stops = merge_touching(starts, stops)
        at = 0
        for a, b in zip(starts.tolist(), stops.tolist()):
            out[at : at + b - a] = self._array[a:b]
            at += b - a

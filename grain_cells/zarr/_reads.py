"""Batched reads of sorted row ranges of one zarr array (a `formats.RangeReader`).

Design notes: docs/reference/design.md#zarr-reads.
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings

import numpy as np
import zarr

from grain_cells import errors
from grain_cells._util import fork
from grain_cells._util.ranges import chunk_pieces, chunks_touched, merge_touching
from grain_cells.formats import checked_ranges, run_parts
from grain_cells.zarr import _raw
from grain_cells.zarr._chunks import Chunks
from grain_cells.zarr._codecs import Codec
from grain_cells.zarr._keys import KeyReader
from grain_cells.zarr._store import check_array


class RangeReader:
    """Reads sorted, disjoint ranges of a zarr array's first axis. Thread-safe."""

    def __init__(
        self,
        array: zarr.Array,
        path: str,
        fd=None,
        *,
        cache_bytes: int = 0,
        fill_missing: bool | str = False,
    ):
        """Checks `array` against its own metadata document; `fd` is unused.

        `cache_bytes`: decoded bytes kept (arrays every read touches: `indptr`).
        `fill_missing`: read a never-written chunk as the fill value instead
        of raising: True for any, `"leading"` before the first stored row
        chunk, `"zero"` for any when the fill value is 0 (`filled_ranges`).

        Raises:
            errors.AnnDataFormatError: The consolidated metadata disagrees.
        """
        del fd
        array = check_array(array, path)
        self.name = "/" + array.path.lstrip("/")
        self.path = path
        self.dtype = np.dtype(array.dtype).newbyteorder("=")
        self.shape = tuple(array.shape)
        self.row_shape = self.shape[1:]
        if fill_missing == "zero":
            fill_missing = not array.metadata.fill_value  # None or 0
        self.fill_missing = (
            fill_missing if fill_missing == "leading" else bool(fill_missing)
        )
        self._array = array
        self._cache_bytes = int(cache_bytes)
        self._all_written: bool | None = None
        self._checked = False
        self._check_lock = threading.Lock()
        fork.in_child_of(self, RangeReader._new_lock)
        codec = Codec.for_array(array) if array.ndim in (1, 2) else None
        keys = KeyReader.for_store(array.store) if codec else None
        self._chunks: Chunks | None = None
        self._codec: Codec | None = None
        self._raw: _raw.RawReads | None = None
        if keys is not None:
            self._codec = codec
            self._chunks = Chunks(
                array,
                path,
                codec,
                keys,
                cache_bytes=cache_bytes,
                fill_missing=fill_missing,
            )
            if _raw.applies(codec, keys, self.shape, self._cache_bytes):
                self._raw = _raw.RawReads(self._chunks, codec, keys)

    @property
    def direct(self) -> bool:
        """Whether reads bypass zarr-python (chunks fetched and decoded here)."""
        return self._codec is not None

    @property
    def remote(self) -> bool:
        """Whether bytes come from an object store (each read a round trip)."""
        if self._chunks is not None:
            return self._chunks.keys.remote
        return isinstance(self._array.store, zarr.storage.ObjectStore)

    @property
    def chunk_length(self) -> int | None:
        """Rows (first-axis elements) per chunk (inner chunk when sharded)."""
        if self._codec is not None:
            return int(self._codec.chunk_shape[0])
        return int(self._array.chunks[0])

    @property
    def decoded(self) -> bool:
        """Whether compressed chunks are decoded here, in threads."""
        return self._codec is not None

    def filled_ranges(self) -> list[tuple[int, int, str]]:
        """`(first, stop, key)` of each chunk read so far as the fill value."""
        if self._chunks is None:  # zarr-python's reads: not recorded
            return []
        filled = sorted(self._chunks.filled.items())
        return [(*self._chunks.rows(k), key) for k, key in filled]

    def pin(self) -> None:
        """Reads every shard index, and the whole array if it fits `cache_bytes`."""
        if self._codec is None:
            return
        n = -(-self.shape[0] // self._codec.chunk_shape[0])
        if self._codec.shard is not None:
            self._chunks.load_shard_indices(self._chunks.shards_of(range(n)))
        row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        if (
            self.shape[0] > 0
            and n * self._codec.chunk_shape[0] * row_bytes <= self._cache_bytes
        ):
            out = np.empty((self.shape[0], *self.row_shape), self.dtype)
            self.read(np.array([0]), np.array([self.shape[0]]), out)

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Starts reading these ranges' chunks ahead (remote or uncompressed only)."""
        if self._chunks is None or not (self.remote or self._raw is not None):
            return
        starts = np.asarray(starts, np.int64)
        stops = np.asarray(stops, np.int64)
        keep = (stops > starts) & (starts >= 0) & (stops <= self.shape[0])
        if not keep.any():
            return
        if self._raw is not None and self._checked:
            order = np.argsort(starts[keep], kind="stable")
            self._raw.advise(*merge_touching(starts[keep][order], stops[keep][order]))
            return
        touched = chunks_touched(starts[keep], stops[keep], self._codec.chunk_shape[0])
        self._chunks.prefetch(touched.tolist())

    def read(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        out: np.ndarray,
        pool: concurrent.futures.Executor | None = None,
        pending: list[concurrent.futures.Future] | None = None,
    ) -> None:
        """`formats.RangeReader.read`, from the store's chunks."""
        starts, stops = checked_ranges(self, starts, stops)
        if starts.size == 0:
            return
        total = int((stops - starts).sum())
        row_items = int(np.prod(self.row_shape, dtype=np.int64))
        flat = out.reshape(-1)
        if flat.size < total * row_items:
            raise ValueError(
                f"destination holds {flat.size} values, the ranges need "
                f"{total * row_items}"
            )
        dest = flat[: total * row_items].reshape((total, *self.row_shape))
        if self._codec is not None and not self._checked:
            self._check_against_zarr()
        if self._codec is None:
            self._read_zarr(starts, stops, dest)
            return
        if self._raw is not None:
            self._raw.read(starts, stops, dest, pool, pending)
            return
        work = self._plan(starts, stops, dest)
        uniq = work[0]
        raw = self._prepare(uniq)

        def task(a, b):
            self._read_chunks(a, b, work, raw)

        for a, b in run_parts(pool, uniq.size, task, pending):
            task(a, b)

    def _prepare(self, uniq: np.ndarray) -> dict | None:
        """Shard indices loaded; on a remote store, the chunks' bytes."""
        if self.remote:  # read-ahead of these chunks (indices included) first
            self._chunks.wait_prefetch(uniq.tolist())
        if self._codec.shard is not None:
            self._chunks.load_shard_indices(self._chunks.shards_of(uniq.tolist()))
        return self._chunks.fetch_remote(uniq) if self.remote else None

    def _plan(self, starts, stops, dest):
        c = int(self._codec.chunk_shape[0])
        chunk, p_start, p_stop = chunk_pieces(starts, stops, c)
        n = p_stop - p_start
        dst = np.concatenate([[0], np.cumsum(n)[:-1]])
        src = p_start - chunk * c
        uniq, lo = np.unique(chunk, return_index=True)
        hi = np.append(lo[1:], chunk.size)
        pieces = (src.tolist(), dst.tolist(), n.tolist())
        return uniq, lo.tolist(), hi.tolist(), pieces, dest

    def _read_chunks(self, a: int, b: int, work, raw) -> None:
        uniq, lo, hi, (src, dst, n), dest = work
        two_d = len(self.shape) > 1
        cc = self._codec.chunk_shape[1] if two_d else 0
        for x in range(a, b):
            k = int(uniq[x])
            for unit in self._chunks.units(k):
                chunk = self._chunks.chunk(unit, raw)
                if two_d:
                    c0 = unit[1] * cc
                    width = min(cc, self.shape[1] - c0)
                    for p in range(lo[x], hi[x]):
                        s, d, m = src[p], dst[p], n[p]
                        dest[d : d + m, c0 : c0 + width] = chunk[s : s + m, :width]
                else:
                    for p in range(lo[x], hi[x]):
                        s, d, m = src[p], dst[p], n[p]
                        dest[d : d + m] = chunk[s : s + m]

    def _new_lock(self) -> None:
        self._check_lock = threading.Lock()

    def _check_against_zarr(self) -> None:
        """Once: the first chunk decoded here must equal zarr-python's read."""
        with self._check_lock:
            if self._checked:
                return
            n = min(self.shape[0], self.chunk_length)
            if n > 0:
                mine = np.empty((n, *self.row_shape), self.dtype)
                work = self._plan(np.array([0]), np.array([n]), mine)
                try:
                    self._read_chunks(0, work[0].size, work, self._prepare(work[0]))
                except errors.CorruptChunkError:
                    self._checked = True  # damaged: the read itself reports
                    return
                theirs = np.asarray(self._array[0:n])
                if not np.array_equal(mine, theirs, equal_nan=mine.dtype.kind == "f"):
                    warnings.warn(
                        f"{self.path}: {self.name}'s first chunk decoded by "
                        f"grain_cells ({self._codec.describe()}) differs from "
                        "zarr-python's read; reading it through zarr-python "
                        "(slower). Please report this with the array's metadata.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                    self._codec = None
                    self._chunks = None
                    self._raw = None
            self._checked = True

    def _read_zarr(self, starts, stops, dest) -> None:
        if self.fill_missing is not True and self._all_written is None:
            array = self._array
            self._all_written = array.nchunks_initialized >= array.nchunks
        if self.fill_missing is not True and not self._all_written:
            raise errors.CorruptChunkError(
                f"{self.path}: {self.name} has chunks that were never written "
                f"({self._array.nchunks_initialized} of {self._array.nchunks} "
                "stored); zarr would read them as the fill value. The store is "
                "incomplete: rewrite or re-copy it.",
                path=self.path,
                dataset=self.name,
            )
        at = 0
        try:
            for a, b in zip(starts.tolist(), stops.tolist(), strict=False):
                dest[at : at + b - a] = self._array[a:b]
                at += b - a
        except (ValueError, RuntimeError, OSError) as e:
            raise errors.CorruptChunkError(
                f"{self.path}: reading rows [{a}, {b}) of {self.name} failed "
                f"({type(e).__name__}: {e}); the store is damaged: rewrite it.",
                path=self.path,
                dataset=self.name,
                rows=(a, b),
            ) from e

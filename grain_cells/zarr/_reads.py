"""Batched reads of sorted row ranges of one zarr array (a `formats.RangeReader`).

Design notes: docs/reference/design.md#zarr-reads.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import zarr

from grain_cells import errors
from grain_cells._util import fork
from grain_cells._util.ranges import chunks_touched, merge_touching
from grain_cells.formats import checked_ranges
from grain_cells.zarr import _raw
from grain_cells.zarr._chunks import Chunks
from grain_cells.zarr._codecs import Codec
from grain_cells.zarr._keys import key_reader
from grain_cells.zarr._store import check_array


class RangeReader:
    """Reads sorted, disjoint ranges of a zarr array's first axis. Thread-safe.

    Chunks are fetched and decoded here (`direct`) where `Codec` and
    `key_reader` handle the array, else read through zarr-python.
    """

    def __init__(
        self, array: zarr.Array, path: str, *, cache_bytes=0, fill_missing=False
    ):
        """Checks `array` against its own metadata document (`AnnDataFormatError`).

        `cache_bytes`: decoded bytes kept (arrays every read touches: `indptr`).
        `fill_missing`: read a never-written chunk as the fill value instead
        of raising: True for any, `"leading"` before the first stored row
        chunk, `"zero"` for any when the fill value is 0 (`filled_ranges`).
        """
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
        keys = key_reader(array.store) if codec else None
        self._codec, self._chunks = codec, None
        self._raw: _raw.RawReads | None = None
        self.remote = isinstance(array.store, zarr.storage.ObjectStore)
        self.chunk_length = int(array.chunks[0])
        if keys is not None:
            self.remote = keys.remote
            self.chunk_length = int(codec.chunk_shape[0])
            self._chunks = Chunks(
                array, path, codec, keys, cache_bytes, self.fill_missing
            )
            if _raw.applies(self._chunks, self._cache_bytes):
                self._raw = _raw.RawReads(self._chunks)

    @property
    def direct(self) -> bool:
        return self._chunks is not None

    decoded = direct

    def filled_ranges(self) -> list[tuple[int, int, str]]:
        """`(first, stop, key)` of each chunk read so far as the fill value."""
        if self._chunks is None:  # zarr-python's reads: not recorded
            return []
        filled = sorted(self._chunks.filled.items())
        return [(*self._chunks.rows(k), key) for k, key in filled]

    def pin(self) -> None:
        """Reads every shard index, and the whole array if it fits `cache_bytes`."""
        if self._chunks is None:
            return
        n = -(-self.shape[0] // self.chunk_length)
        if self._chunks.codec.shard is not None:
            self._chunks.load_shard_indices(self._chunks.shards_of(range(n)))
        row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        if self.shape[0] > 0 and n * self.chunk_length * row_bytes <= self._cache_bytes:
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
        touched = chunks_touched(starts[keep], stops[keep], self.chunk_length)
        self._chunks.prefetch(touched.tolist())

    def read(self, starts, stops, out: np.ndarray, pool=None, pending=None) -> None:
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
        if self._chunks is not None and not self._checked:
            self._check_against_zarr()
        if self._chunks is None:
            self._read_zarr(starts, stops, dest)
        else:
            (self._raw or self._chunks).read(starts, stops, dest, pool, pending)

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
                try:
                    self._chunks.read(np.array([0]), np.array([n]), mine)
                except errors.CorruptChunkError:
                    self._checked = True  # damaged: the read itself reports
                    return
                theirs = np.asarray(self._array[0:n])
                if not np.array_equal(mine, theirs, equal_nan=mine.dtype.kind == "f"):
                    warnings.warn(
                        f"{self.path}: {self.name}'s first chunk decoded by "
                        f"grain_cells ({self._chunks.codec.describe()}) differs from "
                        "zarr-python's read; reading it through zarr-python "
                        "(slower). Please report this with the array's metadata.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                    self._codec = self._chunks = self._raw = None
                    self.chunk_length = int(self._array.chunks[0])
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

"""Batched reads of sorted row ranges of one zarr array (a `formats.RangeReader`).

Uncompressed 1-D chunks of local stores are read by byte range (`_read_raw`).
Design notes: docs/reference/design.md#zarr-reads, #zarr-raw.
"""

from __future__ import annotations

import itertools
import os
import warnings

import numpy as np
import zarr

from grain_cells import errors
from grain_cells._util.ranges import chunks_touched
from grain_cells.formats import (
    checked_ranges,
    dest_bytes,
    naming_errors,
    pieces,
    run_parts,
)
from grain_cells.storage import advise_pieces
from grain_cells.zarr._chunks import Chunks
from grain_cells.zarr._keys import LocalKeys
from grain_cells.zarr._store import check_array, read

# Below this many bytes a raw read is not split over the pool's threads.
_MIN_BYTES_PER_TASK = 1 << 20
_MAX_TASKS = 4


class RangeReader(Chunks):
    """Reads sorted, disjoint ranges of a zarr array's first axis. Thread-safe.

    One array, three ways: uncompressed 1-D chunks of a local store by byte range
    (`_raw`), other chunks fetched and decoded here (`direct`), else zarr-python.
    `fill_missing`: True, "leading" (before the first stored row chunk) or "zero"
    (True if the fill value is 0).
    """

    def __init__(self, array, path: str, *, cache_bytes=0, fill_missing=False):
        array = check_array(array, path)  # AnnDataFormatError
        if fill_missing == "zero":
            fill_missing = not array.metadata.fill_value  # None or 0
        fill = fill_missing if fill_missing == "leading" else bool(fill_missing)
        super().__init__(array, path, cache_bytes, fill)
        self.row_shape = self.shape[1:]
        self._array, self._all_written, self._checked = array, None, False
        self.remote = isinstance(array.store, zarr.storage.ObjectStore)
        self.chunk_length = int(array.chunks[0])  # a shard's inner chunks
        self._raw = isinstance(self.keys, LocalKeys) and array.ndim == 1  # a codec
        self._raw = self._raw and not (self.codec.stages or cache_bytes)
        if self._raw:
            stored = self.codec.stored_dtype
            self._raw = stored.isnative or stored.itemsize == 1
            self._chunk_bytes = self.codec.chunk_items * stored.itemsize

    @property
    def direct(self) -> bool:
        return self.codec is not None

    decoded = direct

    def filled_ranges(self) -> list[tuple[int, int, str]]:
        """`(first, stop, key)` of each chunk read so far as the fill value."""
        if self.codec is None:  # zarr-python's reads: not recorded
            return []
        return [(*self.rows(k), key) for k, key in sorted(self.filled.items())]

    def pin(self) -> None:
        """Reads every shard index, and the whole array if it fits `cache_bytes`."""
        if self.codec is None:
            return
        n = -(-self.shape[0] // self.chunk_length)
        with naming_errors(self):
            self.load_indices(range(n))
        row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        if self.shape[0] > 0 and n * self.chunk_length * row_bytes <= self._cache_bytes:
            out = np.empty((self.shape[0], *self.row_shape), self.dtype)
            self.read(np.array([0]), np.array([self.shape[0]]), out)

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Starts reading these ranges' chunks ahead (remote, or local and raw)."""
        if self.codec is None or not (self.remote or (self._raw and self._checked)):
            return  # (a local store's prefetched bytes would never be taken)
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        keep = (stops > starts) & (starts >= 0) & (stops <= self.shape[0])
        starts, stops = starts[keep], stops[keep]
        if self.remote:
            self.prefetch(chunks_touched(starts, stops, self.chunk_length).tolist())
            return
        order = np.argsort(starts, kind="stable")  # `POSIX_FADV_WILLNEED` by key
        keys, _, at, _, n, _ = self._plan_raw(starts[order], stops[order])
        for key, group in itertools.groupby(range(len(keys)), keys.__getitem__):
            ps = list(group)
            if key is not None and (fd := self.keys.open(key)) is not None:
                try:
                    advise_pieces(
                        [fd] * len(ps), [at[p] for p in ps], [n[p] for p in ps]
                    )
                finally:
                    os.close(fd)

    def read(self, starts, stops, out: np.ndarray, pool=None, pending=None) -> None:
        """`formats.RangeReader.read`, from the store's chunks."""
        starts, stops = checked_ranges(self, starts, stops)
        if starts.size == 0:
            return
        total = int((stops - starts).sum())
        need = total * int(np.prod(self.row_shape, dtype=np.int64))
        dest_bytes(out, np.array([need * out.itemsize]))  # ValueError: too small
        dest = out.reshape(-1)[:need].reshape((total, *self.row_shape))
        with naming_errors(self):
            if self.codec is not None and not self._checked:
                self._check_against_zarr()  # may fall back to zarr-python
            if self.codec is None:
                self._read_zarr(starts, stops, dest)
            else:
                read = self._read_raw if self._raw else self._read_chunks
                read(starts, stops, dest, pool, pending)

    def _check_against_zarr(self) -> None:
        """Once: the first chunk decoded here must equal zarr-python's read."""
        with self._check_lock:
            if self._checked:
                return
            n = min(self.shape[0], self.chunk_length)
            if n > 0:
                mine = np.empty((n, *self.row_shape), self.dtype)
                try:
                    self._read_chunks(np.array([0]), np.array([n]), mine)
                except errors.CorruptChunkError:
                    self._checked = True  # damaged: the read itself reports
                    return
                theirs = np.asarray(self._array[0:n])
                if not np.array_equal(mine, theirs, equal_nan=mine.dtype.kind == "f"):
                    warnings.warn(
                        f"{self.path}: {self.name}'s first chunk decoded by "
                        f"grain_cells ({self.codec.describe()}) differs from "
                        "zarr-python's read; reading it through zarr-python "
                        "(slower). Please report this with the array's metadata.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                    self.codec, self._raw = None, False
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
        for a, b in zip(starts.tolist(), stops.tolist(), strict=False):
            rows = read(self._array, slice(a, b), self.path, (a, b))  # named error
            dest[at : at + b - a] = rows
            at += b - a

    def _plan_raw(self, starts: np.ndarray, stops: np.ndarray):
        """Per piece: key (None: not stored), chunk, byte offsets, bytes, dest."""
        ks, src, dests, nbytes = (
            a.tolist() for a in pieces(starts, stops, self.chunk_length)
        )
        self.load_indices(sorted(set(ks)))
        where = {}
        for k in dict.fromkeys(ks):  # each chunk once
            key, a, b = self.request((k,))
            if a is not None and a >= 0 and b - a != self._chunk_bytes:
                self._raw_corrupt(
                    k, key, a, f"its shard's index gives it {b - a} bytes"
                )
            where[k] = (key, 0) if a is None else (key if a >= 0 else None, a)
        item = self.dtype.itemsize
        keys = [where[k][0] for k in ks]
        at = [where[k][1] + s * item for k, s in zip(ks, src, strict=True)]
        src, nbytes, dests = ([x * item for x in a] for a in (src, nbytes, dests))
        return keys, ks, at, src, nbytes, dests

    def _read_raw(self, starts, stops, dest, pool=None, pending=None) -> None:
        """`_read_chunks` by byte range: uncompressed 1-D chunks of a local store."""
        keys, ks, at, src, nbytes, dests = self._plan_raw(starts, stops)
        view = memoryview(dest.reshape(-1).view(np.uint8))

        def task(lo: int, hi: int) -> None:
            with naming_errors(self):  # a pool's task raises outside `read`'s
                _task(lo, hi)

        def _task(lo: int, hi: int) -> None:
            for key, group in itertools.groupby(range(lo, hi), keys.__getitem__):
                ps = list(group)
                fd = None if key is None else self.keys.open(key)
                if fd is None:  # no chunk file (or no shard): `chunk`'s rule applies
                    for p in ps:
                        chunk = np.ascontiguousarray(self.chunk((ks[p],), None))
                        flat = chunk.reshape(-1).view(np.uint8)
                        d, s, n = dests[p], src[p], nbytes[p]
                        view[d : d + n] = flat[s : s + n]
                    continue
                try:
                    size = None if self.codec.shard else os.fstat(fd).st_size
                    if size is not None and size != self._chunk_bytes:
                        found = f"its file holds {size} bytes"
                        self._raw_corrupt(ks[ps[0]], key, None, found)
                    for p in ps:
                        off, n, d = at[p], nbytes[p], dests[p]
                        got = 0
                        while got < n:  # short reads are legal; zero means the end
                            more = os.preadv(fd, [view[d + got : d + n]], off + got)
                            if more == 0:
                                found = f"its file ends at byte {off + got}"
                                self._raw_corrupt(ks[p], key, off, found)
                            got += more
                finally:
                    os.close(fd)

        least = {"max_tasks": _MAX_TASKS, "min_bytes": _MIN_BYTES_PER_TASK}
        sizes = np.array(nbytes, np.int64)
        for lo, hi in run_parts(pool, len(ks), task, pending, sizes=sizes, **least):
            task(lo, hi)

    def _raw_corrupt(self, k, key, offset, found: str):
        rows = self.rows(k)
        raise self.corrupt(
            f"chunk key {key!r} (uncompressed) is corrupt: {found}, an uncompressed "
            f"chunk of {self.codec.chunk_items} x {self.dtype.itemsize}-byte values is "
            f"{self._chunk_bytes}. It holds rows [{rows[0]}, {rows[1]}). The store is "
            "damaged (truncated or rewritten during a copy): rewrite or re-copy it.",
            rows,
            key,
            offset,
        )

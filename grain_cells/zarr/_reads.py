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
from grain_cells._util.ranges import chunks_touched, merge_touching
from grain_cells.formats import checked_ranges, run_parts
from grain_cells.storage import advise_pieces
from grain_cells.zarr._chunks import Chunks, pieces
from grain_cells.zarr._codecs import MAX_UINT_64
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
        self.chunk_length = int(array.chunks[0])
        self._raw = False
        if (codec := self.codec) is not None:
            self.remote, self.chunk_length = self.keys.remote, int(codec.chunk_shape[0])
            dtype, local = codec.stored_dtype, isinstance(self.keys, LocalKeys)
            self._raw = not codec.stages and local and array.ndim == 1
            self._raw &= not cache_bytes and (dtype.isnative or dtype.itemsize == 1)
        if self._raw:
            self._item = dtype.itemsize
            self._chunk_bytes = codec.chunk_items * self._item
            # A 1-D chunk's key is its number inside a fixed text (zarr's key
            # encoding: "x/12", "x/c/12", "x.12"): formatted, not re-encoded.
            probe, self._raw_key = self.key((987654321,)), None
            if probe.count("987654321") == 1 and not {"{", "}"} & set(probe):
                template = probe.replace("987654321", "{}")
                if template.format(0) == self.key((0,)):
                    self._raw_key = template.format

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
        if self.codec.shard is not None:
            self.load_shard_indices(self.shards_of(range(n)))
        row_bytes = self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        if self.shape[0] > 0 and n * self.chunk_length * row_bytes <= self._cache_bytes:
            out = np.empty((self.shape[0], *self.row_shape), self.dtype)
            self.read(np.array([0]), np.array([self.shape[0]]), out)

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Starts reading these ranges' chunks ahead (remote or uncompressed only)."""
        if self.codec is None or not (self.remote or self._raw):
            return
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        keep = (stops > starts) & (starts >= 0) & (stops <= self.shape[0])
        if not keep.any():
            return
        if self._raw and self._checked:
            order = np.argsort(starts[keep], kind="stable")
            self._advise_raw(*merge_touching(starts[keep][order], stops[keep][order]))
            return
        touched = chunks_touched(starts[keep], stops[keep], self.chunk_length)
        self.prefetch(touched.tolist())

    def read(self, starts, stops, out: np.ndarray, pool=None, pending=None) -> None:
        """`formats.RangeReader.read`, from the store's chunks."""
        starts, stops = checked_ranges(self, starts, stops)
        if starts.size == 0:
            return
        total = int((stops - starts).sum())
        need = total * int(np.prod(self.row_shape, dtype=np.int64))
        if (flat := out.reshape(-1)).size < need:
            raise ValueError(
                f"destination holds {flat.size} values, the ranges need {need}"
            )
        dest = flat[:need].reshape((total, *self.row_shape))
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
        for a, b in zip(starts.tolist(), stops.tolist(), strict=False):
            rows = read(self._array, slice(a, b), self.path, (a, b))  # named error
            dest[at : at + b - a] = rows
            at += b - a

    def _plan_raw(self, starts: np.ndarray, stops: np.ndarray):
        """Keys; per piece: key index, chunk, offset+bytes in key and dest, missing."""
        ks, src, dests, nbytes = pieces(starts, stops, self.chunk_length)
        item = self._item
        dests, nbytes = dests * item, nbytes * item
        missing, base = np.zeros(ks.size, bool), np.zeros(ks.size, np.int64)
        if self.codec.shard is None:
            uniq, key_id = np.unique(ks, return_inverse=True)
            key = self._raw_key or (lambda k: self.key((k,)))
            names = [key(k) for k in uniq.tolist()]
        else:
            per = int(self.codec.shard.per_shard[0])
            shard_id = ks // per
            shards = np.unique(shard_id)
            self.load_shard_indices([(s,) for s in shards.tolist()])
            key_id = np.searchsorted(shards, shard_id)
            names = [self.key((s,)) for s in shards.tolist()]
            for i, s in enumerate(shards.tolist()):
                sel = key_id == i
                index = self._shard_index.get((s,))
                if index is None:
                    missing[sel] = True
                    continue
                entry = index[ks[sel] % per]
                empty = (entry[:, 0] == MAX_UINT_64) & (entry[:, 1] == MAX_UINT_64)
                missing[np.flatnonzero(sel)[empty]] = True
                wrong = ~empty & (entry[:, 1] != self._chunk_bytes)
                if wrong.any():
                    j = int(np.flatnonzero(wrong)[0])
                    found = f"its shard's index gives it {int(entry[j, 1])} bytes"
                    self._raw_corrupt(
                        int(ks[sel][j]), names[i], int(entry[j, 0]), found
                    )
                base[sel] = np.where(empty, 0, entry[:, 0].astype(np.int64))
        return names, key_id, ks, base + src * item, nbytes, dests, missing

    def _read_raw(self, starts, stops, dest, pool=None, pending=None) -> None:
        """`_read_chunks` by byte range: uncompressed 1-D chunks of a local store."""
        names, *planned, missing = self._plan_raw(starts, stops)
        view = memoryview(dest.reshape(-1).view(np.uint8))
        for p in np.flatnonzero(missing).tolist():  # fill value or an error
            self._fill_piece(view, *(int(a[p]) for a in planned[1:]))
        key_id, ks, offsets, nbytes, dests = (a[~missing] for a in planned)
        if not ks.size:
            return
        lists = [a.tolist() for a in (key_id, ks, offsets, nbytes, dests)]

        def task(a, b):
            self._read_pieces(view, names, *(x[a:b] for x in lists))

        least = {"max_tasks": _MAX_TASKS, "min_bytes": _MIN_BYTES_PER_TASK}
        for a, b in run_parts(pool, ks.size, task, pending, sizes=nbytes, **least):
            task(a, b)

    def _advise_raw(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Asks the OS to start reading these ranges (`POSIX_FADV_WILLNEED`)."""
        names, key_id, _, offsets, nbytes, _, missing = self._plan_raw(starts, stops)
        keep = ~missing
        key_id, offsets, nbytes = key_id[keep], offsets[keep], nbytes[keep]
        bounds = np.flatnonzero(np.diff(key_id)) + 1
        for lo, hi in itertools.pairwise([0, *bounds.tolist(), key_id.size]):
            fd = self.keys.open(names[int(key_id[lo])])
            if fd is not None:
                try:
                    advise_pieces([fd] * (hi - lo), offsets[lo:hi], nbytes[lo:hi])
                finally:
                    os.close(fd)

    def _read_pieces(self, view, names, key_id, ks, offsets, nbytes, dests) -> None:
        for kid, group in itertools.groupby(range(len(key_id)), key_id.__getitem__):
            ps = list(group)
            key = names[kid]
            fd = self.keys.open(key)
            if fd is None:  # no chunk file (or no shard): `chunk`'s rule applies
                for p in ps:
                    self._fill_piece(view, ks[p], offsets[p], nbytes[p], dests[p])
                continue
            try:
                size = None if self.codec.shard else os.fstat(fd).st_size
                if size is not None and size != self._chunk_bytes:
                    self._raw_corrupt(
                        ks[ps[0]], key, None, f"its file holds {size} bytes"
                    )
                for p in ps:
                    off, nb, d = offsets[p], nbytes[p], dests[p]
                    got = os.preadv(fd, [view[d : d + nb]], off)
                    while got < nb:  # short reads are legal; zero means the end
                        more = os.preadv(fd, [view[d + got : d + nb]], off + got)
                        if more == 0:
                            self._raw_corrupt(
                                ks[p], key, off, f"its file ends at byte {off + got}"
                            )
                        got += more
            finally:
                os.close(fd)

    def _fill_piece(self, view, k: int, off: int, nb: int, d: int) -> None:
        """A piece of a chunk with no stored bytes: `chunk` fills or raises."""
        chunk = self.chunk((k,), None)
        flat = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        base = 0
        if self.codec.shard is not None:
            _, a, _, _ = self.request((k,))
            base = a if a is not None and a >= 0 else 0
        view[d : d + nb] = flat[off - base : off - base + nb]

    def _raw_corrupt(self, k, key, offset, found: str):
        rows = self.rows(k)
        raise self.corrupt(
            f"chunk key {key!r} (uncompressed) is corrupt: {found}, an uncompressed "
            f"chunk of {self.codec.chunk_items} x {self._item}-byte values is "
            f"{self._chunk_bytes}. It holds rows [{rows[0]}, {rows[1]}). The store is "
            "damaged (truncated or rewritten during a copy): rewrite or re-copy it.",
            rows,
            key,
            offset,
        )

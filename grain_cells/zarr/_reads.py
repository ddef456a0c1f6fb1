"""Batched reads of sorted row ranges of one zarr array (a `formats.RangeReader`).

Uncompressed 1-D chunks of local stores are read by byte range (`RawReads`).
Design notes: docs/reference/design.md#zarr-reads, #zarr-raw.
"""

from __future__ import annotations

import itertools
import os
import threading
import warnings

import numpy as np
import zarr

from grain_cells import errors
from grain_cells._util import fork
from grain_cells._util.ranges import chunks_touched, merge_touching
from grain_cells.formats import checked_ranges, run_parts
from grain_cells.zarr._chunks import Chunks, pieces
from grain_cells.zarr._codecs import MAX_UINT_64, Codec
from grain_cells.zarr._keys import LocalKeys, key_reader
from grain_cells.zarr._store import check_array


class RangeReader:
    """Reads sorted, disjoint ranges of a zarr array's first axis. Thread-safe.

    Chunks are fetched and decoded here (`direct`) where `Codec` and `key_reader`
    handle the array, else read through zarr-python. `fill_missing`: True, "leading"
    (before the first stored row chunk) or "zero" (True if the fill value is 0).
    """

    def __init__(
        self, array: zarr.Array, path: str, *, cache_bytes=0, fill_missing=False
    ):
        array = check_array(array, path)  # AnnDataFormatError
        self.name, self.path = "/" + array.path.lstrip("/"), path
        self.dtype = np.dtype(array.dtype).newbyteorder("=")
        self.shape = tuple(array.shape)
        self.row_shape = self.shape[1:]
        if fill_missing == "zero":
            fill_missing = not array.metadata.fill_value  # None or 0
        self.fill_missing = (
            fill_missing if fill_missing == "leading" else bool(fill_missing)
        )
        self._array, self._cache_bytes = array, int(cache_bytes)
        self._all_written: bool | None = None
        self._checked, self._check_lock = False, threading.Lock()
        fork.in_child_of(self, RangeReader._new_lock)
        codec = Codec.for_array(array) if array.ndim in (1, 2) else None
        keys = key_reader(array.store) if codec else None
        self._codec, self._chunks, self._raw = codec, None, None
        self.remote = isinstance(array.store, zarr.storage.ObjectStore)
        self.chunk_length = int(array.chunks[0])
        if keys is not None:
            self.remote, self.chunk_length = keys.remote, int(codec.chunk_shape[0])
            self._chunks = Chunks(
                array, path, codec, keys, cache_bytes, self.fill_missing
            )
            dtype = codec.stored_dtype
            raw = not codec.stages and isinstance(keys, LocalKeys) and array.ndim == 1
            if raw and not cache_bytes and (dtype.isnative or dtype.itemsize == 1):
                self._raw = RawReads(self._chunks)

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
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
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
        need = total * int(np.prod(self.row_shape, dtype=np.int64))
        if (flat := out.reshape(-1)).size < need:
            raise ValueError(
                f"destination holds {flat.size} values, the ranges need {need}"
            )
        dest = flat[:need].reshape((total, *self.row_shape))
        if self._chunks is not None and not self._checked:
            self._check_against_zarr()  # may fall back to zarr-python
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


# Below this many bytes a read is not split over the pool's threads.
_MIN_BYTES_PER_TASK = 1 << 20
_MAX_TASKS = 4


class RawReads:
    """Reads ranges of an uncompressed 1-D zarr array by byte range. Thread-safe."""

    def __init__(self, chunks: Chunks):
        self._chunks, self._codec, self._keys = chunks, chunks.codec, chunks.keys
        self._item = self._codec.stored_dtype.itemsize
        self._chunk_len = int(self._codec.chunk_shape[0])
        self._chunk_bytes = self._codec.chunk_items * self._item
        # A 1-D chunk's key is its number inside a fixed text (zarr's key
        # encoding: "x/12", "x/c/12", "x.12"): formatted, not re-encoded.
        probe = chunks.key((987654321,))
        self._key = lambda k: chunks.key((k,))
        if probe.count("987654321") == 1 and not {"{", "}"} & set(probe):
            template = probe.replace("987654321", "{}")
            if template.format(0) == chunks.key((0,)):
                self._key = template.format

    def plan(self, starts: np.ndarray, stops: np.ndarray):
        """Keys; per piece: key index, chunk, offset+bytes in key and dest, missing."""
        ks, src, dests, nbytes = pieces(starts, stops, self._chunk_len)
        item = self._item
        dests, nbytes = dests * item, nbytes * item
        missing, base = np.zeros(ks.size, bool), np.zeros(ks.size, np.int64)
        if self._codec.shard is None:
            uniq, key_id = np.unique(ks, return_inverse=True)
            names = [self._key(k) for k in uniq.tolist()]
        else:
            per = int(self._codec.shard.per_shard[0])
            shard_id = ks // per
            shards = np.unique(shard_id)
            self._chunks.load_shard_indices([(s,) for s in shards.tolist()])
            key_id = np.searchsorted(shards, shard_id)
            names = [self._chunks.key((s,)) for s in shards.tolist()]
            for i, s in enumerate(shards.tolist()):
                sel = key_id == i
                index = self._chunks._shard_index.get((s,))
                if index is None:
                    missing[sel] = True
                    continue
                entry = index[ks[sel] % per]
                empty = (entry[:, 0] == MAX_UINT_64) & (entry[:, 1] == MAX_UINT_64)
                missing[np.flatnonzero(sel)[empty]] = True
                wrong = ~empty & (entry[:, 1] != self._chunk_bytes)
                if wrong.any():
                    j = int(np.flatnonzero(wrong)[0])
                    self._corrupt(
                        int(ks[sel][j]),
                        names[i],
                        int(entry[j, 0]),
                        f"its shard's index gives it {int(entry[j, 1])} bytes",
                    )
                base[sel] = np.where(empty, 0, entry[:, 0].astype(np.int64))
        return names, key_id, ks, base + src * item, nbytes, dests, missing

    def read(self, starts, stops, dest: np.ndarray, pool=None, pending=None) -> None:
        """Reads sorted, disjoint, non-empty ranges, concatenated, into `dest`."""
        names, key_id, ks, offsets, nbytes, dests, missing = self.plan(starts, stops)
        view = memoryview(dest.reshape(-1).view(np.uint8))
        for p in np.flatnonzero(missing).tolist():  # fill value or an error
            self._fill(view, int(ks[p]), int(offsets[p]), int(nbytes[p]), int(dests[p]))
        if missing.any():
            keep = ~missing
            key_id, ks, offsets, nbytes, dests = (
                a[keep] for a in (key_id, ks, offsets, nbytes, dests)
            )
        if not ks.size:
            return
        lists = [a.tolist() for a in (key_id, ks, offsets, nbytes, dests)]

        def task(a, b):
            self._read_pieces(view, names, *(x[a:b] for x in lists))

        for a, b in run_parts(
            pool,
            ks.size,
            task,
            pending,
            max_tasks=_MAX_TASKS,
            sizes=nbytes,
            min_bytes=_MIN_BYTES_PER_TASK,
        ):
            task(a, b)

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Asks the OS to start reading these ranges (`POSIX_FADV_WILLNEED`)."""
        if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not Linux
            return
        names, key_id, _, offsets, nbytes, _, missing = self.plan(starts, stops)
        keep = ~missing
        key_id, offsets, nbytes = key_id[keep], offsets[keep], nbytes[keep]
        bounds = np.flatnonzero(np.diff(key_id)) + 1
        for lo, hi in itertools.pairwise([0, *bounds.tolist(), key_id.size]):
            fd = self._keys.open(names[int(key_id[lo])])
            if fd is None:
                continue
            offs, nbs = offsets[lo:hi].tolist(), nbytes[lo:hi].tolist()
            try:
                for off, nb in zip(offs, nbs, strict=True):
                    os.posix_fadvise(fd, off, nb, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def _read_pieces(self, view, names, key_id, ks, offsets, nbytes, dests) -> None:
        for kid, group in itertools.groupby(range(len(key_id)), key_id.__getitem__):
            ps = list(group)
            key = names[kid]
            fd = self._keys.open(key)
            if fd is None:  # no chunk file (or no shard): Chunks' rule applies
                for p in ps:
                    self._fill(view, ks[p], offsets[p], nbytes[p], dests[p])
                continue
            try:
                if self._codec.shard is None:
                    size = os.fstat(fd).st_size
                    if size != self._chunk_bytes:
                        self._corrupt(
                            ks[ps[0]], key, None, f"its file holds {size} bytes"
                        )
                for p in ps:
                    off, nb, d = offsets[p], nbytes[p], dests[p]
                    got = os.preadv(fd, [view[d : d + nb]], off)
                    while got < nb:  # short reads are legal; zero means the end
                        more = os.preadv(fd, [view[d + got : d + nb]], off + got)
                        if more == 0:
                            self._corrupt(
                                ks[p], key, off, f"its file ends at byte {off + got}"
                            )
                        got += more
            finally:
                os.close(fd)

    def _fill(self, view, k: int, off: int, nb: int, d: int) -> None:
        """A piece of a chunk with no stored bytes: `Chunks.chunk` fills or raises."""
        chunk = self._chunks.chunk((k,), None)
        flat = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        base = 0
        if self._codec.shard is not None:
            _, a, _, _ = self._chunks.request((k,))
            base = a if a is not None and a >= 0 else 0
        view[d : d + nb] = flat[off - base : off - base + nb]

    def _corrupt(self, k, key, offset, found: str):
        rows = self._chunks.rows(k)
        raise self._chunks.corrupt(
            f"chunk key {key!r} (uncompressed) is corrupt: {found}, an uncompressed "
            f"chunk of {self._codec.chunk_items} x {self._item}-byte values is "
            f"{self._chunk_bytes}. It holds rows [{rows[0]}, {rows[1]}). The store is "
            "damaged (truncated or rewritten during a copy): rewrite or re-copy it.",
            rows,
            key,
            offset,
        )

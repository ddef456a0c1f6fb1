"""Batched reads of many element ranges from one zarr array.

A `RangeReader` has the interface of `grain_cells.hdf5._reads.RangeReader`,
so `grain_cells.io` reads CSR and dense matrices of zarr stores with the same
code as those of `.h5ad` files: sorted, disjoint ranges of the first axis
into one contiguous destination.

For a read it

1. lists the chunks the ranges touch along the first axis (the *inner*
   chunks of a sharded array), each once however many ranges share it, and
   for a 2-D array every chunk across the row;
2. fetches each chunk's stored bytes once: a file (`os.pread`), a zip
   member, or a range GET; for a sharded array the byte range the shard's
   index gives (indices are read once per shard and kept, a few bytes per
   inner chunk);
3. decodes it with `grain_cells.zarr._codecs.Codec` (numcodecs' C decoders
   and crc32c, GIL released) and copies the rows the ranges need straight
   into the destination.

**Threads.** With a `pool` (the loader's per-process read threads), the
chunks are split over up to 16 tasks of the pool, each fetching and decoding
its chunks; without one, the calling thread does all of it. zarr's own
`async.concurrency` and `threading.max_workers` do not apply: zarr-python's
event loop is bypassed for reads, because at the loader's batch shape its
per-chunk machinery cost more CPU than decoding (`benchmarks/zarr_decode.py`:
on anndata's default `blosc(lz4)` v2 store, 16 blocks of 16 cells cost 43
ms of CPU through `Array.__getitem__` and 33 ms here, of which decoding is
nearly all). Remote stores send all of a read's GETs at once (obstore), then
decode in the pool.

**Integrity.** zarr reads a chunk that was never written as the fill value.
Here a missing chunk (no key, or an empty entry in a shard's index) raises
`errors.CorruptChunkError` naming the store, array, chunk key and rows,
unless the reader was built with `fill_missing=True`. anndata writes with
zarr's default `write_empty_chunks=False`, so zarr omits a chunk only when
every value in it equals the fill value (0): for CSR `indices` that needs a
row with two equal column indices, for `data` stored explicit zeros, for a
dense matrix an all-zero block. The first two never happen in a canonical
CSR matrix, so X's arrays are read with the default (error); the io layer
may pass `fill_missing=True` for arrays where an all-fill chunk is plausible.
A crc32c codec is checked; a truncated shard (index short, failing its
crc32c, or pointing past the end), undecodable bytes or a chunk of the wrong
decoded size raise `errors.CorruptChunkError` too.

Arrays whose codecs `Codec` does not decode (a transpose codec, nested
sharding, strings), and stores other than local, zip and obstore ones, are
read through zarr-python's slicing (one call per run of touching ranges);
those first check, once, that every chunk of the array was written.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading

import numpy as np
import zarr

from grain_cells import errors
from grain_cells._util.ranges import merge_touching
from grain_cells.zarr._codecs import MAX_UINT_64, ChunkDecodeError, Codec
from grain_cells.zarr._keys import KeyReader
from grain_cells.zarr._store import check_array

# Tasks one read is split into when a pool is given: enough to balance
# uneven chunks over a pool of a few threads.
_MAX_TASKS = 16


def wait_all(futures: list[concurrent.futures.Future]) -> None:
    """Waits for every future, then raises the first one's error, if any."""
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()


class RangeReader:
    """Reads sorted, disjoint ranges of a zarr array's first axis.

    Thread-safe. Picklable only through its array (open one per process).

    Example:
        >>> reader = RangeReader(group["X/data"], "/data/a.zarr")
        >>> out = np.empty(30, reader.dtype)
        >>> reader.read(np.array([0, 100]), np.array([10, 120]), out)
    """

    def __init__(
        self,
        array: zarr.Array,
        path: str,
        fd=None,
        *,
        cache_bytes: int = 0,
        fill_missing: bool = False,
    ):
        """Inspects the array's metadata once.

        Args:
            array: An open 1-D or 2-D zarr array. Its metadata is re-read
                from its own document (not the store's consolidated
                metadata) and the two must agree.
            path: The store's path or URL, for error messages.
            fd: Unused (the h5ad reader's byte reader); zarr reads through
                the array's own store.
            cache_bytes: Decoded bytes kept in an LRU cache (for small
                arrays every read touches, such as `indptr`).
            fill_missing: Read a chunk that was never written as the
                array's fill value (zarr's behaviour) instead of raising.

        Raises:
            errors.AnnDataFormatError: The store's consolidated metadata
                disagrees with the array's own metadata document.
        """
        del fd
        array = check_array(array, path)
        self.name = "/" + array.path.lstrip("/")
        self.path = path
        self.dtype = np.dtype(array.dtype).newbyteorder("=")
        self.shape = tuple(array.shape)
        self.row_shape = self.shape[1:]
        self.fill_missing = bool(fill_missing)
        self._array = array
        self._meta = array.metadata
        self._prefix = array.path.strip("/")
        codec = Codec.for_array(array) if array.ndim in (1, 2) else None
        self._keys = KeyReader.for_store(array.store) if codec else None
        self._codec = codec if self._keys is not None else None
        self._fill = np.asarray(self._meta.fill_value, self.dtype)
        self._cache_bytes = int(cache_bytes)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._shard_index: dict[tuple[int, ...], np.ndarray | None] = {}
        self._all_written: bool | None = None

    @property
    def direct(self) -> bool:
        """Whether reads bypass zarr-python (chunks fetched and decoded here)."""
        return self._codec is not None

    @property
    def remote(self) -> bool:
        """Whether bytes come from an object store (each read a round trip)."""
        if self._keys is not None:
            return self._keys.remote
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

    def will_need(self) -> None:
        """Reads the shard indices now (the OS reads ahead of local files)."""
        if self._codec is not None and self._codec.shard is not None:
            n = -(-self.shape[0] // self._codec.chunk_shape[0])
            self._load_shard_indices(self._shards_of(range(n)))

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Hints that these ranges will be read soon (a no-op for zarr)."""

    # -- reads -------------------------------------------------------------

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
            pool: Thread pool that fetches and decodes chunks concurrently.
            pending: With a pool, a list that receives the read's futures
                instead of waiting for them; `out` is complete only once
                they are done.

        Raises:
            errors.CorruptDataError: Rows outside the array were asked for.
            errors.CorruptChunkError: A chunk is missing, truncated, fails
                its checksum or does not decode; names store, array, chunk
                key and rows.
        """
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
        total = int((stops - starts).sum())
        row_items = int(np.prod(self.row_shape, dtype=np.int64))
        flat = out.reshape(-1)
        if flat.size < total * row_items:
            raise ValueError(
                f"destination holds {flat.size} values, the ranges need "
                f"{total * row_items}"
            )
        dest = flat[: total * row_items].reshape((total, *self.row_shape))
        if self._codec is None:
            self._read_zarr(starts, stops, dest)
            return
        work = self._plan(starts, stops, dest)
        uniq = work[0]
        if self._codec.shard is not None:
            self._load_shard_indices(self._shards_of(uniq.tolist()))
        raw = self._fetch_remote(uniq) if self._keys.remote else None
        if pool is None or uniq.size < 2:
            self._read_chunks(0, uniq.size, work, raw)
            return
        n_tasks = min(uniq.size, _MAX_TASKS)
        bounds = np.linspace(0, uniq.size, n_tasks + 1).astype(int).tolist()
        futures = [
            pool.submit(self._read_chunks, a, b, work, raw)
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]
        if pending is not None:
            pending.extend(futures)
            return
        wait_all(futures)

    def _plan(self, starts, stops, dest):
        c = int(self._codec.chunk_shape[0])
        first = starts // c
        last = (stops - 1) // c
        n_pieces = last - first + 1
        owner = np.repeat(np.arange(starts.size), n_pieces)
        within = np.arange(int(n_pieces.sum())) - np.repeat(
            np.cumsum(n_pieces) - n_pieces, n_pieces
        )
        chunk = first[owner] + within
        p_start = np.maximum(starts[owner], chunk * c)
        p_stop = np.minimum(stops[owner], (chunk + 1) * c)
        n = p_stop - p_start
        dst = np.concatenate([[0], np.cumsum(n)[:-1]])
        src = p_start - chunk * c
        uniq, lo = np.unique(chunk, return_index=True)
        hi = np.append(lo[1:], chunk.size)
        pieces = (src.tolist(), dst.tolist(), n.tolist())
        return uniq, lo.tolist(), hi.tolist(), pieces, dest

    # -- chunks ------------------------------------------------------------

    def _col_chunks(self) -> int:
        if len(self.shape) < 2:
            return 1
        return max(1, -(-self.shape[1] // self._codec.chunk_shape[1]))

    def _units(self, k: int) -> list[tuple[int, ...]]:
        if len(self.shape) < 2:
            return [(k,)]
        return [(k, j) for j in range(self._col_chunks())]

    def _key(self, coords: tuple[int, ...]) -> str:
        key = self._meta.encode_chunk_key(tuple(coords))
        return f"{self._prefix}/{key}" if self._prefix else key

    def _shard_of(self, k: int, j: int):
        """`(shard coords, inner chunk's position in the index)`."""
        per = self._codec.shard.per_shard
        if len(self.shape) < 2:
            return (k // per[0],), k % per[0]
        return (k // per[0], j // per[1]), (k % per[0]) * per[1] + j % per[1]

    def _shards_of(self, row_chunks) -> list[tuple[int, ...]]:
        return sorted(
            {self._shard_of(k, u[-1])[0] for k in row_chunks for u in self._units(k)}
        )

    def _load_shard_indices(self, shards: list[tuple[int, ...]]) -> None:
        layout = self._codec.shard
        todo = [s for s in shards if s not in self._shard_index]
        if not todo:
            return
        n = layout.index_nbytes
        requests = []
        for s in todo:
            key = self._key(s)
            requests.append((key, -n, None) if layout.at_end else (key, 0, n))
        got = self._keys.get_many(requests)
        for s, (key, _, _), raw in zip(todo, requests, got):
            index = None
            if raw is not None:
                try:
                    index = layout.parse_index(raw)
                except ChunkDecodeError as e:
                    raise errors.CorruptChunkError(
                        f"{self.path}: {self.name} shard {key!r} has a corrupt "
                        f"index: {e}. It holds rows {self._shard_rows(s)} of "
                        f"{self.name}; the store is damaged: rewrite it.",
                        path=self.path,
                        dataset=self.name,
                        rows=self._shard_rows(s),
                    ) from None
            with self._lock:
                self._shard_index[s] = index

    def _shard_rows(self, s) -> tuple[int, int]:
        rows = self._codec.shard.shard_shape[0]
        return (s[0] * rows, min((s[0] + 1) * rows, self.shape[0]))

    def _request(self, unit):
        """`(key, start, stop, offset for messages)` of a unit's stored bytes,
        or `(key, None, None, None)` for a whole key; start -1: missing."""
        if self._codec.shard is None:
            return self._key(unit), None, None, None
        k, j = unit[0], (unit[1] if len(unit) > 1 else 0)
        s, i = self._shard_of(k, j)
        key = self._key(s)
        index = self._shard_index.get(s)
        if index is None:
            return key, -1, None, None
        off, n = int(index[i, 0]), int(index[i, 1])
        if off == MAX_UINT_64 and n == MAX_UINT_64:
            return key, -1, None, None
        return key, off, off + n, off

    def _fetch_remote(self, uniq) -> dict:
        units = [u for k in uniq.tolist() for u in self._units(k)]
        todo = [(u, self._request(u)) for u in units if self._cached(u) is None]
        asks = [(key, a, b) for _, (key, a, b, _) in todo if a is None or a >= 0]
        got = iter(self._keys.get_many(asks))
        return {
            u: (None if (a is not None and a < 0) else next(got)) for u, (_, a, _, _) in todo
        }

    def _chunk(self, unit, raw: dict | None) -> np.ndarray:
        chunk = self._cached(unit)
        if chunk is not None:
            return chunk
        key, a, b, off = self._request(unit)
        if raw is not None:
            data = raw[unit]
        elif a is None:
            data = self._keys.get(key)
        elif a < 0:
            data = None
        else:
            data = self._keys.get_range(key, a, b)
        rows = (
            unit[0] * self._codec.chunk_shape[0],
            min((unit[0] + 1) * self._codec.chunk_shape[0], self.shape[0]),
        )
        where = f"chunk {unit}" + (f" (in shard {key!r})" if a is not None else "")
        if data is None:
            if self.fill_missing:
                return np.full(self._codec.chunk_shape, self._fill, self.dtype)
            raise errors.CorruptChunkError(
                f"{self.path}: {self.name} {where} is missing: key {key!r} was "
                f"never written{' (empty shard index entry)' if a is not None else ''}"
                f". It holds rows [{rows[0]}, {rows[1]}) of {self.name}; zarr would "
                "read it as the fill value. The store is incomplete (an interrupted "
                "write or copy): rewrite or re-copy it.",
                path=self.path,
                dataset=self.name,
                rows=rows,
                chunk_key=key,
            )
        try:
            if a is not None and len(data) != b - a:
                raise ChunkDecodeError(
                    f"the shard index places it at bytes [{a}, {b}) but the "
                    f"shard ends {b - a - len(data)} bytes early (truncated)"
                )
            chunk = self._codec.decode(data)
        except ChunkDecodeError as e:
            raise errors.CorruptChunkError(
                f"{self.path}: {self.name} {where}, key {key!r} "
                f"({self._codec.describe()}) is corrupt: {e}. It holds rows "
                f"[{rows[0]}, {rows[1]}) of {self.name}; the store is damaged: "
                "rewrite or re-copy it.",
                path=self.path,
                dataset=self.name,
                byte_offset=off,
                rows=rows,
                chunk_key=key,
            ) from None
        self._remember(unit, chunk)
        return chunk

    def _read_chunks(self, a: int, b: int, work, raw) -> None:
        uniq, lo, hi, (src, dst, n), dest = work
        two_d = len(self.shape) > 1
        cc = self._codec.chunk_shape[1] if two_d else 0
        for x in range(a, b):
            k = int(uniq[x])
            for unit in self._units(k):
                chunk = self._chunk(unit, raw)
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

    def _cached(self, unit) -> np.ndarray | None:
        if not self._cache_bytes:
            return None
        with self._lock:
            chunk = self._cache.get(unit)
            if chunk is not None:
                self._cache.move_to_end(unit)
            return chunk

    def _remember(self, unit, chunk: np.ndarray) -> None:
        if not self._cache_bytes or chunk.nbytes > self._cache_bytes:
            return
        with self._lock:
            self._cache[unit] = chunk
            held = len(self._cache) * chunk.nbytes
            while held > self._cache_bytes:
                self._cache.popitem(last=False)
                held -= chunk.nbytes

    # -- through zarr-python -----------------------------------------------

    def _read_zarr(self, starts, stops, dest) -> None:
        if not self.fill_missing and self._all_written is None:
            array = self._array
            self._all_written = array.nchunks_initialized >= array.nchunks
        if not self.fill_missing and not self._all_written:
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
            for a, b in zip(starts.tolist(), stops.tolist()):
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

"""The stored chunks of one zarr array: located, fetched, decoded, checked, read.

A *unit* is one stored (inner) chunk: `(k,)` for a 1-D array, `(k, j)` for
row chunk k and column chunk j.
Design notes: docs/reference/design.md#zarr-chunks.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

from grain_cells import errors
from grain_cells._util import fork
from grain_cells.formats import (
    ChunkCache,
    ChunkDecodeError,
    naming_errors,
    pieces,
    run_parts,
)
from grain_cells.zarr._codecs import MAX_UINT_64, Codec
from grain_cells.zarr._keys import KeyReader, key_reader

AHEAD_BYTES = 256 << 20  # stored bytes fetched ahead of reads, per array, at most
_WHY_MISSING = {-1: " (its shard's index marks it empty)"}
_WHY_MISSING[-2] = " (the shard holding it is missing)"


class Chunks:
    """One array's chunks: located, fetched, decoded, cached (`RangeReader`'s base).

    `codec` is None where this array's codecs or store are not handled here.
    """

    def __init__(self, array, path: str, cache_bytes: int, fill_missing):
        self.path, self.name = path, "/" + array.path.lstrip("/")
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype).newbyteorder("=")
        self.fill_missing, self._cache_bytes = fill_missing, int(cache_bytes)
        codec = Codec.for_array(array) if array.ndim in (1, 2) else None
        self.keys: KeyReader | None = key_reader(array.store) if codec else None
        self.codec: Codec | None = codec if self.keys is not None else None
        self.filled: dict[int, str] = {}  # row chunks read as the fill value: keys
        self._first_stored: int | None = None
        self._meta, self._prefix = array.metadata, array.path.strip("/")
        self._cols = None  # column chunks of a 2-D array
        if len(self.shape) > 1 and self.codec is not None:
            self._cols = range(max(1, -(-self.shape[1] // codec.chunk_shape[1])))
        self._shard_index: dict[tuple[int, ...], np.ndarray | None] = {}
        self._after_fork()  # and in a forked child: fresh locks, no read-ahead
        fork.in_child_of(self, Chunks._after_fork)

    def _after_fork(self) -> None:
        self._lock, self._check_lock = threading.Lock(), threading.Lock()
        self._cache = ChunkCache()
        self._ahead: dict[tuple[int, ...], bytes | None] = {}
        self._ahead_bytes = 0
        self._inflight: dict[tuple[int, ...], concurrent.futures.Future] = {}

    def units(self, k: int) -> list[tuple[int, ...]]:
        return [(k,)] if self._cols is None else [(k, j) for j in self._cols]

    def key(self, coords: tuple[int, ...]) -> str:
        key = self._meta.encode_chunk_key(tuple(coords))
        return f"{self._prefix}/{key}" if self._prefix else key

    def shard_of(self, unit) -> tuple[tuple[int, ...], int]:
        """`(shard coords, the unit's position in the shard's index)`."""
        per = self.codec.shard.per_shard
        if len(unit) == 1:
            return (unit[0] // per[0],), unit[0] % per[0]
        k, j = unit
        return (k // per[0], j // per[1]), (k % per[0]) * per[1] + j % per[1]

    def load_indices(self, row_chunks) -> None:
        """`load_shard_indices` of these row chunks' shards (none if not sharded)."""
        if self.codec.shard is not None:
            units = (u for k in row_chunks for u in self.units(k))
            self.load_shard_indices(sorted({self.shard_of(u)[0] for u in units}))

    def load_shard_indices(self, shards: list[tuple[int, ...]]) -> None:
        layout = self.codec.shard
        todo = [s for s in shards if s not in self._shard_index]
        if not todo:
            return
        n = layout.index_nbytes
        keys = [self.key(s) for s in todo]
        requests = [(key, -n, None) if layout.at_end else (key, 0, n) for key in keys]
        got = self.keys.get_many(requests)
        for s, key, raw in zip(todo, keys, got, strict=True):
            index = None
            if raw is not None:
                try:
                    index = layout.parse_index(raw)
                except ChunkDecodeError as e:
                    rows = self.rows(s[0], layout.shard_shape[0])
                    raise self.corrupt(
                        f"shard {key!r} has a corrupt index: {e}. It holds rows "
                        f"{rows} of {self.name}; the store is damaged: rewrite it.",
                        rows,
                    ) from None
            with self._lock:
                self._shard_index[s] = index

    def rows(self, k: int, per: int | None = None) -> tuple[int, int]:
        """`[first, stop)` rows of row chunk (or shard, `per` rows each) `k`."""
        per = self.codec.chunk_shape[0] if per is None else per
        return (k * per, min((k + 1) * per, self.shape[0]))

    def request(self, unit):
        """`(key, start, stop)`; start None: all, -1: empty, -2: no shard."""
        if self.codec.shard is None:
            return self.key(unit), None, None
        s, i = self.shard_of(unit)
        key = self.key(s)
        index = self._shard_index.get(s)
        if index is None:  # no shard at all
            return key, -2, None
        off, n = int(index[i, 0]), int(index[i, 1])
        if off == MAX_UINT_64 and n == MAX_UINT_64:
            return key, -1, None
        return key, off, off + n

    def first_stored(self) -> int:
        """The first row chunk with a stored chunk (once; scans from 0)."""
        if self._first_stored is None:
            n = max(1, -(-self.shape[0] // self.codec.chunk_shape[0]))
            self._first_stored = next((k for k in range(n) if self._stored(k)), n)
        return self._first_stored

    def _stored(self, k: int) -> bool:
        self.load_indices([k])
        asks = [self.request(u)[:2] for u in self.units(k)]
        return any(
            a >= 0 if a is not None else self.keys.get(key) is not None
            for key, a in asks
        )

    def _get_units(self, todo) -> dict:
        """`{unit: its stored bytes or None}` of `(unit, request)` pairs, at once."""
        asks = [r for _, r in todo if r[1] is None or r[1] >= 0]
        got = iter(self.keys.get_many(asks))
        return {
            u: None if r[1] is not None and r[1] < 0 else next(got) for u, r in todo
        }

    def prefetch(self, row_chunks: list[int]) -> None:
        """Starts fetching these row chunks' bytes (held up to `AHEAD_BYTES`)."""
        units = [u for k in row_chunks for u in self.units(k) if u not in self._ahead]
        units = [u for u in units if self._cached(u) is None]
        with self._lock:
            units = [u for u in units if u not in self._inflight]
            if not units or self._ahead_bytes >= AHEAD_BYTES:
                return
            pool = fork.thread_pool("grain_cells-zarr-ahead", 1)  # one per process
            future = pool.submit(self._prefetch, units)
            for u in units:
                self._inflight[u] = future

    def _prefetch(self, units) -> None:
        try:
            self.load_indices({u[0] for u in units})
            got = self._get_units([(u, self.request(u)) for u in units])
        except Exception:  # the read fetches again (and reports)
            got = {}
        with self._lock:
            for u in units:
                self._inflight.pop(u, None)
                if u in got and self._ahead_bytes < AHEAD_BYTES:
                    self._ahead[u] = got[u]
                    self._ahead_bytes += len(got[u] or b"")

    def wait_prefetch(self, row_chunks) -> None:
        """Waits for read-ahead jobs that fetch any of these row chunks."""
        units = [u for k in row_chunks for u in self.units(k)]
        with self._lock:
            futures = {self._inflight[u] for u in units if u in self._inflight}
        concurrent.futures.wait(futures)

    def _read_chunks(self, starts, stops, dest, pool=None, pending=None) -> None:
        """Reads sorted, disjoint, non-empty ranges, concatenated, into `dest`."""
        chunk, src, dst, n = pieces(starts, stops, int(self.codec.chunk_shape[0]))
        uniq, lo = np.unique(chunk, return_index=True)
        hi, uniq = np.append(lo[1:], chunk.size).tolist(), uniq.tolist()
        lo, src, dst, n = lo.tolist(), src.tolist(), dst.tolist(), n.tolist()
        units = [u for k in uniq for u in self.units(k)]
        raw = None
        if self.keys.remote:  # read-ahead of these chunks (indices included) first
            self.wait_prefetch(uniq)
        self.load_indices(uniq)
        if self.keys.remote:  # every chunk's bytes at once: read ahead, or GET
            with self._lock:
                raw = {u: self._ahead.pop(u) for u in units if u in self._ahead}
                self._ahead_bytes -= sum(len(data or b"") for data in raw.values())
            todo = [u for u in units if u not in raw and self._cached(u) is None]
            raw.update(self._get_units([(u, self.request(u)) for u in todo]))
        cc = self.codec.chunk_shape[1] if self._cols is not None else 0

        def task(a: int, b: int) -> None:
            with naming_errors(self):  # a pool's task raises outside `read`'s
                _task(a, b)

        def _task(a: int, b: int) -> None:
            for x in range(a, b):
                for unit in self.units(uniq[x]):
                    chunk, into, cut = self.chunk(unit, raw), ..., ...
                    if cc:  # a 2-D chunk: its columns (the last one cut short)
                        into = slice(unit[1] * cc, (unit[1] + 1) * cc)
                        cut = slice(0, self.shape[1] - unit[1] * cc)
                    for p in range(lo[x], hi[x]):
                        s, d, m = src[p], dst[p], n[p]
                        dest[d : d + m, into] = chunk[s : s + m, cut]

        for a, b in run_parts(pool, len(uniq), task, pending):
            task(a, b)

    def chunk(self, unit, raw: dict | None) -> np.ndarray:
        """The unit decoded (`CorruptChunkError`; fills a missing one if allowed)."""
        chunk = self._cached(unit)
        if chunk is not None:
            return chunk
        key, a, b = self.request(unit)
        if raw is not None and unit in raw:
            data = raw[unit]
        else:
            data = None if a is not None and a < 0 else self.keys.get(key, a, b)
        rows = self.rows(unit[0])
        where = f"chunk {unit}" + (f" (in shard {key!r})" if a is not None else "")
        if data is None:
            if self.fill_missing is True or (
                self.fill_missing == "leading" and unit[0] < self.first_stored()
            ):
                self.filled[unit[0]] = key
                fill = np.asarray(self._meta.fill_value or 0, self.dtype)
                return np.full(self.codec.chunk_shape, fill, self.dtype)
            raise self.corrupt(
                f"{where} is missing: key {key!r} was never written"
                f"{_WHY_MISSING.get(a, '')}. It holds rows [{rows[0]}, {rows[1]}) of "
                f"{self.name}; zarr would read it as the fill value. The store is "
                "incomplete (an interrupted write or copy): rewrite or re-copy it.",
                rows,
                key,
            )
        try:
            if a is not None and len(data) != b - a:
                raise ChunkDecodeError(
                    f"the shard index places it at bytes [{a}, {b}) but the "
                    f"shard ends {b - a - len(data)} bytes early (truncated)"
                )
            chunk = self.codec.decode(data)
        except ChunkDecodeError as e:
            raise self.corrupt(
                f"{where}, key {key!r} ({self.codec.describe()}) is corrupt: {e}. It "
                f"holds rows [{rows[0]}, {rows[1]}) of {self.name}; the store is "
                "damaged: rewrite or re-copy it.",
                rows,
                key,
                a,
            ) from None
        if self._cache_bytes:
            self._cache.put(0, unit, chunk, self._cache_bytes)
        return chunk

    def corrupt(self, what: str, rows, key=None, offset=None):
        """`CorruptChunkError`: "<path>: <array> " + `what`, its fields set."""
        return errors.CorruptChunkError(
            f"{self.path}: {self.name} {what}",
            path=self.path,
            dataset=self.name,
            byte_offset=offset,
            rows=rows,
            chunk_key=key,
        )

    def _cached(self, unit) -> np.ndarray | None:
        return self._cache.get(0, unit) if self._cache_bytes else None

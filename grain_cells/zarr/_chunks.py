"""The stored chunks of one zarr array: located, fetched, decoded, checked.

A *unit* is one stored (inner) chunk: `(k,)` for a 1-D array, `(k, j)` for
row chunk k and column chunk j.

Design notes: docs/reference/design.md#zarr-chunks.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import zarr

from grain_cells import errors
from grain_cells._util import fork
from grain_cells.formats import ChunkCache, ChunkDecodeError
from grain_cells.zarr._codecs import MAX_UINT_64, Codec
from grain_cells.zarr._keys import KeyReader

# Stored bytes fetched ahead of reads, per array, at most.
AHEAD_BYTES = 256 << 20
# One thread per process runs read-ahead jobs (each sends its GETs at once).
_ahead_threads = fork.ProcessCache()


_WHY_MISSING = {
    -1: " (its shard's index marks it empty)",
    -2: " (the shard holding it is missing)",
}


def _kj(unit: tuple[int, ...]) -> tuple[int, int]:
    return unit[0], (unit[1] if len(unit) > 1 else 0)


class Chunks:
    """Locates, fetches, decodes and caches one array's chunks. Thread-safe."""

    def __init__(
        self,
        array: zarr.Array,
        path: str,
        codec: Codec,
        keys: KeyReader,
        *,
        cache_bytes: int = 0,
        fill_missing: bool | str = False,
    ):
        """`fill_missing` as in `RangeReader` (True or `"leading"`)."""
        self.path = path
        self.name = "/" + array.path.lstrip("/")
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype).newbyteorder("=")
        self.fill_missing = (
            fill_missing if fill_missing == "leading" else bool(fill_missing)
        )
        self._first_stored: int | None = None
        # Row chunks read as the fill value (never written), with their keys.
        self.filled: dict[int, str] = {}
        self._codec = codec
        self._keys = keys
        self._meta = array.metadata
        self._prefix = array.path.strip("/")
        fill = self._meta.fill_value
        self._fill = np.asarray(0 if fill is None else fill, self.dtype)
        self._cache_bytes = int(cache_bytes)
        self._cache = ChunkCache()
        self._lock = threading.Lock()
        self._shard_index: dict[tuple[int, ...], np.ndarray | None] = {}
        self._ahead: dict[tuple[int, ...], bytes | None] = {}
        self._ahead_bytes = 0
        self._inflight: dict[tuple[int, ...], concurrent.futures.Future] = {}
        # A forked child gets fresh locks (a parent's thread may hold one at
        # the fork) and none of the parent's read-ahead.
        fork.in_child_of(self, Chunks._forget_ahead)

    @property
    def codec(self) -> Codec:
        return self._codec

    @property
    def keys(self) -> KeyReader:
        return self._keys

    def col_chunks(self) -> int:
        if len(self.shape) < 2:
            return 1
        return max(1, -(-self.shape[1] // self._codec.chunk_shape[1]))

    def units(self, k: int) -> list[tuple[int, ...]]:
        if len(self.shape) < 2:
            return [(k,)]
        return [(k, j) for j in range(self.col_chunks())]

    def key(self, coords: tuple[int, ...]) -> str:
        key = self._meta.encode_chunk_key(tuple(coords))
        return f"{self._prefix}/{key}" if self._prefix else key

    def shard_of(self, k: int, j: int):
        """`(shard coords, inner chunk's position in the index)`."""
        per = self._codec.shard.per_shard
        if len(self.shape) < 2:
            return (k // per[0],), k % per[0]
        return (k // per[0], j // per[1]), (k % per[0]) * per[1] + j % per[1]

    def shards_of(self, row_chunks) -> list[tuple[int, ...]]:
        return sorted(
            {self.shard_of(k, u[-1])[0] for k in row_chunks for u in self.units(k)}
        )

    def load_shard_indices(self, shards: list[tuple[int, ...]]) -> None:
        layout = self._codec.shard
        todo = [s for s in shards if s not in self._shard_index]
        if not todo:
            return
        n = layout.index_nbytes
        requests = []
        for s in todo:
            key = self.key(s)
            requests.append((key, -n, None) if layout.at_end else (key, 0, n))
        got = self._keys.get_many(requests)
        for s, (key, _, _), raw in zip(todo, requests, got, strict=False):
            index = None
            if raw is not None:
                try:
                    index = layout.parse_index(raw)
                except ChunkDecodeError as e:
                    raise errors.CorruptChunkError(
                        f"{self.path}: {self.name} shard {key!r} has a corrupt "
                        f"index: {e}. It holds rows {self.shard_rows(s)} of "
                        f"{self.name}; the store is damaged: rewrite it.",
                        path=self.path,
                        dataset=self.name,
                        rows=self.shard_rows(s),
                    ) from None
            with self._lock:
                self._shard_index[s] = index

    def shard_index(self, s: tuple[int, ...]) -> np.ndarray | None:
        """A loaded shard's index (`load_shard_indices`); None: no such shard."""
        return self._shard_index.get(s)

    def shard_rows(self, s) -> tuple[int, int]:
        return self.rows(s[0], self._codec.shard.shard_shape[0])

    def rows(self, k: int, per: int | None = None) -> tuple[int, int]:
        """`[first, stop)` rows of row chunk (or shard, `per` rows each) `k`."""
        per = self._codec.chunk_shape[0] if per is None else per
        return (k * per, min((k + 1) * per, self.shape[0]))

    def request(self, unit):
        """`(key, start, stop, offset in the shard)` of a unit's stored bytes.

        `start` None: the whole key; -1: the shard's index marks it empty; -2: no shard.
        """
        if self._codec.shard is None:
            return self.key(unit), None, None, None
        s, i = self.shard_of(*_kj(unit))
        key = self.key(s)
        index = self._shard_index.get(s)
        if index is None:  # no shard at all
            return key, -2, None, None
        off, n = int(index[i, 0]), int(index[i, 1])
        if off == MAX_UINT_64 and n == MAX_UINT_64:
            return key, -1, None, None
        return key, off, off + n, off

    def first_stored(self) -> int:
        """The first row chunk with a stored chunk (once; scans from 0)."""
        if self._first_stored is None:
            n = max(1, -(-self.shape[0] // self._codec.chunk_shape[0]))
            first = n
            for k in range(n):
                if self._codec.shard is not None:
                    self.load_shard_indices(self.shards_of([k]))
                if any(self._stored(u) for u in self.units(k)):
                    first = k
                    break
            self._first_stored = first
        return self._first_stored

    def _stored(self, unit) -> bool:
        key, a, _, _ = self.request(unit)
        if a is None:
            return self._keys.get(key) is not None
        return a >= 0

    def fetch_remote(self, uniq) -> dict:
        """Stored bytes (None: missing) of row chunks `uniq` (read ahead, or GET)."""
        self.wait_prefetch(uniq.tolist())
        units = [u for k in uniq.tolist() for u in self.units(k)]
        got_ahead = {}
        with self._lock:
            for u in units:
                if u in self._ahead:
                    data = self._ahead.pop(u)
                    self._ahead_bytes -= len(data or b"")
                    got_ahead[u] = data
        todo = [
            (u, self.request(u))
            for u in units
            if u not in got_ahead and self._cached(u) is None
        ]
        return {**got_ahead, **self._get_units(todo)}

    def _get_units(self, todo) -> dict:
        asks = [(key, a, b) for _, (key, a, b, _) in todo if a is None or a >= 0]
        got = iter(self._keys.get_many(asks))
        return {
            u: (None if (a is not None and a < 0) else next(got))
            for u, (_, a, _, _) in todo
        }

    def prefetch(self, row_chunks: list[int]) -> None:
        """Starts fetching these row chunks' bytes (held up to `AHEAD_BYTES`).

        A failed or dropped prefetch leaves the read to fetch (and report).
        """
        units = [
            u
            for k in row_chunks
            for u in self.units(k)
            if u not in self._ahead and self._cached(u) is None
        ]
        with self._lock:
            units = [u for u in units if u not in self._inflight]
            if not units or self._ahead_bytes >= AHEAD_BYTES:
                return
            future = _ahead_threads.get_or_make(
                "pool",
                lambda: concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="grain_cells-zarr-ahead"
                ),
            ).submit(self._prefetch, units)
            for u in units:
                self._inflight[u] = future

    def _prefetch(self, units) -> None:
        try:
            if self._codec.shard is not None:
                self.load_shard_indices(
                    sorted({self.shard_of(*_kj(u))[0] for u in units})
                )
            got = self._get_units([(u, self.request(u)) for u in units])
        except Exception:  # the read fetches again and reports
            got = {}
        with self._lock:
            for u in units:
                self._inflight.pop(u, None)
                if u in got and self._ahead_bytes < AHEAD_BYTES:
                    self._ahead[u] = got[u]
                    self._ahead_bytes += len(got[u] or b"")

    def _forget_ahead(self) -> None:
        self._lock, self._cache = threading.Lock(), ChunkCache()
        self._ahead, self._ahead_bytes, self._inflight = {}, 0, {}

    def wait_prefetch(self, row_chunks) -> None:
        """Waits for read-ahead jobs that fetch any of these row chunks."""
        units = [u for k in row_chunks for u in self.units(k)]
        with self._lock:
            futures = {self._inflight[u] for u in units if u in self._inflight}
        if futures:
            concurrent.futures.wait(futures)

    def chunk(self, unit, raw: dict | None) -> np.ndarray:
        chunk = self._cached(unit)
        if chunk is not None:
            return chunk
        key, a, b, off = self.request(unit)
        if raw is not None and unit in raw:
            data = raw[unit]
        elif a is None:
            data = self._keys.get(key)
        elif a < 0:
            data = None
        else:
            data = self._keys.get_range(key, a, b)
        rows = self.rows(unit[0])
        where = f"chunk {unit}" + (f" (in shard {key!r})" if a is not None else "")
        if data is None:
            if self.fill_missing is True or (
                self.fill_missing == "leading" and unit[0] < self.first_stored()
            ):
                self.filled[unit[0]] = key
                return np.full(self._codec.chunk_shape, self._fill, self.dtype)
            raise errors.CorruptChunkError(
                f"{self.path}: {self.name} {where} is missing: key {key!r} was "
                f"never written{_WHY_MISSING.get(a, '')}"
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

    def _cached(self, unit) -> np.ndarray | None:
        return self._cache.get(0, unit) if self._cache_bytes else None

    def _remember(self, unit, chunk: np.ndarray) -> None:
        if self._cache_bytes:
            self._cache.put(0, unit, chunk, self._cache_bytes)

"""The stored chunks of one zarr array: located, fetched, decoded, checked.

`Chunks` is the part of `grain_cells.zarr._reads.RangeReader` that knows
the store: which key (and, in a shard, which byte range) holds a chunk,
fetching it (`grain_cells.zarr._keys`), decoding it
(`grain_cells.zarr._codecs`), refusing a missing or damaged one by name, and
an LRU cache of decoded chunks. A *unit* is one stored (inner) chunk:
`(k,)` for a 1-D array, `(k, j)` for row chunk k and column chunk j.
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import zarr

from grain_cells import errors
from grain_cells.zarr._codecs import MAX_UINT_64, ChunkDecodeError, Codec
from grain_cells.zarr._keys import KeyReader


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
        fill_missing: bool = False,
    ):
        """Binds an array whose codecs `codec` decodes and whose store `keys` reads.

        Args:
            array: The array (its own metadata, not a consolidated copy).
            path: The store's path or URL, for error messages.
            codec: The array's chunk decoder.
            keys: A reader of the array's store.
            cache_bytes: Decoded bytes kept in an LRU cache.
            fill_missing: Read a never-written chunk as the fill value.
        """
        self.path = path
        self.name = "/" + array.path.lstrip("/")
        self.shape = tuple(array.shape)
        self.dtype = np.dtype(array.dtype).newbyteorder("=")
        self.fill_missing = bool(fill_missing)
        self._codec = codec
        self._keys = keys
        self._meta = array.metadata
        self._prefix = array.path.strip("/")
        fill = self._meta.fill_value
        self._fill = np.asarray(0 if fill is None else fill, self.dtype)
        self._cache_bytes = int(cache_bytes)
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._shard_index: dict[tuple[int, ...], np.ndarray | None] = {}

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

    def shard_rows(self, s) -> tuple[int, int]:
        rows = self._codec.shard.shard_shape[0]
        return (s[0] * rows, min((s[0] + 1) * rows, self.shape[0]))

    def request(self, unit):
        """Where a unit's stored bytes are: `(key, start, stop, offset)`.

        `start` None: the whole key; -1: the shard's index says missing.
        `offset` is the byte offset in the shard, for messages.
        """
        if self._codec.shard is None:
            return self.key(unit), None, None, None
        k, j = unit[0], (unit[1] if len(unit) > 1 else 0)
        s, i = self.shard_of(k, j)
        key = self.key(s)
        index = self._shard_index.get(s)
        if index is None:
            return key, -1, None, None
        off, n = int(index[i, 0]), int(index[i, 1])
        if off == MAX_UINT_64 and n == MAX_UINT_64:
            return key, -1, None, None
        return key, off, off + n, off

    def fetch_remote(self, uniq) -> dict:
        units = [u for k in uniq.tolist() for u in self.units(k)]
        todo = [(u, self.request(u)) for u in units if self._cached(u) is None]
        asks = [(key, a, b) for _, (key, a, b, _) in todo if a is None or a >= 0]
        got = iter(self._keys.get_many(asks))
        return {
            u: (None if (a is not None and a < 0) else next(got))
            for u, (_, a, _, _) in todo
        }

    def chunk(self, unit, raw: dict | None) -> np.ndarray:
        chunk = self._cached(unit)
        if chunk is not None:
            return chunk
        key, a, b, off = self.request(unit)
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

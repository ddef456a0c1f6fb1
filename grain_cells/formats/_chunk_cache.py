"""An LRU of decoded chunks that format readers share (`hdf5._chunks.SHARED`).

Design notes: docs/reference/design.md#formats-chunk-cache.
"""

from __future__ import annotations

import collections
import itertools
import threading

import numpy as np


class ChunkCache:
    """A thread-safe LRU of decoded chunks keyed by (reader token, chunk)."""

    def __init__(self):
        self._entries: collections.OrderedDict[tuple[int, int], np.ndarray] = (
            collections.OrderedDict()
        )
        self._held = 0
        self._lock = threading.Lock()
        self._tokens = itertools.count()

    def token(self) -> int:
        """A key prefix no other reader of this process has had."""
        return next(self._tokens)

    @property
    def nbytes(self) -> int:
        """Decoded bytes held."""
        return self._held

    def get(self, token: int, k: int) -> np.ndarray | None:
        """Chunk `k` of reader `token`, or None; marks it recently used."""
        with self._lock:
            chunk = self._entries.get((token, k))
            if chunk is not None:
                self._entries.move_to_end((token, k))
            return chunk

    def put(self, token: int, k: int, chunk: np.ndarray, budget: int) -> None:
        """Keeps `chunk`, evicting the least recently used past `budget` bytes."""
        if chunk.nbytes > budget:
            return
        with self._lock:
            old = self._entries.pop((token, k), None)
            if old is not None:
                self._held -= old.nbytes
            self._entries[(token, k)] = chunk
            self._held += chunk.nbytes
            while self._held > budget:
                _, evicted = self._entries.popitem(last=False)
                self._held -= evicted.nbytes

    def drop(self, token: int) -> None:
        """Forgets every chunk of reader `token` (it was closed)."""
        with self._lock:
            for key in [key for key in self._entries if key[0] == token]:
                self._held -= self._entries.pop(key).nbytes


__all__ = ["ChunkCache"]

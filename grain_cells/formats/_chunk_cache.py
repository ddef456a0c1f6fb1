"""A thread-safe LRU of decoded chunks that format readers share (`hdf5._chunks`).

Design notes: docs/reference/design.md#formats-chunk-cache.
"""

from __future__ import annotations

import collections
import itertools
import threading

import numpy as np


class ChunkCache:
    """Decoded chunks keyed by (reader token, chunk), least recently used evicted."""

    def __init__(self):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self.nbytes = 0  # decoded bytes held
        self._lock = threading.Lock()
        self.token = itertools.count().__next__  # a key prefix per reader

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
            self.nbytes += chunk.nbytes - (0 if old is None else old.nbytes)
            self._entries[(token, k)] = chunk
            while self.nbytes > budget:
                self.nbytes -= self._entries.popitem(last=False)[1].nbytes

    def drop(self, token: int) -> None:
        """Forgets every chunk of reader `token` (it was closed)."""
        with self._lock:
            for key in [key for key in self._entries if key[0] == token]:
                self.nbytes -= self._entries.pop(key).nbytes


__all__ = ["ChunkCache"]

"""Read-ahead of object ranges: range GETs issued before a fetch needs them.

Hints never change what is read, only when; memory is bounded by `budget`.

Design notes: docs/reference/design.md#storage-remote-read-ahead.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable

import numpy as np


@dataclasses.dataclass
class _Request:
    start: int
    end: int
    future: concurrent.futures.Future  # of the batch's list of buffers
    index: int  # this request's buffer in the batch
    needed: int  # hinted bytes inside [start, end)
    taken: int = 0


class ReadAhead:
    """Background range GETs of hinted pieces of one object; thread-safe."""

    def __init__(
        self,
        get_many: Callable[[list[tuple[int, int]]], list],
        pool: Callable[[], concurrent.futures.Executor],
        budget: int,
        batch: int = 1,
    ):
        """`get_many([(start, end), ...])`: one buffer per range, run in `pool()`."""
        self._get_many = get_many
        self._pool = pool
        self._batch = max(1, int(batch))
        self._budget = int(budget)
        self._held = 0
        self._starts: list[int] = []
        self._requests: dict[int, _Request] = {}  # by start, oldest first
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Bytes of requests held or in flight."""
        return self._held

    def hint(self, requests: list[tuple[int, int, int]]) -> None:
        """Starts GETs of `(start, end, hinted bytes)` not already held."""
        with self._lock:
            batch: list[_Request] = []
            for start, end, needed in requests:
                if self._covered(start, end):
                    continue
                size = end - start
                self._evict(size)
                if self._held + size > self._budget or start in self._requests:
                    continue
                request = _Request(start, end, None, len(batch), needed)
                batch.append(request)
                self._requests[start] = request
                bisect.insort(self._starts, start)
                self._held += size
                if len(batch) == self._batch:
                    self._send(batch)
                    batch = []
            if batch:
                self._send(batch)

    def _send(self, batch: list[_Request]) -> None:
        ranges = [(r.start, r.end) for r in batch]
        future = self._pool().submit(self._get_many, ranges)
        for r in batch:
            r.future = future

    def _covered(self, start: int, end: int) -> bool:
        k = bisect.bisect_right(self._starts, start) - 1
        return k >= 0 and self._requests[self._starts[k]].end >= end

    def _evict(self, size: int) -> None:
        if self._held + size <= self._budget:
            return  # (listing the held requests per hint cost ~7% of a reader)
        for start in list(self._requests):
            if self._held + size <= self._budget:
                return
            if self._requests[start].future.done():
                self._drop(start)

    def _drop(self, start: int) -> None:
        request = self._requests.pop(start)
        self._starts.pop(bisect.bisect_left(self._starts, start))
        self._held -= request.end - request.start

    def take(self, off: int, n: int, dest: memoryview, d: int) -> bool:
        """Copies bytes `[off, off + n)` to `dest[d:]` if held (False: read them)."""
        parts = []
        with self._lock:
            pos, end = off, off + n
            while pos < end:
                k = bisect.bisect_right(self._starts, pos) - 1
                if k < 0:
                    return False
                request = self._requests[self._starts[k]]
                if request.end <= pos:
                    return False
                parts.append(request)
                pos = request.end
        pos = off
        for request in parts:
            try:
                data = request.future.result()[request.index]
            except Exception:  # the read's own GET reports it
                return False
            stop = min(off + n, request.end)
            view = np.frombuffer(data, np.uint8)
            dest[d + pos - off : d + stop - off] = view[
                pos - request.start : stop - request.start
            ]
            with self._lock:
                request.taken += stop - pos
                held = self._requests.get(request.start) is request
                if held and request.taken >= request.needed:
                    self._drop(request.start)
            pos = stop
        return True

    def clear(self) -> None:
        """Drops every request; cancels the batches that have not started."""
        with self._lock:
            for request in self._requests.values():
                request.future.cancel()
            self._requests.clear()
            self._starts.clear()
            self._held = 0

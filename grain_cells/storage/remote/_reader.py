"""`RemoteByteReader`: range GETs of one object version, merged, concurrent, ahead.

Design notes: docs/reference/design.md#storage-remote-reader.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import itertools
import pathlib
import threading

import numpy as np

from grain_cells import errors
from grain_cells._util import fork
from grain_cells._util.cache_files import write_atomic
from grain_cells.storage._readers import FileStat, ShortReadError, plan_requests
from grain_cells.storage.remote import _versions
from grain_cells.storage.remote._store import max_in_flight

MERGE_GAP = 64 << 10
# GETs in flight per `obstore.get_ranges` call; per read-ahead call (design notes).
PARALLEL = 10
BATCH = 64
MAX_REQUEST_BYTES = 16 << 20
PIN_BYTES = 64 << 20
READAHEAD_BYTES = 256 << 20
_MAGIC = b"GCPIECE1"  # a file of `Pieces`
_plan = functools.partial(plan_requests, gap=MERGE_GAP, max_bytes=MAX_REQUEST_BYTES)


class Pieces:
    """Bytes of one object version by offset, sorted; saved to `path` if given.

    Saved as `_MAGIC`, the count n, n offsets, n sizes (int64) and the bytes.
    """

    def __init__(self, path: pathlib.Path | None = None):
        self.path, self.starts, self.datas = path, [], []
        self.nbytes, self.dirty = 0, False
        self.lock = threading.Lock()

    def find(self, off: int, n: int) -> memoryview | None:
        """Bytes `[off, off + n)` if one piece holds them all."""
        with self.lock:
            k = bisect.bisect_right(self.starts, off) - 1
            if k >= 0 and off + n <= self.starts[k] + len(self.datas[k]):
                return memoryview(self.datas[k])[off - self.starts[k] :][:n]
        return None

    def add(self, off: int, data) -> None:
        """Keeps a copy of `data` at `off` (merged only by `save`: else quadratic)."""
        with self.lock:
            k = bisect.bisect_right(self.starts, off)
            self.starts.insert(k, off)
            self.datas.insert(k, bytes(data))
            self.nbytes += len(data)
            self.dirty = True

    def load(self) -> None:
        """Reads the pieces saved at `path` (`OSError`, `ValueError` if damaged)."""
        raw = np.fromfile(self.path, np.uint8)
        n = int(raw[8:16].view(np.int64)[0]) if raw[:8].tobytes() == _MAGIC else -1
        table = raw[16 : 16 + 16 * max(n, 0)].view(np.int64)
        data = raw[16 + 16 * max(n, 0) :]
        if n < 0 or table.size != 2 * n or int(table[n:].sum()) != data.size:
            raise ValueError(f"{self.path}: not a whole file of pieces")
        bounds = np.concatenate([[0], np.cumsum(table[n:])]).tolist()
        self.starts, self.nbytes = table[:n].tolist(), bounds[-1]
        self.datas = [data[a:b] for a, b in itertools.pairwise(bounds)]

    def save(self) -> None:
        """Writes the pieces, overlapping or touching ones joined, to `path`."""
        with self.lock:
            if not self.dirty:
                return
            starts, datas, end = [], [], -1
            for s, p in zip(self.starts, self.datas, strict=True):
                if s > end:
                    starts.append(s)
                    datas.append([p])
                elif s + len(p) > end:
                    datas[-1].append(p[end - s :])
                end = max(end, s + len(p))
            self.starts, self.datas = starts, [b"".join(run) for run in datas]
            sizes = [len(p) for p in self.datas]
            head = np.array([len(sizes), *self.starts, *sizes], np.int64)
            parts = [_MAGIC, head.tobytes(), *self.datas]
            self.dirty = False
        write_atomic(self.path, lambda f: f.writelines(parts))


@dataclasses.dataclass
class _Ahead:
    """A request read ahead: its buffer is `future.result()[index]`."""

    start: int
    end: int
    future: concurrent.futures.Future | None
    index: int
    needed: int  # hinted bytes inside [start, end)
    taken: int = 0


class RemoteByteReader:
    """Range GETs of one object version (ETag), merged and concurrent."""

    remote = True

    def __init__(self, url: str, storage_options: dict | None, stat: FileStat):
        """Binds the object version `stat` at `url`; sends no request."""
        self.name, self._options, self._stat = url, storage_options, stat
        self._pinned, self._lock = Pieces(), threading.Lock()
        in_flight = max_in_flight(storage_options)
        # Below PARALLEL, a call's size is what bounds its GETs in flight.
        self._small = in_flight < PARALLEL
        self._batch = in_flight if self._small else BATCH
        self._threads = max(1, in_flight // PARALLEL)  # calls at once
        # `verify_reads`: digests of every block of the version, else None.
        self._table = _versions.block_table(url, storage_options, stat)
        _versions.content_check_s(storage_options)  # (`stat` asks it: checked)
        # Read-ahead requests by start (oldest first), their bytes held or due.
        self._ahead: dict[int, _Ahead] = {}
        self._ahead_starts: list[int] = []
        self._ahead_held = 0

    def _get_many(self, ranges: list[tuple[int, int]]) -> list:
        """One buffer per `(start, end)`; `verify_reads` checks whole blocks."""
        stat, table = self._stat, self._table
        size = stat.size
        end = max(e for _, e in ranges)
        if end > size:
            raise ShortReadError(size, end)
        wide = ranges  # `verify_reads`: whole blocks
        if table is not None:
            block = _versions.DIGEST_BLOCK
            wide = [
                (a - a % block, min(size, -(-b // block) * block)) for a, b in ranges
            ]
        one = len(wide) == 1  # one round trip: a GET with If-Match (no HEAD)
        try:
            datas = _versions.get_ranges(self.name, self._options, wide, stat, one)
        except errors.SourceChangedError as e:  # caught mid-rewrite: say so
            if table is None:
                raise
            raise errors.SourceChangedError(
                f"{e} (Seen by verify_reads, before any block was checked: "
                "no byte of the new version was returned.)"
            ) from None
        if table is None:
            return datas
        return _versions.check_blocks(self.name, table, ranges, wide, datas)

    def read_into(self, dest, offsets, nbytes, dest_starts) -> None:
        """See `ByteReader.read_into`: pinned pieces from memory, others by GET."""
        dest = memoryview(dest)
        args = (offsets, nbytes, dest_starts)
        pieces = np.array([np.asarray(a, np.int64).reshape(-1) for a in args])
        if self._pinned.starts or self._ahead_held:
            keep = [not self._take(o, n, dest, d) for o, n, d in pieces.T.tolist()]
            pieces = pieces[:, keep]
        if pieces.shape[1] == 0:
            return
        pieces = pieces[:, np.argsort(pieces[0], kind="stable")]
        requests = _plan(pieces[0], pieces[1])
        offsets, nbytes, dest_starts = pieces.tolist()

        def run(batch) -> None:
            datas = self._get_many([(start, end) for start, end, _, _ in batch])
            for (start, _, a, b), data in zip(batch, datas, strict=True):
                data = memoryview(data)
                for i in range(a, b):
                    off, n, d = offsets[i] - start, nbytes[i], dest_starts[i]
                    dest[d : d + n] = data[off : off + n]

        # As many calls as threads, each of PARALLEL to BATCH requests.
        k = self._batch
        if not self._small:
            k = min(BATCH, max(PARALLEL, -(-len(requests) // self._threads)))
        batches = [requests[i : i + k] for i in range(0, len(requests), k)]
        if len(batches) == 1:
            run(batches[0])
            return
        pool = fork.thread_pool(f"grain_cells_get{self._threads}", self._threads)
        futures = [pool.submit(run, b) for b in batches]
        concurrent.futures.wait(futures)  # none still writing into `dest`
        for f in futures:
            f.result()

    def advise(self, offsets, nbytes) -> None:
        """Starts GETs of these pieces in the background, within `READAHEAD_BYTES`."""
        try:
            offsets = np.asarray(offsets, np.int64).reshape(-1)
            nbytes = np.asarray(nbytes, np.int64).reshape(-1)
            order = np.argsort(offsets, kind="stable")
            offsets, nbytes = offsets[order], nbytes[order]
            sums = np.concatenate([[0], np.cumsum(nbytes)]).tolist()
            with self._lock:
                batch: list[_Ahead] = []
                for start, end, a, b in _plan(offsets, nbytes):
                    if (held := self._ahead_at(start)) and held.end >= end:
                        continue  # covered
                    size = end - start
                    self._evict(size)
                    if (
                        self._ahead_held + size > READAHEAD_BYTES
                        or start in self._ahead
                    ):
                        continue
                    request = _Ahead(start, end, None, len(batch), sums[b] - sums[a])
                    batch.append(request)
                    self._ahead[start] = request
                    bisect.insort(self._ahead_starts, start)
                    self._ahead_held += size
                    if len(batch) == self._batch:
                        self._send(batch)
                        batch = []
                if batch:
                    self._send(batch)
        except Exception:  # a hint must never fail the pipeline
            return

    def _send(self, batch: list[_Ahead]) -> None:
        pool = fork.thread_pool(f"grain_cells_ahead{self._threads}", self._threads)
        future = pool.submit(self._get_many, [(r.start, r.end) for r in batch])
        for r in batch:
            r.future = future

    def _evict(self, size: int) -> None:
        if self._ahead_held + size <= READAHEAD_BYTES:
            return  # (listing the held requests per hint cost ~7% of a reader)
        for start in list(self._ahead):
            if self._ahead_held + size <= READAHEAD_BYTES:
                return
            if (future := self._ahead[start].future) is not None and future.done():
                self._drop(start)

    def _ahead_at(self, pos: int) -> _Ahead | None:
        """The held request that starts last at or before `pos` (locked)."""
        k = bisect.bisect_right(self._ahead_starts, pos) - 1
        return self._ahead[self._ahead_starts[k]] if k >= 0 else None

    def _drop(self, start: int) -> None:
        request = self._ahead.pop(start)
        self._ahead_starts.pop(bisect.bisect_left(self._ahead_starts, start))
        self._ahead_held -= request.end - request.start

    def _take(self, off: int, n: int, dest: memoryview, d: int) -> bool:
        """Copies bytes `[off, off + n)` pinned or read ahead to `dest[d:]`, if held."""
        piece = self._pinned.find(off, n) if self._pinned.starts else None
        if piece is not None:
            dest[d : d + n] = piece
            return True
        if not self._ahead_held:
            return False
        parts = []
        with self._lock:
            pos, end = off, off + n
            while pos < end:
                request = self._ahead_at(pos)
                if request is None or request.end <= pos:
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
            data = memoryview(data)[pos - request.start : stop - request.start]
            dest[d + pos - off : d + stop - off] = data
            with self._lock:
                request.taken += stop - pos
                held = self._ahead.get(request.start) is request
                if held and request.taken >= request.needed:
                    self._drop(request.start)
            pos = stop
        return True

    def pin(self, offsets, nbytes) -> None:
        """Fetches the pieces into memory in one read (within `PIN_BYTES`); raises."""
        todo, held = [], self._pinned.nbytes
        for off, n in zip(offsets, nbytes, strict=True):
            off, n = int(off), int(n)
            if held + n > PIN_BYTES:
                break
            if self._pinned.find(off, n) is None:
                todo.append((off, n))
                held += n
        if not todo:
            return
        sizes = [n for _, n in todo]
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        buf = np.empty(sum(sizes), np.uint8)
        self.read_into(buf, [off for off, _ in todo], sizes, starts)
        for (off, n), start in zip(todo, starts, strict=True):
            self._pinned.add(off, buf[start : start + n])

    def stat(self) -> FileStat:
        """The version read, or (an ETag not following content) the version now."""
        stat = self._stat
        if not stat.content or self._table is not None:
            return stat  # every read is checked (ETag; `verify_reads`)
        # Due `content_check_s` after this process last read the sampled
        # bytes (any open or reader), or at once if it found others there.
        if not _versions.content_due(self.name, stat.content, self._options):
            return stat
        return _versions.version_of(self.name, self._options)

    def close(self) -> None:
        """Drops the pinned and read-ahead pieces (cancels GETs not started)."""
        self._pinned = Pieces()
        with self._lock:
            for request in self._ahead.values():
                request.future.cancel()
            self._ahead.clear()
            self._ahead_starts.clear()
            self._ahead_held = 0

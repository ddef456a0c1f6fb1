"""`RemoteByteReader`: range GETs of one object version, merged and concurrent.

Design notes: docs/reference/design.md#storage-remote-reader.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import threading
import time

import numpy as np

from grain_cells import errors
from grain_cells._util import fork
from grain_cells.storage._identity import FileStat
from grain_cells.storage._readers import ShortReadError
from grain_cells.storage.remote import _range_gets, _versions
from grain_cells.storage.remote._read_ahead import ReadAhead
from grain_cells.storage.remote._store import ObjectStat, max_in_flight, store_for

MERGE_GAP = 64 << 10
# `obstore.get_ranges` sends up to PARALLEL requests of a call at once; a
# read-ahead call sends up to BATCH (one version check per BATCH GETs; 64
# measured 23-25k cells per reader CPU second against 19-20k for 8, and 128
# or more waits on round trips: benchmarks/RESULTS.md, round 6).
PARALLEL = 10
BATCH = 64
MAX_REQUEST_BYTES = 16 << 20
PIN_BYTES = 64 << 20
READAHEAD_BYTES = 256 << 20


# A forked child starts its own threads: the pools' belong to the parent.
_pools = fork.ProcessCache()


def _pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
    return _pools.get_or_make(
        name,
        lambda: concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix=f"grain_cells_{name}"
        ),
    )


def plan_requests(
    offsets: np.ndarray, nbytes: np.ndarray, gap: int = MERGE_GAP
) -> list[tuple[int, int, int, int]]:
    """Pieces sorted by offset grouped into `(start, end, first piece, stop piece)`.

    A piece joins a request it starts within `gap` bytes of, up to `MAX_REQUEST_BYTES`.
    """
    requests = []
    if offsets.size == 0:
        return requests
    ends = offsets + nbytes
    start, end, first = int(offsets[0]), int(ends[0]), 0
    for i in range(1, offsets.size):
        o, e = int(offsets[i]), int(ends[i])
        if o <= end + gap and max(end, e) - start <= MAX_REQUEST_BYTES:
            end = max(end, e)
            continue
        requests.append((start, end, first, i))
        start, end, first = o, e, i
    requests.append((start, end, first, int(offsets.size)))
    return requests


class RemoteByteReader:
    """Range GETs of one object version (ETag), merged and concurrent."""

    remote = True

    def __init__(self, url: str, storage_options: dict | None, stat: FileStat):
        """Binds the object version `stat` at `url`; sends no request."""
        self.name = url
        self._options = storage_options
        self._stat = stat
        self._pinned_starts: list[int] = []
        self._pinned: list[tuple[int, bytes]] = []
        self._pinned_bytes = 0
        self._lock = threading.Lock()
        in_flight = max_in_flight(storage_options)
        # Below PARALLEL, a call's size is what bounds its GETs in flight.
        self._small = in_flight < PARALLEL
        self._batch = in_flight if self._small else BATCH
        self._threads = max(1, in_flight // PARALLEL)  # calls at once
        self._object_store = None
        # `verify_reads`: digests of every block of the version read (taken
        # when this process opened the object), else None.
        self._table = None
        if stat.content:
            self._table = _versions.block_table(url, storage_options, stat)
        # Objects whose ETag does not follow their content: when `stat`
        # next re-reads their sampled bytes.
        self._check_s = _versions.content_check_s(storage_options)
        self._next_check = time.monotonic() + self._check_s
        fork.in_child_of(self, RemoteByteReader._forget_store)
        self._ahead = ReadAhead(
            self._get_many,
            lambda: _pool(f"ahead{self._threads}", self._threads),
            READAHEAD_BYTES,
            batch=self._batch,
        )

    def _store(self):
        """This process's store for the object (a forked child builds its own)."""
        store = self._object_store
        if store is None:
            store = self._object_store = store_for(self.name, self._options)
        return store

    def _forget_store(self) -> None:
        self._object_store = None

    def _get_many(self, ranges: list[tuple[int, int]]) -> list:
        end = max(e for _, e in ranges)
        if end > self._stat.size:
            raise ShortReadError(self._stat.size, end)
        if self._table is not None:
            return self._get_checked(ranges)
        return self._get_unchecked(ranges)

    def _get_checked(self, ranges: list[tuple[int, int]]) -> list:
        """`verify_reads`: whole blocks read, each checked, then cut to size."""
        size = self._stat.size
        wide = [_versions.widen(a, b, size) for a, b in ranges]
        try:
            datas = self._get_unchecked(wide)
        except errors.SourceChangedError as e:  # caught mid-rewrite: say so
            raise errors.SourceChangedError(
                f"{e} (Seen by verify_reads, before any block was checked: "
                "no byte of the new version was returned.)"
            ) from None
        out = []
        for (a, b), (wa, _), data in zip(ranges, wide, datas, strict=True):
            _versions.check_blocks(self.name, self._table, wa, data)
            out.append(memoryview(data)[a - wa : b - wa])
        return out

    def _get_unchecked(self, ranges: list[tuple[int, int]]) -> list:
        if len(ranges) == 1:  # one round trip: a GET with If-Match, no HEAD
            (start, end), store = ranges[0], self._store()
            etag = self._stat.etag
            return [
                _range_gets.get_range(self.name, self._options, start, end, etag, store)
            ]
        version = ObjectStat(self._stat.size, self._stat.etag, self._stat.mtime_ns)
        return _range_gets.get_ranges(
            self.name, self._options, ranges, version, self._store()
        )

    def _from_pinned(self, off: int, n: int):
        k = bisect.bisect_right(self._pinned_starts, off) - 1
        if k < 0:
            return None
        start, data = self._pinned[k]
        if off + n <= start + len(data):
            return memoryview(data)[off - start : off - start + n]
        return None

    def read_into(self, dest, offsets, nbytes, dest_starts) -> None:
        """See `ByteReader.read_into`: pinned pieces from memory, others by GET."""
        dest = memoryview(dest)
        offsets = np.asarray(offsets, np.int64).reshape(-1)
        nbytes = np.asarray(nbytes, np.int64).reshape(-1)
        dest_starts = np.asarray(dest_starts, np.int64).reshape(-1)
        if self._pinned or self._ahead.held_bytes:
            keep = np.ones(offsets.size, bool)
            pieces = zip(
                offsets.tolist(), nbytes.tolist(), dest_starts.tolist(), strict=True
            )
            for i, (off, n, d) in enumerate(pieces):
                piece = self._from_pinned(off, n)
                if piece is not None:
                    dest[d : d + n] = piece
                    keep[i] = False
                elif self._ahead.held_bytes and self._ahead.take(off, n, dest, d):
                    keep[i] = False
            offsets, nbytes, dest_starts = (
                offsets[keep],
                nbytes[keep],
                dest_starts[keep],
            )
        if offsets.size == 0:
            return
        order = np.argsort(offsets, kind="stable")
        offsets, nbytes, dest_starts = offsets[order], nbytes[order], dest_starts[order]
        requests = plan_requests(offsets, nbytes)
        offsets, nbytes = offsets.tolist(), nbytes.tolist()
        dest_starts = dest_starts.tolist()

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
        pool = _pool(f"get{self._threads}", self._threads)
        futures = [pool.submit(run, b) for b in batches]
        for f in futures:
            f.result()

    def advise(self, offsets, nbytes) -> None:
        """Starts GETs of these pieces in the background (see `read_ahead`)."""
        try:
            offsets = np.asarray(offsets, np.int64).reshape(-1)
            nbytes = np.asarray(nbytes, np.int64).reshape(-1)
            order = np.argsort(offsets, kind="stable")
            offsets, nbytes = offsets[order], nbytes[order]
            sums = np.concatenate([[0], np.cumsum(nbytes)])
            self._ahead.hint(
                [
                    (start, end, int(sums[b] - sums[a]))
                    for start, end, a, b in plan_requests(offsets, nbytes)
                ]
            )
        except Exception:  # a hint must never fail the pipeline
            return

    def pin(self, offsets, nbytes) -> None:
        """Fetches the pieces into memory (within `PIN_BYTES` per reader)."""
        try:
            for off, n in zip(offsets, nbytes, strict=True):
                off, n = int(off), int(n)
                with self._lock:
                    if self._pinned_bytes + n > PIN_BYTES:
                        return
                    if self._from_pinned(off, n) is not None:
                        continue
                buf = bytearray(n)
                self.read_into(np.frombuffer(buf, np.uint8), [off], [n], [0])
                with self._lock:
                    k = bisect.bisect_right(self._pinned_starts, off)
                    self._pinned_starts.insert(k, off)
                    self._pinned.insert(k, (off, bytes(buf)))
                    self._pinned_bytes += n
        except Exception:  # a hint: the read itself reports failures
            return

    def stat(self) -> FileStat:
        """The version read, or (ETag not following content) the version now.

        The latter at most every `content_check_s` seconds (`_versions.version_of`).
        """
        if not self._stat.content or self._table is not None:
            return self._stat  # every read is checked (ETag; `verify_reads`)
        now = time.monotonic()
        with self._lock:
            if now < self._next_check:
                return self._stat
            self._next_check = now + self._check_s
        return _versions.version_of(self.name, self._options, self._store())

    def close(self) -> None:
        """Drops the pinned and read-ahead pieces."""
        self._ahead.clear()
        with self._lock:
            self._pinned_starts.clear()
            self._pinned.clear()
            self._pinned_bytes = 0

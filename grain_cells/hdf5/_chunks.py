"""Rows of a compressed, chunked HDF5 dataset, its chunks decoded in threads.

`ChunkedReader` is the compressed counterpart of the positional path
(`grain_cells.hdf5._reads`): it takes every chunk's offset, size and filter
mask from HDF5 once, then reads and decodes the chunks a batch touches.
Memory per thread: one merged run of stored bytes (at most `MAX_RUN_BYTES`)
and a decoded chunk or two; hot chunks go to `SHARED`.

Design notes: docs/reference/design.md#hdf5-chunks.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref

import h5py
import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import chunk_pieces, chunks_touched
from grain_cells.formats import ChunkCache, ChunkDecodeError, run_parts
from grain_cells.hdf5._codecs import Pipeline
from grain_cells.storage import ByteReader, ShortReadError, as_byte_reader

MAX_RUN_BYTES = 4 << 20
# Decoded chunks of every reader of the process, each trimming it to its own
# `cache_bytes` (design notes, formats-chunk-cache).
SHARED = ChunkCache()


def chunk_table(dsid, chunk_len: int, n_rows: int):
    """`(offsets, sizes, filter masks)` of each row chunk (offset -1: unwritten)."""
    n_chunks = -(-n_rows // chunk_len)
    offsets = np.full(n_chunks, -1, np.int64)
    sizes = np.zeros(n_chunks, np.int64)
    masks = np.zeros(n_chunks, np.uint32)

    def visit(info):
        k = info.chunk_offset[0] // chunk_len
        if k < n_chunks:
            offsets[k], sizes[k] = info.byte_offset, info.size
            masks[k] = info.filter_mask

    if n_chunks:
        dsid.chunk_iter(visit)
    return offsets, sizes, masks


class ChunkedReader:
    """Reads sorted, disjoint ranges of a compressed dataset (built by `create`)."""

    def __init__(
        self,
        dataset: h5py.Dataset,
        path: str,
        fd: int | ByteReader,
        pipeline: Pipeline,
        offsets: np.ndarray,
        sizes: np.ndarray,
        masks: np.ndarray,
        *,
        cache_bytes: int = 0,
    ):
        """Binds a dataset's chunk table; prefer `create`."""
        self.name = dataset.name
        self.path = path
        self.dtype = dataset.dtype
        self.shape = dataset.shape
        self.pipeline = pipeline
        self.chunk_len = int(dataset.chunks[0])
        self._row_bytes = int(np.prod(dataset.shape[1:], dtype=np.int64)) * (
            self.dtype.itemsize
        )
        self._fd = as_byte_reader(fd, path)
        self._offsets = offsets
        self._sizes = sizes
        self._masks = masks
        self._local = threading.local()
        self._cache_bytes = int(cache_bytes)
        self._token = SHARED.token()
        if self._cache_bytes:  # its chunks leave the cache with the reader
            weakref.finalize(self, SHARED.drop, self._token)

    @classmethod
    def create(
        cls,
        dataset: h5py.Dataset,
        path: str,
        fd: int | ByteReader,
        *,
        cache_bytes: int = 0,
    ) -> ChunkedReader | None:
        """A reader for `dataset`, or None if it must be read through h5py.

        None unless chunked in whole rows, filtered by a `Pipeline` this
        module decodes, of a native numeric dtype, with every chunk written.
        `cache_bytes`: decoded chunks kept in `SHARED` (0: none).
        """
        if dataset.chunks is None or dataset.ndim not in (1, 2):
            return None
        if not dataset.dtype.isnative or dataset.dtype.hasobject:
            return None
        if tuple(dataset.chunks[1:]) != tuple(dataset.shape[1:]):
            return None
        pipeline = Pipeline.for_dataset(dataset)
        if pipeline is None:
            return None
        table = chunk_table(dataset.id, int(dataset.chunks[0]), dataset.shape[0])
        if (table[0] < 0).any():
            return None
        return cls(dataset, path, fd, pipeline, *table, cache_bytes=cache_bytes)

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Asks the OS to read the stored chunks these ranges touch (async)."""
        chunks = chunks_touched(starts, stops, self.chunk_len)
        self._fd.advise(self._offsets[chunks].tolist(), self._sizes[chunks].tolist())

    def pin(self) -> None:
        """Asks the OS to read every stored chunk of the dataset (async)."""
        self._fd.pin(self._offsets.tolist(), self._sizes.tolist())

    def read(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        out: np.ndarray,
        pool: concurrent.futures.Executor | None = None,
        pending: list[concurrent.futures.Future] | None = None,
    ) -> None:
        """`formats.RangeReader.read`, for non-empty ranges within the dataset."""
        c = self.chunk_len
        rb = self._row_bytes
        chunk, p_start, p_stop = chunk_pieces(starts, stops, c)
        nbytes = (p_stop - p_start) * rb
        src = (p_start - chunk * c) * rb
        dst = np.cumsum(nbytes) - nbytes
        total = int(nbytes.sum())
        dest = out.reshape(-1).view(np.uint8)
        if total > dest.size:
            raise ValueError(
                f"destination holds {dest.size} bytes, the ranges need {total}"
            )
        # Pieces are sorted by chunk: each chunk's pieces are one slice.
        uniq, piece_lo = np.unique(chunk, return_index=True)
        piece_hi = np.append(piece_lo[1:], chunk.size)
        runs = self._runs(uniq)
        if self._fd.remote and not self._cache_bytes and len(runs) > 1:
            self._hint_runs(uniq, runs)  # every run's GET in flight at once
        pieces = (src.tolist(), dst.tolist(), nbytes.tolist())
        work = (uniq, piece_lo, piece_hi, pieces, dest)

        def task(a, b):
            self._read_runs(runs[a:b], work)

        for a, b in run_parts(pool, len(runs), task, pending):
            task(a, b)

    def _runs(self, uniq: np.ndarray) -> list[tuple[int, int]]:
        """Positions `[a, b)` into `uniq` of chunks read with one pread each."""
        offsets = self._offsets[uniq]
        sizes = self._sizes[uniq]
        order_ok = uniq.size < 2 or bool((offsets[1:] > offsets[:-1]).all())
        if not order_ok:  # chunks stored out of order: one read per chunk
            return [(i, i + 1) for i in range(uniq.size)]
        touching = offsets[1:] == offsets[:-1] + sizes[:-1]
        runs = []
        a = 0
        run_bytes = int(sizes[0]) if uniq.size else 0
        for i in range(1, uniq.size):
            size = int(sizes[i])
            if touching[i - 1] and run_bytes + size <= MAX_RUN_BYTES:
                run_bytes += size
                continue
            runs.append((a, i))
            a, run_bytes = i, size
        if uniq.size:
            runs.append((a, uniq.size))
        return runs

    def _hint_runs(self, uniq: np.ndarray, runs: list[tuple[int, int]]) -> None:
        first = np.array([a for a, _ in runs])
        last = np.array([b - 1 for _, b in runs])
        starts = self._offsets[uniq[first]]
        ends = self._offsets[uniq[last]] + self._sizes[uniq[last]]
        self._fd.advise(starts.tolist(), (ends - starts).tolist())

    def _scratch(self, nbytes: int) -> memoryview:
        buf = getattr(self._local, "raw", None)
        if buf is None or buf.size < nbytes:
            buf = np.empty(max(nbytes, 1 << 20), np.uint8)
            self._local.raw = buf
        return memoryview(buf)[:nbytes]

    def _read_runs(self, runs, work) -> None:
        uniq, piece_lo, piece_hi, (src, dst, nbytes), dest = work
        for a, b in runs:
            cached = [self._cached(int(k)) for k in uniq[a:b]]
            raw = None
            if any(x is None for x in cached):
                first_off = int(self._offsets[uniq[a]])
                end = int(self._offsets[uniq[b - 1]] + self._sizes[uniq[b - 1]])
                raw = self._pread(first_off, end - first_off, int(uniq[a]))
            for j in range(a, b):
                k = int(uniq[j])
                chunk = cached[j - a]
                p_lo, p_hi = int(piece_lo[j]), int(piece_hi[j])
                if chunk is None:
                    lo = int(self._offsets[k]) - first_off
                    # Pieces of a chunk are in order: the last ends furthest.
                    need = (
                        None if self._cache_bytes else src[p_hi - 1] + nbytes[p_hi - 1]
                    )
                    chunk = self._decode(k, raw[lo : lo + int(self._sizes[k])], need)
                    self._remember(k, chunk)
                for p in range(p_lo, p_hi):
                    s, d, n = src[p], dst[p], nbytes[p]
                    dest[d : d + n] = chunk[s : s + n]

    def _pread(self, offset: int, nbytes: int, chunk: int) -> memoryview:
        view = self._scratch(nbytes)
        try:
            self._fd.read_into(view, [offset], [nbytes], [0])
        except ShortReadError as e:
            raise errors.CorruptDataError(
                f"{self.path}: {self.name} ends at byte {e.end_of_file} of the "
                f"file but HDF5 places chunk {chunk} up to byte "
                f"{offset + nbytes}: the file is truncated."
            ) from None
        return view

    def _decode(self, k: int, raw, need: int | None = None) -> np.ndarray:
        try:
            return self.pipeline.decode(raw, int(self._masks[k]), need)
        except ChunkDecodeError as e:
            first = k * self.chunk_len
            stop = min(first + self.chunk_len, self.shape[0])
            raise errors.CorruptChunkError(
                f"{self.path}: {self.name} chunk {k} at byte offset "
                f"{int(self._offsets[k])} ({int(self._sizes[k])} bytes stored, "
                f"{self.pipeline.describe()}) is corrupt: {e}. It holds rows "
                f"[{first}, {stop}) of {self.name}.",
                path=self.path,
                dataset=self.name,
                byte_offset=int(self._offsets[k]),
                rows=(first, stop),
            ) from None

    def _cached(self, k: int) -> np.ndarray | None:
        if not self._cache_bytes:
            return None
        return SHARED.get(self._token, k)

    def _remember(self, k: int, chunk: np.ndarray) -> None:
        if self._cache_bytes:
            SHARED.put(self._token, k, chunk, self._cache_bytes)

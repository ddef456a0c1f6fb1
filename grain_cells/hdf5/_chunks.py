"""Rows of a compressed, chunked HDF5 dataset, decoded outside HDF5 in threads.

Design notes: docs/reference/design.md#hdf5-chunks and #hdf5-codecs.
"""

from __future__ import annotations

import math
import threading
import weakref
import zlib

import deflate as _deflate  # a core dependency
import h5py
import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import chunks_touched, nonempty
from grain_cells.formats import (
    ChunkCache,
    ChunkDecodeError,
    checked_ranges,
    dest_bytes,
    pieces,
    run_parts,
    truncated,
    value_dtype,
)
from grain_cells.storage import ShortReadError, as_byte_reader, plan_requests

MAX_RUN_BYTES = 4 << 20
# Decoded chunks of every reader of the process, each trimming it to its own
# `cache_bytes` (design notes, formats-chunk-cache).
SHARED = ChunkCache()

try:
    import lzf as _lzf
except ImportError:
    _lzf = None

FILTER_DEFLATE, FILTER_SHUFFLE, FILTER_FLETCHER32, FILTER_LZF = 1, 2, 3, 32000

# Decode only a chunk's prefix (zlib, unchecked adler32) when a read uses at
# most this share of it; 0: off, so no input yields silent wrong data
# (design notes, hdf5-codecs).
PREFIX_FRACTION = 0.0


_NAMES = {1: "deflate", 2: "shuffle", 3: "fletcher32", 32000: "lzf"}
_DECODES = {1, 2, 3} | ({FILTER_LZF} if _lzf is not None else set())


class Pipeline:
    """Decodes a dataset's stored chunks (`chunk_nbytes` decoded). Thread-safe."""

    def __init__(self, filters: tuple[tuple[int, tuple[int, ...]], ...], nbytes: int):
        self.filters, self.chunk_nbytes = filters, int(nbytes)

    @classmethod
    def for_dataset(cls, dataset: h5py.Dataset) -> Pipeline | None:
        """The pipeline of a chunked dataset whose filters it decodes, else None."""
        dcpl = dataset.id.get_create_plist()  # `(filter id, cd_values)`, write order
        filters = [dcpl.get_filter(i) for i in range(dcpl.get_nfilters())]
        filters = tuple((int(f[0]), tuple(int(v) for v in f[2])) for f in filters)
        if not filters or any(f[0] not in _DECODES for f in filters):
            return None
        nbytes = int(np.prod(dataset.chunks, dtype=np.int64)) * dataset.dtype.itemsize
        return cls(filters, nbytes)

    def describe(self) -> str:
        """The pipeline in write order, e.g. `shuffle+deflate`."""
        return "+".join(_NAMES.get(f, str(f)) for f, _ in self.filters)

    def decode(self, raw, filter_mask: int = 0, need: int | None = None) -> np.ndarray:
        """A chunk as `chunk_nbytes` uint8 (or its first `need`: `PREFIX_FRACTION`)."""
        if need is not None and need <= self.chunk_nbytes * PREFIX_FRACTION:
            active = [
                f for i, (f, _) in enumerate(self.filters) if not filter_mask >> i & 1
            ]
            if active == [FILTER_DEFLATE]:  # zlib stops after `need` bytes
                try:
                    out = zlib.decompressobj().decompress(raw, need)
                except zlib.error as e:
                    raise ChunkDecodeError(f"bad deflate stream ({e})") from None
                if len(out) < need:
                    raise ChunkDecodeError(
                        f"deflate stream ends after {len(out)} bytes, a chunk holds "
                        f"{self.chunk_nbytes}"
                    )
                return np.frombuffer(out, np.uint8)
        buf = raw
        for i in reversed(range(len(self.filters))):  # the last one written first
            if filter_mask & (1 << i):
                continue
            f, values = self.filters[i]
            if f == FILTER_DEFLATE:  # (grown by fletcher32: the size check says)
                try:
                    buf = _deflate.zlib_decompress(buf, self.chunk_nbytes + 64)
                except _deflate.DeflateError as e:
                    raise ChunkDecodeError(f"bad deflate stream ({e})") from None
            elif f == FILTER_SHUFFLE:  # a trailing partial element is as stored
                size = values[0] if values else 1
                arr = np.frombuffer(buf, np.uint8)
                n = arr.size // size
                if size > 1 and n > 1:
                    buf, body = np.empty_like(arr), n * size
                    buf[:body].reshape(n, size)[...] = arr[:body].reshape(size, n).T
                    buf[body:] = arr[body:]
            elif f == FILTER_FLETCHER32:
                buf = verify_fletcher32(buf)
            elif (buf := _lzf.decompress(bytes(buf), self.chunk_nbytes + 64)) is None:
                raise ChunkDecodeError("bad lzf stream")
        arr = np.frombuffer(buf, np.uint8)
        if np.may_share_memory(arr, np.frombuffer(raw, np.uint8)):  # a copy, not `raw`
            arr = arr.copy()
        if arr.size != self.chunk_nbytes:
            raise ChunkDecodeError(
                f"decoded to {arr.size} bytes, a chunk holds {self.chunk_nbytes}"
            )
        return arr


def fletcher32(buf) -> int:
    """HDF5's Fletcher-32 of a buffer (compare with `_same_fletcher`: mod 65535)."""
    arr = np.frombuffer(buf, np.uint8)
    if arr.size % 2:
        arr = np.concatenate([arr, np.zeros(1, np.uint8)])
    words = arr.view(">u2").astype(np.uint64)
    n = words.size
    s1 = int(words.sum()) % 65535
    # sum2 = sum over k of (n - k) * w_k, in pieces that cannot overflow.
    s2 = 0
    step = 1 << 20
    for lo in range(0, n, step):
        w = words[lo : lo + step]
        weights = np.arange(n - lo, n - lo - w.size, -1, dtype=np.uint64)
        s2 = (s2 + int(np.dot(w, weights) % np.uint64(65535))) % 65535
    return (s2 << 16) | s1


def _same_fletcher(a: int, b: int) -> bool:
    return all(
        ((a >> s) & 0xFFFF) % 65535 == ((b >> s) & 0xFFFF) % 65535 for s in (0, 16)
    )


def verify_fletcher32(buf) -> np.ndarray:
    """The chunk without its trailing Fletcher-32, checked (`ChunkDecodeError`)."""
    arr = np.frombuffer(buf, np.uint8)
    if arr.size < 4:
        raise ChunkDecodeError("chunk shorter than its fletcher32 checksum")
    body = arr[:-4]
    stored = int.from_bytes(arr[-4:].tobytes(), "little")
    computed = fletcher32(body)
    # HDF5 before 1.6.3 stored it with the bytes of each half swapped; HDF5
    # still accepts that form.
    swapped = ((stored & 0x00FF00FF) << 8) | ((stored >> 8) & 0x00FF00FF)
    if not (_same_fletcher(stored, computed) or _same_fletcher(swapped, computed)):
        raise ChunkDecodeError(
            f"fletcher32 checksum mismatch (stored {stored:#010x}, computed "
            f"{computed:#010x})"
        )
    return body


def chunk_table(dsid, chunk_len: int, n_rows: int):
    """`(offsets, sizes, filter masks)` of each row chunk (offset -1: unwritten)."""
    n_chunks = -(-n_rows // chunk_len)
    offsets = np.full(n_chunks, -1, np.int64)
    sizes = np.zeros(n_chunks, np.int64)
    masks = np.zeros(n_chunks, np.uint32)

    def visit(info):  # (of chunks split across: the first column's)
        k = info.chunk_offset[0] // chunk_len
        if k < n_chunks and not any(info.chunk_offset[1:]):
            offsets[k], sizes[k] = info.byte_offset, info.size
            masks[k] = info.filter_mask

    if n_chunks:
        dsid.chunk_iter(visit)
    return offsets, sizes, masks


class ChunkedReader:
    """`formats.RangeReader` of a compressed dataset (built by `create`)."""

    direct, decoded = False, True

    def __init__(self, dataset, path, fd, pipeline, table, cache_bytes):
        self.name, self.path, self.pipeline = dataset.name, path, pipeline
        self.dtype, self.shape = dataset.dtype, dataset.shape
        self.row_shape = dataset.shape[1:]
        self.chunk_len = self.chunk_length = int(dataset.chunks[0])
        self._row_bytes = math.prod(dataset.shape[1:]) * self.dtype.itemsize
        self._fd = as_byte_reader(fd, path)
        self.remote = bool(getattr(self._fd, "remote", False))
        self._offsets, self._sizes, self._masks = table
        self._local = threading.local()
        self._cache_bytes = int(cache_bytes)
        self._token = SHARED.token()
        if self._cache_bytes:  # its chunks leave the cache with the reader
            weakref.finalize(self, SHARED.drop, self._token)

    @classmethod
    def create(cls, dataset, path: str, fd, *, cache_bytes: int = 0):
        """A reader of whole-row chunks all written, read as stored; else None."""
        if dataset.chunks is None or dataset.ndim not in (1, 2):
            return None
        dtype = dataset.dtype  # float16 and big-endian: h5py converts them
        if value_dtype(dtype) != dtype or dtype.hasobject:
            return None
        if tuple(dataset.chunks[1:]) != tuple(dataset.shape[1:]):
            return None
        pipeline = Pipeline.for_dataset(dataset)
        if pipeline is None:
            return None
        table = chunk_table(dataset.id, int(dataset.chunks[0]), dataset.shape[0])
        if (table[0] < 0).any():
            return None
        return cls(dataset, path, fd, pipeline, table, cache_bytes)

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Asks the OS to read the stored chunks these ranges touch (async)."""
        starts, stops = nonempty(starts, stops)
        if not starts.size:
            return
        chunks = chunks_touched(starts, stops, self.chunk_len)
        self._fd.advise(self._offsets[chunks].tolist(), self._sizes[chunks].tolist())

    def pin(self) -> None:
        """Asks the OS to read every stored chunk of the dataset (async)."""
        self._fd.pin(self._offsets.tolist(), self._sizes.tolist())

    def read(self, starts, stops, out, pool=None, pending=None) -> None:
        starts, stops = checked_ranges(self, starts, stops)
        if not starts.size:
            return
        chunk, *rows = pieces(starts, stops, self.chunk_len)
        src, dst, nbytes = (a * self._row_bytes for a in rows)
        dest = dest_bytes(out, nbytes)
        # Pieces are sorted by chunk: each chunk's pieces are one slice.
        uniq, piece_lo = np.unique(chunk, return_index=True)
        piece_hi = np.append(piece_lo[1:], chunk.size)
        runs = self._runs(uniq)
        if self._fd.remote and not self._cache_bytes and len(runs) > 1:
            first = uniq[[a for a, _ in runs]]  # every run's GET in flight at once
            last = uniq[[b - 1 for _, b in runs]]
            begin = self._offsets[first]
            ends = self._offsets[last] + self._sizes[last]
            self._fd.advise(begin.tolist(), (ends - begin).tolist())
        parts = (src.tolist(), dst.tolist(), nbytes.tolist())
        work = (uniq, piece_lo, piece_hi, parts, dest)

        def task(a, b):
            self._read_runs(runs[a:b], work)

        for a, b in run_parts(pool, len(runs), task, pending):
            task(a, b)

    def _runs(self, uniq: np.ndarray) -> list[tuple[int, int]]:
        """Positions `[a, b)` into `uniq` of chunks read with one pread each."""
        offsets, sizes = self._offsets[uniq], self._sizes[uniq]
        if uniq.size > 1 and not (offsets[1:] > offsets[:-1]).all():  # out of order
            return [(i, i + 1) for i in range(uniq.size)]
        return [
            (a, b) for _, _, a, b in plan_requests(offsets, sizes, 0, MAX_RUN_BYTES)
        ]

    def _read_runs(self, runs, work) -> None:
        uniq, piece_lo, piece_hi, (src, dst, nbytes), dest = work
        offsets, sizes, keep = self._offsets, self._sizes, self._cache_bytes
        for a, b in runs:
            cached = [
                SHARED.get(self._token, int(k)) if keep else None for k in uniq[a:b]
            ]
            if any(x is None for x in cached):
                first_off = int(offsets[uniq[a]])
                end = int(offsets[uniq[b - 1]] + sizes[uniq[b - 1]])
                raw = self._pread(first_off, end - first_off, int(uniq[a]))
            for j in range(a, b):
                k = int(uniq[j])
                chunk = cached[j - a]
                p_lo, p_hi = int(piece_lo[j]), int(piece_hi[j])
                if chunk is None:
                    lo = int(offsets[k]) - first_off
                    # Pieces of a chunk are in order: the last ends furthest.
                    need = None if keep else src[p_hi - 1] + nbytes[p_hi - 1]
                    chunk = self._decode(k, raw[lo : lo + int(sizes[k])], need)
                    if keep:
                        SHARED.put(self._token, k, chunk, keep)
                for p in range(p_lo, p_hi):
                    s, d, n = src[p], dst[p], nbytes[p]
                    dest[d : d + n] = chunk[s : s + n]

    def _pread(self, offset: int, nbytes: int, chunk: int) -> memoryview:
        buf = getattr(self._local, "raw", None)
        if buf is None or buf.size < nbytes:  # one scratch buffer per thread
            buf = self._local.raw = np.empty(max(nbytes, 1 << 20), np.uint8)
        view = memoryview(buf)[:nbytes]
        try:
            self._fd.read_into(view, [offset], [nbytes], [0])
        except ShortReadError as e:
            raise truncated(self, e, f"chunk {chunk}") from None
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

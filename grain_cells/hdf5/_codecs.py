"""HDF5 filter pipelines decoded outside HDF5, GIL released (`Pipeline`).

Design notes: docs/reference/design.md#hdf5-codecs.
"""

from __future__ import annotations

import dataclasses
import zlib

import h5py
import numpy as np

from grain_cells.formats import ChunkDecodeError

try:
    import deflate as _deflate
except ImportError:  # pragma: no cover - a core dependency
    _deflate = None

try:
    import lzf as _lzf
except ImportError:
    _lzf = None

FILTER_DEFLATE = 1
FILTER_SHUFFLE = 2
FILTER_FLETCHER32 = 3
FILTER_LZF = 32000

# Decode only a chunk's prefix (zlib, unchecked adler32) when a read uses at
# most this share of it; 0: off, so no input yields silent wrong data
# (design notes, hdf5-codecs).
PREFIX_FRACTION = 0.0


@dataclasses.dataclass(frozen=True)
class Filter:
    """One stage of a dataset's filter pipeline, as HDF5 lists it."""

    id: int
    name: str
    cd_values: tuple[int, ...]


def dataset_filters(dataset: h5py.Dataset) -> tuple[Filter, ...]:
    """The filters of a dataset, in the order they were applied on write."""
    dcpl = dataset.id.get_create_plist()
    out = []
    for i in range(dcpl.get_nfilters()):
        code, _flags, values, name = dcpl.get_filter(i)
        if isinstance(name, bytes):
            name = name.decode("ascii", "replace")
        out.append(Filter(int(code), str(name), tuple(int(v) for v in values)))
    return tuple(out)


class Pipeline:
    """Decodes a dataset's stored chunks into their element bytes. Thread-safe."""

    def __init__(self, filters: tuple[Filter, ...], chunk_nbytes: int):
        """`filters` in write order (each one `supports`); `chunk_nbytes` decoded."""
        for f in filters:
            if not self.supports(f):
                raise ValueError(f"filter {f.id} ({f.name}) is not decoded here")
        self.filters = filters
        self.chunk_nbytes = int(chunk_nbytes)

    @staticmethod
    def supports(f: Filter) -> bool:
        """Whether this module decodes filter `f` (in this environment)."""
        if f.id == FILTER_DEFLATE:
            return _deflate is not None
        if f.id == FILTER_LZF:
            return _lzf is not None
        return f.id in (FILTER_SHUFFLE, FILTER_FLETCHER32)

    @classmethod
    def for_dataset(cls, dataset: h5py.Dataset) -> Pipeline | None:
        """The pipeline of a chunked dataset whose filters it decodes, else None."""
        if dataset.chunks is None:
            return None
        filters = dataset_filters(dataset)
        if not filters or not all(cls.supports(f) for f in filters):
            return None
        nbytes = int(np.prod(dataset.chunks, dtype=np.int64)) * dataset.dtype.itemsize
        return cls(filters, nbytes)

    def describe(self) -> str:
        """The pipeline in write order, e.g. `shuffle+deflate`."""
        return "+".join(_NAMES.get(f.id, str(f.id)) for f in self.filters)

    def decode(self, raw, filter_mask: int = 0, need: int | None = None) -> np.ndarray:
        """One stored chunk as `chunk_nbytes` uint8 (bit `i` of `filter_mask`: skipped).

        Only its first `need` bytes (or more) when its active filters are
        deflate alone and `need` is at most `PREFIX_FRACTION` of the chunk.

        Raises:
            ChunkDecodeError: A corrupt stream, a failed checksum, a wrong size.
        """
        if need is not None and need <= self.chunk_nbytes * PREFIX_FRACTION:
            active = [
                f.id for i, f in enumerate(self.filters) if not filter_mask & (1 << i)
            ]
            if active == [FILTER_DEFLATE]:
                return self._inflate_prefix(raw, need)
        buf = raw
        fresh = False  # whether buf is new memory rather than a view of raw
        # The last filter applied on write is undone first.
        for i in range(len(self.filters) - 1, -1, -1):
            if filter_mask & (1 << i):
                continue
            f = self.filters[i]
            if f.id == FILTER_DEFLATE:
                # Stages above deflate may have grown the chunk (fletcher32);
                # the size check below catches a wrong final size.
                try:
                    buf = _deflate.zlib_decompress(buf, self.chunk_nbytes + 64)
                except _deflate.DeflateError as e:
                    raise ChunkDecodeError(f"bad deflate stream ({e})") from None
                fresh = True
            elif f.id == FILTER_SHUFFLE:
                itemsize = f.cd_values[0] if f.cd_values else 1
                shuffled = buf
                buf = unshuffle(buf, itemsize)
                fresh = fresh or buf is not shuffled
            elif f.id == FILTER_FLETCHER32:
                buf = verify_fletcher32(buf)
            elif f.id == FILTER_LZF:
                out = _lzf.decompress(bytes(buf), self.chunk_nbytes + 64)
                if out is None:
                    raise ChunkDecodeError("bad lzf stream")
                buf = out
                fresh = True
        arr = np.frombuffer(buf, np.uint8)
        if not fresh:  # only checks or skipped filters: do not alias `raw`
            arr = arr.copy()
        if arr.size != self.chunk_nbytes:
            raise ChunkDecodeError(
                f"decoded to {arr.size} bytes, a chunk holds {self.chunk_nbytes}"
            )
        return arr

    def _inflate_prefix(self, raw, need: int) -> np.ndarray:
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


_NAMES = {
    FILTER_DEFLATE: "deflate",
    FILTER_SHUFFLE: "shuffle",
    FILTER_FLETCHER32: "fletcher32",
    FILTER_LZF: "lzf",
}


def unshuffle(buf, itemsize: int) -> np.ndarray:
    """Undoes HDF5's byte shuffle (a trailing partial element is as stored)."""
    arr = np.frombuffer(buf, np.uint8)
    n = arr.size // itemsize
    if itemsize <= 1 or n <= 1:
        return buf
    out = np.empty_like(arr)
    body = n * itemsize
    out[:body].reshape(n, itemsize)[...] = arr[:body].reshape(itemsize, n).T
    out[body:] = arr[body:]
    return out


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

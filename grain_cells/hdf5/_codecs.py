"""HDF5 filter pipelines decoded outside HDF5, one chunk at a time.

HDF5 decodes a compressed dataset's chunks one by one under h5py's global
lock. `Pipeline` decodes the raw bytes of one chunk (as stored on disk, from
`DatasetID.chunk_iter` and a positional read) with libraries that release the
GIL, so a thread pool decodes a fetch's chunks on all cores.

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

# Decode only a chunk's prefix (stdlib zlib, stopping early) when a read uses
# at most this share of it from the start; else the whole chunk (libdeflate,
# 3-5x faster per byte). Chunks whose last cell spills a few values into the
# next chunk make such prefixes common. A prefix cannot be checked against
# the stream's adler32 (stored at its end): a corrupt stream is still caught
# when its structure breaks, but a flipped literal inside the prefix is not.
# So it is off (0: every chunk inflated whole and its checksum checked): no
# input may yield silent wrong data. Setting it (e.g. 0.25) in a process
# trades that check for speed there only; spawned workers keep the default.
PREFIX_FRACTION = 0.0


@dataclasses.dataclass(frozen=True)
class Filter:
    """One stage of a dataset's filter pipeline, as HDF5 lists it.

    Attributes:
        id: HDF5 filter id.
        name: The name stored in the file.
        cd_values: The filter's client data.
    """

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
    """Decodes a dataset's stored chunks into their raw element bytes.

    Immutable and thread-safe: `decode` may run in many threads at once.

    Example:
        >>> pipe = Pipeline.for_dataset(h5file["X/data"])
        >>> chunk = pipe.decode(raw_bytes, filter_mask)   # uint8 array
    """

    def __init__(self, filters: tuple[Filter, ...], chunk_nbytes: int):
        """Binds a pipeline to the decoded size of a dataset's chunks.

        Args:
            filters: The dataset's filters in write order; each must be one
                `supports` accepts.
            chunk_nbytes: Bytes of one decoded chunk (edge chunks are stored
                full size).
        """
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
        """The pipeline of a chunked, filtered dataset, or None.

        None when the dataset is not chunked, has no filter, or has a filter
        this module does not decode (it is then read through h5py).
        """
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
        """Decodes one stored chunk, or only its first `need` bytes.

        A prefix is decoded only when it is cheap and safe: the chunk's active
        filters are deflate alone (no shuffle, whose byte planes span the
        chunk; no fletcher32, which needs every byte) and `need` is at most
        `PREFIX_FRACTION` of the chunk. zlib then stops after `need` bytes;
        the stream's adler32 (at its end) is not checked for such a prefix.

        Args:
            raw: The chunk's bytes as stored (any buffer).
            filter_mask: The chunk's filter mask: bit `i` set means filter
                `i` was skipped when the chunk was written.
            need: Bytes of the decoded chunk the caller uses, from its
                start; None for all.

        Returns:
            A uint8 array of `chunk_nbytes` bytes, or of at least `need`
            bytes for a prefix.

        Raises:
            ChunkDecodeError: A stream is corrupt, a checksum fails, or the
                decoded size is not a chunk's.
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
    """Undoes HDF5's byte shuffle: byte planes back into elements.

    Trailing bytes that do not fill an element were stored as is. Returns
    `buf` itself when there is nothing to undo.
    """
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
    """HDF5's Fletcher-32 (`H5_checksum_fletcher32`) of a buffer.

    Sums 16-bit big-endian words modulo 65535; an odd last byte is the high
    byte of a last word. Values equal modulo 65535 are the same checksum
    (HDF5's folded sums may hold 65535 for 0), compare with `_same_fletcher`.
    """
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
    """Checks a chunk's trailing Fletcher-32 and returns the chunk without it.

    Raises:
        ChunkDecodeError: The checksum does not match.
    """
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

"""Batched reads of many element ranges from one HDF5 dataset.

A `RangeReader` reads a set of sorted, disjoint ranges of a dataset's first
axis into one contiguous destination array, in as few calls as the storage
allows: positional reads for uncompressed data, `ChunkedReader` for the
filters `grain_cells.hdf5._codecs` decodes, h5py for anything else.

Design notes: docs/reference/design.md#hdf5-reads.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Sequence

import h5py
import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import merge_touching, nonempty
from grain_cells.formats import value_dtype, wait_all
from grain_cells.hdf5._chunks import ChunkedReader
from grain_cells.hdf5._layout import check_filters, stored_in
from grain_cells.storage import ByteReader, ShortReadError, as_byte_reader

# Ranges per H5Dread in the h5py path: HDF5's selection union grows
# superlinearly in the number of blocks it holds.
_MAX_HYPERSLABS_PER_READ = 1024
# Below this many bytes a thread pool costs more than it saves.
_MIN_BYTES_PER_THREAD = 1 << 20


class RangeReader:
    """Reads sorted, disjoint ranges of a dataset's first axis.

    Thread-safe: positional reads share one file descriptor; the h5py path is
    serialised by h5py's own lock.

    Example:
        >>> reader = RangeReader(h5file["X/data"], "/data/a.h5ad", fd)
        >>> out = np.empty(30, reader.dtype)
        >>> reader.read(np.array([0, 100]), np.array([10, 120]), out)
    """

    def __init__(
        self,
        dataset: h5py.Dataset,
        path: str,
        fd: int | ByteReader | None,
        *,
        cache_bytes: int = 0,
    ):
        """Inspects the dataset's storage once.

        Args:
            dataset: An open 1-D or 2-D dataset.
            path: The file's path, for error messages.
            fd: An `os.open` descriptor of the file `path`, or a `ByteReader`
                of it (a local file or an object), or None to always read
                through h5py. It is used only when the dataset's bytes
                are in that file (not behind an external link).
            cache_bytes: For compressed data decoded here, decoded bytes kept
                in an LRU cache (for small datasets every read touches).

        Raises:
            errors.UnsupportedLayoutError: The dataset uses an HDF5 filter
                that this HDF5 cannot apply.
        """
        self.name = dataset.name
        self.path = path
        # Values are read in native byte order and float16 as float32; a
        # dataset stored otherwise goes through h5py, which converts.
        self.dtype = value_dtype(dataset.dtype)
        self.shape = dataset.shape
        self.row_shape = dataset.shape[1:]
        self._row_items = int(np.prod(self.row_shape, dtype=np.int64))
        self._row_bytes = self._row_items * self.dtype.itemsize
        self._dataset = dataset
        self._fd = fd = as_byte_reader(fd, path)
        # Byte layout for the positional path: chunk_len rows per chunk at
        # chunk_offsets[i] (one "chunk" spanning everything when contiguous).
        self._chunk_len: int | None = None
        self._chunk_offsets: np.ndarray | None = None
        self._chunked: ChunkedReader | None = None
        check_filters(path, dataset)
        if fd is not None:
            self._map_bytes()
            if self._chunk_offsets is None:
                self._chunked = ChunkedReader.create(
                    dataset, path, fd, cache_bytes=cache_bytes
                )

    @property
    def direct(self) -> bool:
        """Whether reads bypass h5py with positional reads."""
        return self._chunk_offsets is not None

    @property
    def remote(self) -> bool:
        """Whether bytes come from an object store (each read a round trip)."""
        return bool(getattr(self._fd, "remote", False))

    @property
    def chunk_length(self) -> int | None:
        """Rows (first-axis elements) per HDF5 chunk; None when contiguous."""
        chunks = self._dataset.chunks
        return None if chunks is None else int(chunks[0])

    @property
    def decoded(self) -> bool:
        """Whether compressed chunks are decoded here, in threads (not h5py)."""
        return self._chunked is not None

    def _map_bytes(self) -> None:
        ds = self._dataset
        if self.dtype != ds.dtype or self.dtype.hasobject:
            return
        if not stored_in(ds, self.path):  # behind an external link
            return
        if ds.id.get_create_plist().get_nfilters() != 0:
            return
        n = self.shape[0]
        if ds.chunks is None:
            offset = ds.id.get_offset()
            if offset is None:  # never written: HDF5 would return fill values
                return
            self._chunk_len = max(n, 1)
            self._chunk_offsets = np.array([offset], np.int64)
            return
        if tuple(ds.chunks[1:]) != tuple(self.row_shape):
            return  # chunks split rows: a row is not contiguous in the file
        chunk_len = ds.chunks[0]
        n_chunks = -(-n // chunk_len)
        offsets = np.full(n_chunks, -1, np.int64)
        chunk_bytes = chunk_len * self._row_bytes
        sizes_ok = True

        def visit(info):
            nonlocal sizes_ok
            offsets[info.chunk_offset[0] // chunk_len] = info.byte_offset
            if info.size != chunk_bytes or info.filter_mask != 0:
                sizes_ok = False

        ds.id.chunk_iter(visit)
        if not sizes_ok or (offsets < 0).any():
            return
        self._chunk_len = chunk_len
        self._chunk_offsets = offsets

    def pin(self) -> None:
        """Asks the OS to read the whole dataset into the page cache, async.

        Used for `indptr`: every batch starts with one small, latency-bound
        read of it per range, and on a cold cache those dominate. The pages
        are shared by every process reading the file.
        """
        if self._chunked is not None:
            self._chunked.pin()
            return
        if not self.direct:
            return
        length = min(self._chunk_len, max(self.shape[0], 1)) * self._row_bytes
        offsets = self._chunk_offsets.tolist()
        self._fd.pin(offsets, [length] * len(offsets))

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Hints the OS to start reading these ranges into the page cache.

        Returns at once (the reads are asynchronous); a no-op for data read
        through h5py.
        """
        starts, stops = nonempty(starts, stops)
        if starts.size == 0:
            return
        if self._chunked is not None:
            self._chunked.advise(starts, stops)
            return
        if not self.direct:
            return
        offsets, nbytes = self._pieces(starts, stops)
        self._fd.advise(offsets.tolist(), nbytes.tolist())

    def read(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        out: np.ndarray,
        pool: concurrent.futures.Executor | None = None,
        pending: list[concurrent.futures.Future] | None = None,
    ) -> None:
        """`formats.RangeReader.read`: positional, chunk-decoding or h5py reads.

        Raises:
            errors.AnnDataFormatError: The file is shorter than HDF5 says
                (truncated) or the read fails.
        """
        starts, stops = nonempty(starts, stops)
        if starts.size == 0:
            return
        if stops[-1] > self.shape[0] or starts[0] < 0:
            raise errors.CorruptDataError(
                f"{self.path}: {self.name} has {self.shape[0]} elements but rows "
                f"[{starts.min()}, {stops.max()}) were asked for."
            )
        starts, stops = merge_touching(starts, stops)
        if self.direct:
            self._read_direct(starts, stops, out, pool)
        elif self._chunked is not None:
            self._chunked.read(starts, stops, out, pool, pending)
        else:
            self._read_h5py(starts, stops, out)

    def _pieces(self, starts: np.ndarray, stops: np.ndarray):
        """Splits ranges at chunk boundaries: (file offsets, byte counts)."""
        c = self._chunk_len
        first = starts // c
        last = (stops - 1) // c
        n_pieces = last - first + 1
        total = int(n_pieces.sum())
        if total == starts.size:
            chunk = first
            p_start, p_stop = starts, stops
        else:
            owner = np.repeat(np.arange(starts.size), n_pieces)
            within = np.arange(total) - np.repeat(
                np.cumsum(n_pieces) - n_pieces, n_pieces
            )
            chunk = first[owner] + within
            p_start = np.maximum(starts[owner], chunk * c)
            p_stop = np.minimum(stops[owner], (chunk + 1) * c)
        offsets = self._chunk_offsets[chunk] + (p_start - chunk * c) * self._row_bytes
        nbytes = (p_stop - p_start) * self._row_bytes
        # Pieces adjacent both in the file and in the destination merge.
        if offsets.size > 1:
            joins = offsets[1:] == offsets[:-1] + nbytes[:-1]
            if joins.any():
                heads = np.concatenate([[0], np.flatnonzero(~joins) + 1])
                nbytes = np.add.reduceat(nbytes, heads)
                offsets = offsets[heads]
        return offsets, nbytes

    def _read_direct(self, starts, stops, out, pool) -> None:
        offsets, nbytes = self._pieces(starts, stops)
        dest = out.reshape(-1).view(np.uint8)
        dest_starts = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
        total = int(nbytes.sum()) if nbytes.size else 0
        if total > dest.size:
            raise ValueError(
                f"destination holds {dest.size} bytes, the ranges need {total}"
            )
        fd = self._fd
        # A remote reader runs its own GETs concurrently and copies what
        # read-ahead holds with the GIL held: splitting its read over the
        # pool's threads only adds GIL hand-offs (a third of a 0-worker
        # reader's time went waiting on them).
        if (
            pool is None
            or total < 2 * _MIN_BYTES_PER_THREAD
            or nbytes.size < 2
            or fd.remote
        ):
            _pread_all(
                fd, dest, offsets.tolist(), nbytes.tolist(), dest_starts.tolist(), self
            )
            return
        n_jobs = min(
            getattr(pool, "threads", 4),  # file_set.ReadPool
            nbytes.size,
            total // _MIN_BYTES_PER_THREAD,
        )
        cuts = np.searchsorted(
            np.cumsum(nbytes), np.linspace(0, total, n_jobs + 1)[1:-1]
        )
        bounds = [0, *cuts.tolist(), nbytes.size]
        futures = [
            pool.submit(
                _pread_all,
                fd,
                dest,
                offsets[a:b].tolist(),
                nbytes[a:b].tolist(),
                dest_starts[a:b].tolist(),
                self,
            )
            for a, b in itertools.pairwise(bounds)
            if b > a
        ]
        wait_all(futures)  # none still writes into `out` once this returns

    def _read_h5py(self, starts, stops, out) -> None:
        ds = self._dataset
        row_items = self._row_items
        flat = out.reshape(-1)
        pos = 0
        try:
            for lo in range(0, starts.size, _MAX_HYPERSLABS_PER_READ):
                s = starts[lo : lo + _MAX_HYPERSLABS_PER_READ]
                e = stops[lo : lo + _MAX_HYPERSLABS_PER_READ]
                n_rows = int((e - s).sum())
                fspace = ds.id.get_space()
                fspace.select_none()
                tail = tuple(self.row_shape)
                zeros = (0,) * len(tail)
                for a, b in zip(s.tolist(), e.tolist(), strict=True):
                    fspace.select_hyperslab(
                        (a, *zeros), (b - a, *tail), op=h5py.h5s.SELECT_OR
                    )
                mshape = (n_rows, *tail)
                mspace = h5py.h5s.create_simple(mshape)
                chunk = flat[pos : pos + n_rows * row_items].reshape(mshape)
                ds.id.read(mspace, fspace, chunk)
                pos += n_rows * row_items
        except (OSError, RuntimeError) as e:
            raise errors.AnnDataFormatError(
                f"{self.path}: reading {self.name} failed ({e}). The file may be "
                "truncated or corrupt."
            ) from e


def _pread_all(
    fd: ByteReader,
    dest: np.ndarray,
    offsets: Sequence[int],
    nbytes: Sequence[int],
    dest_starts: Sequence[int],
    reader: RangeReader,
) -> None:
    try:
        fd.read_into(dest, offsets, nbytes, dest_starts)
    except ShortReadError as e:
        raise errors.CorruptDataError(
            f"{reader.path}: {reader.name} ends at byte {e.end_of_file} of the "
            f"file but HDF5 places data up to byte {e.needed}: the file is "
            "truncated."
        ) from None

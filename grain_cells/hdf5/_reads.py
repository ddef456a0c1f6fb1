"""Batched reads of many element ranges from one HDF5 dataset.

A `RangeReader` reads a set of sorted, disjoint ranges of a dataset's first
axis into one contiguous destination array, in as few calls as the storage
allows: positional reads for uncompressed data, `ChunkedReader` for the
filters `grain_cells.hdf5._codecs` decodes, h5py for anything else.

Design notes: docs/reference/design.md#hdf5-reads.
"""

from __future__ import annotations

import concurrent.futures
import math
import os

import h5py
import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import nonempty
from grain_cells.formats import (
    ByteLayout,
    PositionalReader,
    checked_ranges,
    value_dtype,
)
from grain_cells.hdf5._chunks import ChunkedReader
from grain_cells.hdf5._layout import check_filters, create_plist, stored_in
from grain_cells.storage import ByteReader, as_byte_reader

# Ranges per H5Dread in the h5py path: HDF5's selection union grows
# superlinearly in the number of blocks it holds.
_MAX_HYPERSLABS_PER_READ = 1024


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
        # The positional path (`formats.PositionalReader`), when the bytes'
        # offsets are known: uncompressed, contiguous or whole-row chunks.
        self._positional: PositionalReader | None = None
        self._chunked: ChunkedReader | None = None
        check_filters(path, dataset)
        if fd is not None:
            layout = self._map_bytes()
            if layout is not None:
                self._positional = PositionalReader(layout, path, fd)
            else:
                self._chunked = ChunkedReader.create(
                    dataset, path, fd, cache_bytes=cache_bytes
                )

    @property
    def direct(self) -> bool:
        """Whether reads bypass h5py with positional reads."""
        return self._positional is not None

    @property
    def byte_layout(self) -> ByteLayout | None:
        """Where the bytes lie when reads are positional (pure data), else None.

        A reader built from it (`formats.PositionalReader`) over a new
        `ByteReader` of the same, unchanged file reads what this one reads,
        with no h5py (`grain_cells.io._file_set` reopens files so).
        """
        return None if self._positional is None else self._positional.layout

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

    def _map_bytes(self) -> ByteLayout | None:
        """The dataset's byte layout if positional reads can read it."""
        return byte_layout(self._dataset, self.path)

    def pin(self) -> None:
        """Asks the OS to read the whole dataset into the page cache, async.

        Used for `indptr`: every batch starts with one small, latency-bound
        read of it per range, and on a cold cache those dominate. The pages
        are shared by every process reading the file.
        """
        if self._chunked is not None:
            self._chunked.pin()
            return
        if self._positional is not None:
            self._positional.pin()

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
        if self._positional is not None:
            self._positional.advise(starts, stops)

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
        starts, stops = checked_ranges(self, starts, stops)
        if starts.size == 0:
            return
        if self._positional is not None:
            self._positional.read_merged(starts, stops, out, pool)
        elif self._chunked is not None:
            self._chunked.read(starts, stops, out, pool, pending)
        else:
            self._read_h5py(starts, stops, out)

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


def byte_layout(ds: h5py.Dataset, path: str) -> ByteLayout | None:
    """Where a dataset's bytes lie in `path`, if positional reads can read them.

    None unless uncompressed, contiguous or in whole-row chunks, all
    written, and stored as the values are read. Asks HDF5's low-level calls
    once each (a build takes this for every array of every file: issue 33).
    """
    dtype = ds.dtype
    if value_dtype(dtype) != dtype or dtype.hasobject:
        return None
    dsid = ds.id
    if not _stored_in(dsid, path):  # behind an external link
        return None
    plist = create_plist(dsid)
    if plist.get_nfilters() != 0:
        return None
    shape = ds.shape  # h5py keeps a read-only dataset's shape
    n = shape[0]
    if plist.get_layout() != h5py.h5d.CHUNKED:
        offset = dsid.get_offset()
        if offset is None:  # never written (or compact, virtual): h5py reads it
            return None
        offsets = np.array([offset], np.int64)
        return ByteLayout(ds.name, dtype, shape, max(n, 1), offsets, None)
    chunks = plist.get_chunk()
    if tuple(chunks[1:]) != tuple(shape[1:]):
        return None  # chunks split rows: a row is not contiguous in the file
    chunk_len = int(chunks[0])
    n_chunks = -(-n // chunk_len)
    offsets = np.full(n_chunks, -1, np.int64)
    chunk_bytes = chunk_len * math.prod(shape[1:]) * dtype.itemsize
    sizes_ok = True

    def visit(info):
        nonlocal sizes_ok
        offsets[info.chunk_offset[0] // chunk_len] = info.byte_offset
        if info.size != chunk_bytes or info.filter_mask != 0:
            sizes_ok = False

    dsid.chunk_iter(visit)
    if not sizes_ok or (offsets < 0).any():
        return None
    return ByteLayout(ds.name, dtype, shape, chunk_len, offsets, chunk_len)


def _stored_in(dsid, path: str) -> bool:
    """`_layout.stored_in` from the dataset's id.

    A path HDF5 names as given is the same file, without two `stat`s.
    """
    if "://" not in path and h5py.h5f.get_name(dsid) == os.fsencode(path):
        return True
    return stored_in(h5py.Dataset(dsid), path)

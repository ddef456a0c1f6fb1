"""Row ranges of an HDF5 dataset: positional, `_chunks` decoding, else h5py.

Records per open node (plist, chunk table, path). Design notes:
docs/reference/design.md#hdf5-reads and #hdf5-handles.
"""

from __future__ import annotations

import math
import os
import weakref

import h5py
import numpy as np

from grain_cells import errors
from grain_cells.formats import (
    ByteLayout,
    PositionalReader,
    checked_ranges,
    value_dtype,
)
from grain_cells.hdf5._chunks import ChunkedReader, chunk_table
from grain_cells.storage import as_byte_reader

# Ranges per H5Dread in the h5py path: HDF5's selection union grows
# superlinearly in the number of blocks it holds.
_MAX_HYPERSLABS_PER_READ = 1024
_TABLES: dict[int, tuple] = {}


def range_reader(dataset: h5py.Dataset, path: str, fd, *, cache_bytes: int = 0):
    """The `RangeReader` of a dataset (`fd`: descriptor, `ByteReader` or None)."""
    fd = as_byte_reader(fd, path)
    if fd is None:
        return H5pyReader(dataset, path, fd)
    if (layout := byte_layout(dataset, path)) is not None:
        return PositionalReader(layout, path, fd)
    chunked = ChunkedReader.create(dataset, path, fd, cache_bytes=cache_bytes)
    return chunked or H5pyReader(dataset, path, fd)


class H5pyReader:
    """`formats.RangeReader` through h5py, which converts what it stores otherwise."""

    direct = decoded = False

    def __init__(self, dataset: h5py.Dataset, path: str, fd):
        self.name, self.path, self._dataset = dataset.name, path, dataset
        self.dtype = value_dtype(dataset.dtype)
        self.shape, self.row_shape = dataset.shape, dataset.shape[1:]
        self.remote = bool(getattr(fd, "remote", False))
        chunks = dataset.chunks
        self.chunk_length = None if chunks is None else int(chunks[0])

    def advise(self, starts=None, stops=None) -> None:
        """h5py reads on demand: nothing to hint."""

    pin = advise

    def read(self, starts, stops, out, pool=None, pending=None) -> None:
        starts, stops = checked_ranges(self, starts, stops)
        ds, tail, pos = self._dataset, tuple(self.row_shape), 0
        rows = out.reshape(-1)[: int((stops - starts).sum()) * math.prod(tail)]
        rows, zeros = rows.reshape(-1, *tail), (0,) * len(tail)
        try:
            for lo in range(0, starts.size, _MAX_HYPERSLABS_PER_READ):
                s = starts[lo : lo + _MAX_HYPERSLABS_PER_READ].tolist()
                e = stops[lo : lo + _MAX_HYPERSLABS_PER_READ].tolist()
                fspace = ds.id.get_space()
                fspace.select_none()
                for a, b in zip(s, e, strict=True):
                    fspace.select_hyperslab(
                        (a, *zeros), (b - a, *tail), op=h5py.h5s.SELECT_OR
                    )
                n = sum(e) - sum(s)
                mspace = h5py.h5s.create_simple((n, *tail))
                ds.id.read(mspace, fspace, rows[pos : pos + n])
                pos += n
        except (OSError, RuntimeError) as e:
            raise errors.AnnDataFormatError(
                f"{self.path}: reading {self.name} failed ({e}). The file may be "
                "truncated or corrupt."
            ) from e


def byte_layout(ds: h5py.Dataset, path: str) -> ByteLayout | None:
    """Where an uncompressed dataset's rows lie in `path` (row chunks), or None."""
    dtype = ds.dtype
    if value_dtype(dtype) != dtype or dtype.hasobject:
        return None
    dsid = ds.id
    if not stored_in(ds, path):  # behind an external link
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
    offsets, sizes, masks = row_chunks(dsid, chunk_len, n)
    chunk_bytes = chunk_len * math.prod(shape[1:]) * dtype.itemsize
    if (offsets < 0).any() or (sizes != chunk_bytes).any() or masks.any():
        return None
    return ByteLayout(ds.name, dtype, shape, chunk_len, offsets, chunk_len)


def row_chunks(dsid, chunk_len: int, n_rows: int):
    """`chunk_table` of an open dataset, walked once (its layout digest's too)."""
    key = (chunk_len, n_rows)
    return held(_TABLES, dsid, key, lambda: chunk_table(dsid, chunk_len, n_rows))


def sorted_points(index, n: int) -> np.ndarray | None:
    """`index` as int64 if it is 1-D sorted distinct integers in `[0, n)`, else None."""
    if not isinstance(index, np.ndarray) or index.ndim != 1 or not index.size:
        return None
    if index.dtype.kind not in "iu":
        return None
    points = index.astype(np.int64, copy=False)
    if points[0] < 0 or points[-1] >= n or (np.diff(points) <= 0).any():
        return None
    return points


def held(table: dict, oid, key, make, limit: int = 64):
    """`make()`, kept in `table` for the open node `oid` and `key`."""
    entry = table.get(id(oid))
    if entry is not None and entry[0]() is oid and entry[1] == key:
        return entry[2]
    value = make()
    if len(table) >= limit:
        table.clear()
    table[id(oid)] = (weakref.ref(oid), key, value)
    return value


_PLISTS: dict[int, tuple] = {}
_HANDLES: dict[int, tuple] = {}  # a build's one open file has about thirty nodes


def create_plist(dsid):
    """`dsid.get_create_plist()`, once per dataset (its storage cannot change)."""
    return held(_PLISTS, dsid, None, dsid.get_create_plist)


def opened(f: h5py.File, path: str) -> None:
    """Records a file `open_h5` just opened read-only from the local `path`."""
    held(_HANDLES, f.id, None, lambda: path, 256)


def inherit(parent, child) -> None:
    """`child` (opened from the group `parent`) shares its parent's record."""
    if (record := handle(parent)) is not None:
        held(_HANDLES, child.id, None, lambda: record, 256)


def handle(node) -> str | None:
    """The path of a node of a file `open_h5` opened (read-only), or None."""
    entry = _HANDLES.get(id(node.id))
    return entry[2] if entry is not None and entry[0]() is node.id else None


def stored_in(dataset: h5py.Dataset, path: str) -> bool:
    """Whether the dataset's bytes live in the file `path` (not behind a link)."""
    if "://" not in path and h5py.h5f.get_name(dataset.id) == os.fsencode(path):
        return True  # HDF5 names the file as given: no `stat`
    if "://" in path:  # an object: h5py names its file-like by the URL
        return dataset.file.filename == path
    try:
        return os.path.samefile(dataset.file.filename, path)
    except OSError:
        return False

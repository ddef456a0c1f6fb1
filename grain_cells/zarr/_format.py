"""AnnData zarr stores as a `grain_cells.formats.Format`.

Registered on import of `grain_cells.zarr`.

Design notes: docs/reference/design.md#zarr-format.
"""

from __future__ import annotations

import os
import sys
import zipfile

import numpy as np

from grain_cells import errors, formats
from grain_cells.storage import FileStat
from grain_cells.storage.remote import is_url
from grain_cells.zarr._read_errors import READ_ERRORS, read_error
from grain_cells.zarr._store_file import StoreFile


def _zarr():
    """The `zarr` module if some code imported it, else None."""
    return sys.modules.get("zarr")


def is_store_path(path: str) -> bool:
    """Whether `path` (a local path or URL) names a zarr store, unopened.

    A local directory, or a path or URL ending in `.zarr` or `.zarr.zip`.
    """
    p = os.fspath(path).rstrip("/")
    if p.endswith((".zarr", ".zarr.zip")):
        return True
    return not is_url(p) and os.path.isdir(p)


def stat_path(path: str, storage_options: dict | None = None) -> FileStat:
    """The `FileStat` of a zarr store now: its `store_digest`.

    Raises:
        FileNotFoundError: No such zarr store.
    """
    from grain_cells.zarr import _store

    if not is_url(path) and not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such zarr store")
    return FileStat(0, 0, 0, 0, 0, store=_store.store_digest(path, storage_options))


def open_store(path: str, storage_options: dict | None, stat: FileStat | None):
    """Opens a zarr store read-only as a `StoreFile` (no AnnData check)."""
    from grain_cells.zarr import _store

    local = not is_url(path)
    if local and not os.path.exists(path):
        raise formats.missing_path(path)
    if local and os.path.isdir(path) and not _has_zarr_metadata(path):
        if os.path.isfile(os.path.join(path, ".zarray")):
            raise _root_array(path)
        found = sorted(os.listdir(path))[:8]
        raise errors.AnnDataFormatError(
            f"{path}: is a directory but not a zarr store (no zarr.json or "
            f".zgroup at its root; it holds {found}); expected an .h5ad file "
            "or a zarr store written by anndata's write_zarr"
        )
    if local and os.path.isfile(path) and not zipfile.is_zipfile(path):
        raise errors.AnnDataFormatError(
            f"{path}: a file that is neither a zip archive (.zarr.zip) nor a "
            "zarr store directory; expected a store written by anndata's "
            "write_zarr (or an .h5ad file, named .h5ad)"
        )
    del stat  # a store's version is its digest now
    stat = stat_path(path, storage_options)
    import zarr

    try:
        group = _store.open_group(path, storage_options)
    except zarr.errors.ContainsArrayError as e:
        raise _root_array(path) from e
    return StoreFile(group, path, stat)


def _has_zarr_metadata(path: str) -> bool:
    """Whether a directory holds zarr metadata at its root (v3, v2 group)."""
    return any(
        os.path.isfile(os.path.join(path, name)) for name in ("zarr.json", ".zgroup")
    )


def _root_array(path: str) -> errors.AnnDataFormatError:
    return errors.AnnDataFormatError(
        f"{path}: a zarr array at its root, not a group; expected an AnnData "
        "store (a group holding obs, var and X) written by anndata's write_zarr"
    )


def _zarr_storage(array) -> list:
    """What locates one zarr array's bytes: its grid and stored size.

    Fields that read the same under every zarr-python version (not its JSON).
    """
    return [
        array.path,
        array.metadata.zarr_format,
        tuple(array.shape),
        np.dtype(array.dtype).str,
        tuple(array.chunks),
        None if array.shards is None else tuple(array.shards),
        int(array.nbytes_stored()),
    ]


class ZarrFormat(formats.Format):
    """zarr v2 and v3 stores: directories, `.zarr.zip`, bucket prefixes."""

    name = "zarr"
    description = "a zarr store"

    def can_open(self, path: str) -> bool:
        """See `is_store_path`."""
        return is_store_path(path)

    def open(self, path, storage_options=None, stat=None) -> StoreFile:
        """See `open_store`; a store's `stat` is always taken anew."""
        return open_store(path, storage_options, stat)

    def stat_path(self, path, storage_options=None) -> FileStat:
        """See `stat_path` (the store digest)."""
        return stat_path(path, storage_options)

    def stat_of(self, f, path) -> FileStat:
        """The stat taken when the store was opened."""
        return f.stat

    def owns(self, node) -> bool:
        """A `StoreFile`, a zarr group or array."""
        if isinstance(node, StoreFile):
            return True
        zarr = _zarr()
        return zarr is not None and isinstance(node, (zarr.Group, zarr.Array))

    def is_group(self, node) -> bool:
        """A `StoreFile` or a zarr group."""
        if isinstance(node, StoreFile):
            return True
        zarr = _zarr()
        return zarr is not None and isinstance(node, zarr.Group)

    def is_array(self, node) -> bool:
        """A zarr array."""
        zarr = _zarr()
        return zarr is not None and isinstance(node, zarr.Array)

    def is_string_array(self, node) -> bool:
        """NumPy's `StringDType`, object or unicode arrays (zarr v2 and v3)."""
        return np.dtype(node.dtype).kind in "OUT"

    def read(self, array, index, path: str, rows: tuple[int, int]) -> np.ndarray:
        """Points read with `vindex`; damaged bytes raise `errors.CorruptChunkError`."""
        try:
            if isinstance(index, np.ndarray):
                return np.asarray(array.vindex[index])
            return np.asarray(array[index])
        except READ_ERRORS as e:
            stop = min(rows[1], int(array.shape[0]))
            raise read_error(array, path, rows[0], stop, e) from e

    def checked(self, node, path: str):
        """`node`, its zarr arrays (one level down) checked against their own metadata.

        Consolidated metadata is a copy that a later change leaves stale
        (`check_array`: one GET per array in a bucket).

        Raises:
            errors.AnnDataFormatError: A consolidated entry disagrees with its
                array, naming the store, the array and the fields.
        """
        zarr = _zarr()
        if zarr is None:
            return node
        from grain_cells.zarr._store import check_array

        if isinstance(node, zarr.Array):
            check_array(node, path)
        elif isinstance(node, zarr.Group):
            for _, child in node.arrays():
                check_array(child, path)
        return node

    def chunk_bytes(self, array) -> int | None:
        """Decoded bytes of one (inner, if sharded) compressed chunk."""
        if not array.compressors:
            return None
        return (
            int(np.prod(array.chunks, dtype=np.int64)) * np.dtype(array.dtype).itemsize
        )

    def check_unchanged(self, f, when: str) -> None:
        """The root metadata files' `stat`s (`StoreFile.check_root`)."""
        f.check_root(when)

    def range_reader(self, array, path, fd, *, cache_bytes=0, fill_missing=False):
        """`grain_cells.zarr._reads.RangeReader`."""
        from grain_cells.zarr._reads import RangeReader

        return RangeReader(
            array, path, fd, cache_bytes=cache_bytes, fill_missing=fill_missing
        )

    def array_layout(self, array) -> list:
        """Zarr format, shape, dtype, chunk and shard grid, stored bytes."""
        return _zarr_storage(array)


ZARR = formats.register(ZarrFormat())

__all__ = ["ZARR", "StoreFile", "ZarrFormat", "is_store_path", "open_store"]

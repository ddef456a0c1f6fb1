"""Format-neutral access to AnnData elements: HDF5 (h5py) and zarr nodes alike.

AnnData writes the same tree to `.h5ad` (h5py groups and datasets) and to
zarr stores (zarr groups and arrays). The io layer asks this module, never
`isinstance(node, h5py.Group)`, what a node is (`is_group`, `is_array`), for
its attributes (`attr_str`), for its strings (`is_string_array`, `strings`:
h5py gives bytes, zarr v2 and v3 NumPy's variable-width `StringDType` or
object arrays of `str`), and for a reader of its row ranges
(`range_reader`: `grain_cells.hdf5._reads.RangeReader` or
`grain_cells.zarr._reads.RangeReader`, which share one interface).

An open store is a `StoreFile`: the store's root `zarr.Group` with what an
`h5py.File` also offers the io layer (`close`, `with`, `filename`), so every
`with open_file(path) as f:` reads either format.

zarr is imported only by the code that opens a store: a node can only be a
zarr node once `zarr` is imported, so the checks here look it up in
`sys.modules` and a process that reads only `.h5ad` files never imports it.
"""

from __future__ import annotations

import os
import sys

import h5py
import numpy as np

from grain_cells import errors
from grain_cells.hdf5 import _remote as remote_h5
from grain_cells.hdf5._reads import RangeReader as H5RangeReader
from grain_cells.storage._identity import FileStat
from grain_cells.storage.remote import _store as object_store


def _zarr():
    """The `zarr` module if some code imported it, else None."""
    return sys.modules.get("zarr")


# A store's root metadata: anndata's `write_zarr` rewrites these (the group
# and its consolidated metadata) whenever it writes a store.
_ROOT_KEYS = ("zarr.json", ".zgroup", ".zattrs", ".zmetadata")


class StoreFile:
    """An open zarr store's root group, with the handle API of an `h5py.File`.

    Attributes:
        group: The root `zarr.Group` (read-only).
        filename: The store's path or URL, as given.
        stat: The store's `FileStat` when it was opened (see `stat_path`).
    """

    def __init__(self, group, filename: str, stat: FileStat):
        self.group = group
        self.filename = filename
        self.stat = stat
        self._root = self._root_stat()

    def _root_stat(self) -> tuple:
        """`stat`s of a local store's root metadata files (of a zip: the file)."""
        path = self.filename
        if object_store.is_url(path):
            return ()
        if not os.path.isdir(path):
            names = [path]
        else:
            names = [os.path.join(path, k) for k in _ROOT_KEYS]
        out = []
        for name in names:
            try:
                st = os.stat(name)
            except FileNotFoundError:
                out.append((name, None))
                continue
            out.append((name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(out)

    def check_root(self, when: str) -> None:
        """Raises `SourceChangedError` if the root metadata changed since opening.

        A few `stat`s (microseconds): catches a store rewritten in place
        (by anndata, which rewrites the root group and its consolidated
        metadata); a chunk rewritten alone is caught when a process opens
        the store and by `verify_files` (the store digest).
        """
        now = self._root_stat()
        if now != self._root:
            changed = [a[0] for a, b in zip(self._root, now, strict=True) if a != b]
            raise errors.SourceChangedError(
                f"{self.filename}: changed since the AnnDataSource was built "
                f"(detected {when}): the zarr store's root metadata "
                f"({', '.join(os.path.basename(c) for c in changed)}) was "
                "rewritten. The cells read now would not be the cells the "
                "source describes. Build a new source (and do not restore "
                "iterator state saved for the old data)."
            )

    def __getitem__(self, key: str):
        return self.group[key]

    def get(self, key: str, default=None):
        """`group[key]`, or `default` when it is absent."""
        return self.group.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.group

    def keys(self) -> list[str]:
        """Names of the root's members."""
        return sorted(self.group.keys())

    def __iter__(self):
        return iter(self.keys())

    @property
    def attrs(self):
        """The root group's attributes."""
        return self.group.attrs

    def close(self) -> None:
        """Closes the store (a `.zarr.zip`'s file; a no-op for directories)."""
        self.group.store.close()

    def __enter__(self) -> StoreFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreFile({self.filename!r})"


def is_store(f) -> bool:
    """Whether an open handle is a zarr store (else an `h5py.File`)."""
    return isinstance(f, StoreFile)


def is_group(node) -> bool:
    """Whether `node` is a group (h5py or zarr; an open store's root too)."""
    if isinstance(node, (h5py.Group, StoreFile)):
        return True
    zarr = _zarr()
    return zarr is not None and isinstance(node, zarr.Group)


def is_array(node) -> bool:
    """Whether `node` is an array (an h5py dataset or a zarr array)."""
    if isinstance(node, h5py.Dataset):
        return True
    zarr = _zarr()
    return zarr is not None and isinstance(node, zarr.Array)


def is_zarr_array(node) -> bool:
    """Whether `node` is a zarr array."""
    zarr = _zarr()
    return zarr is not None and isinstance(node, zarr.Array)


def checked(node, path: str):
    """`node`, its zarr arrays checked against their own metadata documents.

    A store's consolidated metadata is used to open it, and is only a copy:
    a store changed after it was consolidated would be read with the wrong
    shape, dtype or codecs. For a zarr array, or a zarr group's arrays one
    level down (a categorical's codes and categories, a nullable column's
    values and mask), each is compared with its own document
    (`grain_cells.zarr._store.check_array`: one GET per array in a bucket).
    h5py nodes are returned as they are.

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


def get(group, name: str):
    """`group[name]`, or None when it is absent (or an HDF5 link dangles)."""
    try:
        return group.get(name)
    except (KeyError, OSError):  # a dangling external link "is in" the group
        return None


def attr_str(node, name: str, default=None):
    """An attribute as `str` when it is text (h5py may give bytes)."""
    value = node.attrs.get(name, default)
    return value.decode() if isinstance(value, bytes) else value


def is_string_array(node) -> bool:
    """Whether `node` is an array of strings (HDF5 vlen/fixed, zarr any)."""
    if isinstance(node, h5py.Dataset):
        return h5py.check_string_dtype(node.dtype) is not None
    return is_zarr_array(node) and np.dtype(node.dtype).kind in "OUT"


def strings(node) -> np.ndarray:
    """All of a string array as an object array of `str`."""
    if isinstance(node, h5py.Dataset):
        return np.asarray(node.asstr()[()], dtype=object)
    values = np.asarray(node[...])
    if values.dtype.kind == "S":
        return np.char.decode(values, "utf-8").astype(object)
    return values.astype(object)


def file_name(f) -> str:
    """The path or URL an open handle was opened from."""
    if isinstance(f, StoreFile):
        return f.filename
    return remote_h5.file_name(f)


def is_store_path(path: str) -> bool:
    """Whether `path` (a local path or URL) names a zarr store, unopened.

    A local directory, or a path or URL ending in `.zarr` or `.zarr.zip`.
    """
    p = os.fspath(path).rstrip("/")
    if p.endswith((".zarr", ".zarr.zip")):
        return True
    return not object_store.is_url(p) and os.path.isdir(p)


def stat_path(path: str, storage_options: dict | None = None) -> FileStat:
    """The `FileStat` of a file, object or zarr store now.

    A store's is its `store_digest` (`grain_cells.zarr._store`: its keys with
    sizes and modification times, or ETags in a bucket), so a store
    rewritten in place differs.

    Raises:
        FileNotFoundError: No such file, object or store.
    """
    if is_store_path(path):
        from grain_cells.zarr import _store as zarr_store

        if not object_store.is_url(path) and not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such zarr store")
        return FileStat(
            0, 0, 0, 0, 0, store=zarr_store.store_digest(path, storage_options)
        )
    return remote_h5.stat_path(path, storage_options)


def stat_of(f, path: str) -> FileStat:
    """The stat of an open handle (a store's: taken when it was opened)."""
    if isinstance(f, StoreFile):
        return f.stat
    return remote_h5.stat_of(f, path)


def range_reader(
    node, path: str, fd, *, cache_bytes: int = 0, fill_missing: bool | str = False
):
    """The reader of element ranges of one array, for its format.

    Args:
        node: An h5py dataset or a zarr array.
        path: The file or store, for messages.
        fd: The h5ad file's `ByteReader` (None for zarr).
        cache_bytes: Decoded bytes to cache (small arrays read every batch).
        fill_missing: zarr only: which never-written chunks read as the fill
            value (see `grain_cells.zarr._reads`); HDF5 files have none.

    Returns:
        A `grain_cells.hdf5._reads.RangeReader` or a
        `grain_cells.zarr._reads.RangeReader`.
    """
    if is_zarr_array(node):
        from grain_cells.zarr._reads import RangeReader as ZarrRangeReader

        return ZarrRangeReader(
            node, path, fd, cache_bytes=cache_bytes, fill_missing=fill_missing
        )
    return H5RangeReader(node, path, fd, cache_bytes=cache_bytes)


def zarr_chunk_bytes(array) -> int | None:
    """Decoded bytes of one (inner, if sharded) chunk of a compressed zarr array.

    None when the array has no compressor.
    """
    if not array.compressors:
        return None
    return int(np.prod(array.chunks, dtype=np.int64)) * np.dtype(array.dtype).itemsize


__all__ = [
    "StoreFile",
    "attr_str",
    "checked",
    "file_name",
    "get",
    "is_array",
    "is_group",
    "is_store",
    "is_store_path",
    "is_string_array",
    "is_zarr_array",
    "range_reader",
    "stat_of",
    "stat_path",
    "strings",
    "zarr_chunk_bytes",
]

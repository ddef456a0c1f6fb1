"""AnnData zarr stores as a `grain_cells.formats.Format` (registered on import).

Design notes: docs/reference/design.md#zarr-format, #zarr-store-file.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from grain_cells import errors, formats
from grain_cells.storage import FileStat
from grain_cells.storage.remote import is_url

# A store's root metadata: anndata's `write_zarr` rewrites these (the group
# and its consolidated metadata) whenever it writes a store.
_ROOT_KEYS = ("zarr.json", ".zgroup", ".zattrs", ".zmetadata")


class StoreFile:
    """An open store's root `group` with an `h5py.File`'s handle API."""

    def __init__(self, group, filename: str, stat: FileStat):
        self.group, self.filename, self.stat = group, filename, stat
        self._root = self._root_stat()

    def _root_stat(self) -> tuple:
        """`stat`s of a local store's root metadata files (of a zip: the file)."""
        path = self.filename
        if is_url(path):
            return ()
        names = [path]
        if os.path.isdir(path):
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
        """Raises `SourceChangedError` if the root metadata changed since opening."""
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

    def __contains__(self, key: str) -> bool:
        return key in self.group

    def keys(self) -> list[str]:
        return sorted(self.group.keys())

    def __iter__(self):
        return iter(self.keys())

    def get(self, key: str, default=None):
        return self.group.get(key, default)

    @property
    def attrs(self):
        return self.group.attrs

    def close(self) -> None:  # a `.zarr.zip`'s file; a no-op for directories
        self.group.store.close()

    def __enter__(self) -> StoreFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreFile({self.filename!r})"


class ZarrFormat(formats.Format):
    """zarr v2 and v3 stores: directories, `.zarr.zip`, bucket prefixes."""

    name = "zarr"
    description = "a zarr store"

    def can_open(self, path: str) -> bool:
        """A local directory, or a path or URL ending in `.zarr` or `.zarr.zip`."""
        p = os.fspath(path).rstrip("/")
        return p.endswith((".zarr", ".zarr.zip")) or (
            not is_url(p) and os.path.isdir(p)
        )

    def open(self, path, storage_options=None, stat=None) -> StoreFile:
        """The store's root, read-only (no AnnData check); its `stat` taken anew."""
        stat = self.stat_path(path, storage_options)  # a store's version: its digest
        from grain_cells.zarr import _store

        return StoreFile(_store.open_group(path, storage_options), path, stat)

    def stat_path(self, path, storage_options=None) -> FileStat:
        """The store's `store_digest` now (`FileNotFoundError`: no such store)."""
        from grain_cells.zarr import _store

        if not is_url(path) and not os.path.exists(path):
            raise formats.missing_path(path)
        return FileStat(0, 0, 0, 0, 0, store=_store.store_digest(path, storage_options))

    def stat_of(self, f, path) -> FileStat:
        return f.stat  # taken when the store was opened

    def owns(self, node) -> bool:
        return self.is_group(node) or self.is_array(node)

    def is_group(self, node) -> bool:
        zarr = sys.modules.get("zarr")  # imported once a store opened
        return isinstance(node, StoreFile) or (
            zarr is not None and isinstance(node, zarr.Group)
        )

    def is_array(self, node) -> bool:
        zarr = sys.modules.get("zarr")
        return zarr is not None and isinstance(node, zarr.Array)

    def is_string_array(self, node) -> bool:
        return np.dtype(node.dtype).kind in "OUT"  # StringDType, object, unicode

    def read(self, array, index, path: str, rows: tuple[int, int]) -> np.ndarray:
        from grain_cells.zarr._store import read

        return read(array, index, path, rows)

    def checked(self, node, path: str):
        """`node`, its arrays (one level down) checked against their own metadata."""
        zarr = sys.modules.get("zarr")
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
        if not array.compressors:
            return None
        return (
            int(np.prod(array.chunks, dtype=np.int64)) * np.dtype(array.dtype).itemsize
        )

    def check_unchanged(self, f, when: str) -> None:
        f.check_root(when)

    def range_reader(self, array, path, fd, *, cache_bytes=0, fill_missing=False):
        from grain_cells.zarr._reads import RangeReader

        return RangeReader(
            array, path, cache_bytes=cache_bytes, fill_missing=fill_missing
        )

    def array_layout(self, array) -> list:
        """Fields that read the same under every zarr-python version (not its JSON)."""
        return [
            array.path,
            array.metadata.zarr_format,
            tuple(array.shape),
            np.dtype(array.dtype).str,
            tuple(array.chunks),
            None if array.shards is None else tuple(array.shards),
            int(array.nbytes_stored()),
        ]


ZARR = formats.register(ZarrFormat())

__all__ = ["ZARR", "StoreFile", "ZarrFormat"]

"""An open zarr store's root group, with the handle API of an `h5py.File`.

Design notes: docs/reference/design.md#zarr-store-file.
"""

from __future__ import annotations

import os

from grain_cells import errors
from grain_cells.storage import FileStat
from grain_cells.storage.remote import is_url

# A store's root metadata: anndata's `write_zarr` rewrites these (the group
# and its consolidated metadata) whenever it writes a store.
_ROOT_KEYS = ("zarr.json", ".zgroup", ".zattrs", ".zmetadata")


class StoreFile:
    """An open store's root `group`, `filename` as given and `stat` when opened."""

    def __init__(self, group, filename: str, stat: FileStat):
        self.group = group
        self.filename = filename
        self.stat = stat
        self._root = self._root_stat()

    def _root_stat(self) -> tuple:
        """`stat`s of a local store's root metadata files (of a zip: the file)."""
        path = self.filename
        if is_url(path):
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


__all__ = ["StoreFile"]

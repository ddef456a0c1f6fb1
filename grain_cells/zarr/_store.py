"""Opening zarr stores read-only: local directories, `.zarr.zip`, buckets.

This first version opens local directories and zip files; URLs come with
obstore (`zarr.storage.ObjectStore`) over the same `storage_options` as
`.h5ad` objects.
"""

from __future__ import annotations

import os

import zarr

from grain_cells import errors


def is_zarr_path(path: str) -> bool:
    """Whether `path` names a zarr store (a directory, `.zarr`, `.zarr.zip`)."""
    p = os.fspath(path).rstrip("/")
    return p.endswith((".zarr", ".zarr.zip")) or os.path.isdir(p)


def open_group(path: str, storage_options: dict | None = None) -> zarr.Group:
    """Opens the root group of a zarr store read-only.

    Args:
        path: A local directory or `.zarr.zip` file (URLs: not yet).
        storage_options: For URLs; unused for local stores.

    Raises:
        errors.AnnDataFormatError: The path is not a zarr store.
    """
    del storage_options
    p = os.fspath(path)
    try:
        if p.endswith(".zip"):
            store = zarr.storage.ZipStore(p, mode="r")
        else:
            store = zarr.storage.LocalStore(p, read_only=True)
        return zarr.open_group(store, mode="r")
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as e:
        raise errors.AnnDataFormatError(
            f"{p}: not a zarr store (no zarr group metadata at its root: "
            f"{e}); expected a store written by anndata's write_zarr"
        ) from e


def store_digest(path: str, storage_options: dict | None = None) -> str:
    """A digest that changes when the store's arrays or metadata change.

    Covers every key of the store with its size and modification time (a
    local store; buckets: ETags, to come), so a store rewritten in place
    under a source is detected.

    Args:
        path: A local directory or `.zarr.zip` file.
        storage_options: For URLs; unused for local stores.
    """
    import hashlib

    del storage_options
    p = os.fspath(path)
    h = hashlib.sha256()
    if os.path.isfile(p):
        st = os.stat(p)
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()
    for root, dirs, files in os.walk(p):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)
            rel = os.path.relpath(full, p)
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()

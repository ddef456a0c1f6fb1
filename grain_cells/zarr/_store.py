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

"""Opening AnnData files and stores, local or in a bucket, naming the file.

The format that opens a path refuses what it cannot open; `check_anndata`
then refuses MuData and files without `obs`/`var`.
"""

from __future__ import annotations

import os
import pathlib

from grain_cells import errors, formats
from grain_cells.io import _nodes
from grain_cells.io._frames import encoding_of
from grain_cells.storage import FileStat
from grain_cells.storage.remote import is_url, local_path


def open_file(
    path: str | os.PathLike,
    storage_options: dict | None = None,
    stat: FileStat | None = None,
):
    """Opens an AnnData file or store read-only; close the root it returns.

    `stat`: the version expected. Raises `FileNotFoundError`, or
    `AnnDataFormatError` for what is not AnnData (not HDF5, truncated, MuData...).
    """
    path = os.fspath(path)
    f = formats.for_path(path).open(path, storage_options, stat)
    check_anndata(f, path)
    return f


def check_anndata(f, path: str) -> None:
    """Closes `f` and raises unless it is AnnData: MuData, no `obs`/`var`."""
    mod = _nodes.get(f, "mod")
    if encoding_of(f) == "MuData" or _nodes.is_group(mod):
        modalities = sorted(mod.keys()) if _nodes.is_group(mod) else []
        f.close()
        first = modalities[0] if modalities else "rna"
        raise errors.UnsupportedLayoutError(
            f"{path}: a MuData (.h5mu) file with modalities {modalities}; "
            "grain_cells reads AnnData (.h5ad). Write the modality you want as "
            "its own .h5ad once, e.g. with anndata alone: `with h5py.File(path) "
            f"as f: anndata.io.read_elem(f['mod/{first}']).write_h5ad("
            f"'{first}.h5ad')` (or mudata.read_h5mu(path)['{first}'])."
        )
    missing = [k for k in ("obs", "var") if _nodes.get(f, k) is None]
    if missing:
        found = sorted(f.keys())
        f.close()
        kind = _nodes.format_of(f).description
        raise errors.AnnDataFormatError(
            f"{path}: {kind} but not AnnData: expected groups 'obs' and 'var' at "
            f"the root, found {found}"
        )


def resolve_paths(paths) -> list[str]:
    """One path or a sequence of paths as a list of str (ValueError if empty)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    # URLs of objects stay as they are; file:// URLs become local paths.
    out = [p if is_url(p) else os.fspath(pathlib.Path(local_path(p))) for p in paths]
    if not out:
        raise ValueError(
            "paths is empty: expected one or more .h5ad files or zarr stores"
        )
    return out

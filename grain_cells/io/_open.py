"""Opening `.h5ad` files, local or in a bucket, with errors that name the file.

`open_file` refuses what is not AnnData before anything reads it: missing
paths and dangling links, directories (zarr), non-HDF5 files, files HDF5
cannot open (held by a writer, truncated), MuData, HDF5 without `obs`/`var`.
`grain_cells.io._h5ad` re-exports these functions.
"""

from __future__ import annotations

import errno
import os
import pathlib

import h5py

from grain_cells import errors
from grain_cells.hdf5 import _remote as remote_h5
from grain_cells.io._frames import encoding_of
from grain_cells.storage._identity import FileStat
from grain_cells.storage.remote import _store as object_store


def open_file(
    path: str | os.PathLike,
    storage_options: dict | None = None,
    stat: FileStat | None = None,
) -> h5py.File:
    """Opens an `.h5ad` file read-only with errors that name the file.

    A URL is opened through `remote_h5.open_h5` with `storage_options`
    (None: from the environment).

    Raises:
        FileNotFoundError: The path does not exist (or is a dangling symlink).
        errors.AnnDataFormatError: The file is not HDF5, is truncated, is held
            by a writer, is a symlink loop or a MuData file, or has no
            `obs`/`var` (not AnnData).
    """
    path = os.fspath(path)
    if object_store.is_url(path):
        f = remote_h5.open_remote(path, storage_options, stat)
        check_anndata(f, path)
        return f
    try:
        os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise FileNotFoundError(
                f"{path}: a symbolic link to {os.readlink(path)}, which does not exist"
            ) from None
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise errors.AnnDataFormatError(
                f"{path}: a loop of symbolic links ({path} -> "
                f"{os.readlink(path)} -> ...); point it at the real file"
            ) from e
        raise errors.AnnDataFormatError(f"{path}: cannot be opened ({e})") from e
    if os.path.isdir(path):
        raise errors.AnnDataFormatError(
            f"{path}: is a directory, expected an .h5ad file (zarr stores are "
            "not supported)"
        )
    if not h5py.is_hdf5(path):
        raise errors.AnnDataFormatError(
            f"{path}: not an HDF5 file (no HDF5 signature), expected an .h5ad "
            "file written by anndata"
        )
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise errors.AnnDataFormatError(f"{path}: {_open_failure(e)}") from e
    check_anndata(f, path)
    return f


def check_anndata(f: h5py.File, path: str) -> None:
    """Closes `f` and raises unless it is an AnnData file (not MuData).

    Raises:
        errors.UnsupportedLayoutError: A MuData file.
        errors.AnnDataFormatError: No `obs`/`var` at the root.
    """
    if encoding_of(f) == "MuData" or isinstance(f.get("mod"), h5py.Group):
        modalities = sorted(f["mod"]) if isinstance(f.get("mod"), h5py.Group) else []
        f.close()
        first = modalities[0] if modalities else "rna"
        raise errors.UnsupportedLayoutError(
            f"{path}: a MuData (.h5mu) file with modalities {modalities}; "
            "grain_cells reads AnnData (.h5ad). Write the modality you want as "
            "its own .h5ad once, e.g. with anndata alone: `with h5py.File(path) "
            f"as f: anndata.io.read_elem(f['mod/{first}']).write_h5ad("
            f"'{first}.h5ad')` (or mudata.read_h5mu(path)['{first}'])."
        )
    missing = [k for k in ("obs", "var") if k not in f]
    if missing:
        found = sorted(f.keys())
        f.close()
        raise errors.AnnDataFormatError(
            f"{path}: HDF5 but not AnnData: expected groups 'obs' and 'var' at "
            f"the root, found {found}"
        )


def _open_failure(e: OSError) -> str:
    """Why HDF5 refused to open a file that has an HDF5 signature."""
    message = str(e)
    if "lock" in message.lower():
        return (
            f"another process holds it open for writing (HDF5 file lock: "
            f"{message}). Wait until the writer closes it. Only if no process "
            "writes it any more (a writer crashed), set HDF5_USE_FILE_LOCKING="
            "FALSE to read it."
        )
    if "already open for write" in message:
        return (
            f"its writer did not close it, or has it open now ({message}). If "
            "no process writes it, clear the flag with `h5clear -s <file>` (HDF5 "
            "tools), then read it."
        )
    return f"HDF5 cannot open it ({message}); the file is probably truncated or corrupt"


def resolve_paths(paths) -> list[str]:
    """Normalises one path or a sequence of paths to a list of str.

    Raises:
        ValueError: The list is empty.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    # URLs of objects stay as they are; file:// URLs become local paths.
    out = [
        p
        if object_store.is_url(p)
        else os.fspath(pathlib.Path(object_store.local_path(p)))
        for p in paths
    ]
    if not out:
        raise ValueError("paths is empty: expected one or more .h5ad files")
    return out

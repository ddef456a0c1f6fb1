"""Opening `.h5ad` files and zarr stores, local or in a bucket, naming the file.

`open_file` refuses what is not AnnData before anything reads it: missing
paths and dangling links, directories that are not zarr stores, non-HDF5
files, files HDF5 cannot open (held by a writer, truncated), MuData, files
and stores without `obs`/`var`. A zarr store (a directory holding
`zarr.json` or `.zgroup`, a path or URL ending in `.zarr` or `.zarr.zip`)
is opened with `grain_cells.zarr._store.open_group` and returned as a
`grain_cells.io._nodes.StoreFile`, which the io layer reads as it reads an
`h5py.File`. `grain_cells.io._h5ad` re-exports these functions.
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import zipfile

import h5py

from grain_cells import errors
from grain_cells.hdf5 import _remote as remote_h5
from grain_cells.io import _nodes as nodes
from grain_cells.io._frames import encoding_of
from grain_cells.storage._identity import FileStat
from grain_cells.storage.remote import _store as object_store


def open_file(
    path: str | os.PathLike,
    storage_options: dict | None = None,
    stat: FileStat | None = None,
) -> h5py.File | nodes.StoreFile:
    """Opens an `.h5ad` file or a zarr store read-only, errors naming the file.

    A URL is opened through `remote_h5.open_h5` (a zarr store's through
    `grain_cells.zarr._store.open_group`) with `storage_options` (None: from
    the environment).

    Args:
        path: The file, store or URL.
        storage_options: For URLs: the object-store configuration.
        stat: The object version expected (a `FileStat` taken before). A
            zarr store's `stat` is always taken anew (its `store_digest`),
            so comparing it with an identity's detects a rewritten store.

    Returns:
        An `h5py.File`, or a `StoreFile` for a zarr store; close it (or use
        `with`).

    Raises:
        FileNotFoundError: The path does not exist (or is a dangling symlink).
        errors.AnnDataFormatError: The file is not HDF5, is truncated, is held
            by a writer, is a symlink loop or a MuData file, or has no
            `obs`/`var` (not AnnData).
    """
    path = os.fspath(path)
    if nodes.is_store_path(path):
        return _open_store(path, storage_options, stat)
    if object_store.is_url(path):
        f = remote_h5.open_remote(path, storage_options, stat)
        check_anndata(f, path)
        return f
    try:
        os.stat(path)
    except FileNotFoundError:
        raise _missing(path) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise errors.AnnDataFormatError(
                f"{path}: a loop of symbolic links ({path} -> "
                f"{os.readlink(path)} -> ...); point it at the real file"
            ) from e
        raise errors.AnnDataFormatError(f"{path}: cannot be opened ({e})") from e
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


def _open_store(path: str, storage_options: dict | None, stat: FileStat | None):
    """Opens a zarr store (see `open_file`), checked to be AnnData."""
    from grain_cells.zarr import _store as zarr_store

    local = not object_store.is_url(path)
    if local and not os.path.exists(path):
        raise _missing(path)
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
    stat = nodes.stat_path(path, storage_options)
    import zarr

    try:
        group = zarr_store.open_group(path, storage_options)
    except zarr.errors.ContainsArrayError as e:
        raise _root_array(path) from e
    f = nodes.StoreFile(group, path, stat)
    check_anndata(f, path)
    return f


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


def _missing(path: str) -> FileNotFoundError:
    """The error of a path that does not exist."""
    if os.path.islink(path):
        return FileNotFoundError(
            f"{path}: a symbolic link to {os.readlink(path)}, which does not exist"
        )
    return FileNotFoundError(f"{path}: no such file")


def check_anndata(f, path: str) -> None:
    """Closes `f` and raises unless it is an AnnData file (not MuData).

    Args:
        f: An open `h5py.File` or zarr `StoreFile`.
        path: Its path, for messages.

    Raises:
        errors.UnsupportedLayoutError: A MuData file.
        errors.AnnDataFormatError: No `obs`/`var` at the root.
    """
    mod = nodes.get(f, "mod")
    if encoding_of(f) == "MuData" or nodes.is_group(mod):
        modalities = sorted(mod.keys()) if nodes.is_group(mod) else []
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
        kind = "a zarr store" if nodes.is_store(f) else "HDF5"
        raise errors.AnnDataFormatError(
            f"{path}: {kind} but not AnnData: expected groups 'obs' and 'var' at "
            f"the root, found {found}"
        )


_TRUNCATED = re.compile(
    r"truncated file: eof = (\d+), sblock->base_addr = (\d+), stored_eof = (\d+)"
)
_LOCKED = re.compile(r"\block(ed|ing)?\b|unable to lock", re.IGNORECASE)


def _open_failure(e: OSError) -> str:
    """Why HDF5 refused to open a file that has an HDF5 signature."""
    message = str(e)
    # HDF5 compares the file's size with the end-of-file address its
    # superblock records; checked first, as "sblock" would match "lock".
    cut = _TRUNCATED.search(message)
    if cut:
        found, base, stored = (int(g) for g in cut.groups())
        return (
            f"the file is truncated: its superblock records {base + stored:,} "
            f"bytes, but only {found:,} bytes are on disk ({message}). An "
            "interrupted download or copy: copy the file again from its source."
        )
    if _LOCKED.search(message):
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
        raise ValueError(
            "paths is empty: expected one or more .h5ad files or zarr stores"
        )
    return out

"""Opening an HDF5 file read-only by path or URL, naming the file on failure.

Refuses missing paths, dangling links and symlink loops, files without an
HDF5 signature and files HDF5 cannot open (held by a writer, truncated),
each by name. A URL opens through `grain_cells.hdf5._remote.open_remote`.
Whether the file is AnnData is `grain_cells.io._open.check_anndata`'s to say.

Design notes: docs/reference/design.md#hdf5-open.
"""

from __future__ import annotations

import errno
import os
import re

import h5py

from grain_cells import errors
from grain_cells.formats import missing_path
from grain_cells.hdf5 import _handles, _remote
from grain_cells.storage import FileStat
from grain_cells.storage.remote import is_url


def open_h5(
    path: str, storage_options: dict | None = None, stat: FileStat | None = None
) -> h5py.File:
    """Opens an HDF5 file or object read-only (see `open_file` in io).

    Raises:
        FileNotFoundError: The path does not exist (or is a dangling symlink).
        errors.AnnDataFormatError: The file is not HDF5, is truncated, is held
            by a writer, or is a symlink loop.
    """
    if is_url(path):
        return _remote.open_remote(path, storage_options, stat)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise missing_path(path) from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise errors.AnnDataFormatError(
                f"{path}: a loop of symbolic links ({path} -> "
                f"{os.readlink(path)} -> ...); point it at the real file"
            ) from e
        raise errors.AnnDataFormatError(f"{path}: cannot be opened ({e})") from e
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        # Asked only now: a file that opens has the signature (one open less).
        if not h5py.is_hdf5(path):
            raise errors.AnnDataFormatError(
                f"{path}: not an HDF5 file (no HDF5 signature), expected an .h5ad "
                "file written by anndata"
            ) from None
        raise errors.AnnDataFormatError(f"{path}: {_open_failure(e)}") from e
    _handles.opened(f, path)
    return f


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


__all__ = ["open_h5"]

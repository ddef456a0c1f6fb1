"""A sampler's large table shared with its workers through one cache file.

Cumulative weights of `MIN_BYTES` or more are written once under
`$GRAIN_CELLS_CACHE/weights/` (named by their digest, which also ends the file) and
mapped read-only by each worker instead of pickled into each. Design notes:
docs/reference/design.md#sampling-shared-table.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np

from grain_cells._util.cache_files import cache_root, write_atomic

MIN_BYTES = 1 << 20  # smaller tables travel in the pickle
_STAMP = 40  # hex digits of the name, also written after the values


def _folder() -> pathlib.Path:
    return pathlib.Path(cache_root(xdg=False)).expanduser() / "weights"


def share(values: np.ndarray, digest: str) -> str | None:
    """The path of an entry holding `values` (written when absent), or None.

    `values` is a 1-D float64 array and `digest` at least `_STAMP` hex digits naming it;
    None when the folder cannot be written.
    """
    stamp = digest[:_STAMP]
    path = _folder() / f"{stamp}.npy"
    if _check(path, values.size, stamp) is None:
        return str(path)

    def write(fh) -> None:
        np.save(fh, np.ascontiguousarray(values, "<f8"))
        fh.write(stamp.encode())

    try:
        write_atomic(path, write)
    except OSError:
        return None
    return str(path)


def _check(path: pathlib.Path, size: int, stamp: str) -> str | None:
    """None when the entry is whole and named `stamp`, else what is wrong."""
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            offset = fh.tell()
            length = os.fstat(fh.fileno()).st_size
            fh.seek(max(length - _STAMP, 0))
            found = fh.read(_STAMP).decode("ascii", "replace")
    except FileNotFoundError:
        return "no such file"
    except (OSError, ValueError) as e:
        return f"unreadable ({e})"
    if shape != (size,) or fortran or dtype != np.dtype("<f8"):
        return f"shape {shape}, dtype {dtype}; expected ({size},) float64"
    if length != offset + 8 * size + _STAMP or found != stamp:
        return f"{length} bytes ending in {found!r}; expected the stamp {stamp!r}"
    return None


def load(path: str, size: int, digest: str) -> np.ndarray:
    """The entry at `path`, mapped read-only.

    Raises:
        FileNotFoundError: The entry is gone or not whole.
    """
    stamp = digest[:_STAMP]
    problem = _check(pathlib.Path(path), size, stamp)
    if problem is not None:
        raise FileNotFoundError(
            f"{path}: the weighted sampler's shared table (cumulative weights, "
            f"{size} blocks) is not whole: {problem}. It is written when the "
            "sampler is pickled for workers; the cache folder was emptied while "
            "workers started. Start the loader again, and leave the folder "
            "(weights/ under $GRAIN_CELLS_CACHE) alone while loaders start"
        )
    return np.load(path, mmap_mode="r")

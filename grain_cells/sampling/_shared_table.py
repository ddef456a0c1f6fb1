"""A sampler's large table shared with its workers through one cache file.

A `WeightedBlockSampler` draws by binary search in the cumulative weights,
8 bytes per block (50 MB at 6.25M blocks). Pickled into every worker, that
is 50 MB per worker, and as much anonymous memory in each. Instead, when
the table is at least `MIN_BYTES`, the process that pickles the sampler
writes it once to `weights/` under `$GRAIN_CELLS_CACHE` (or
`~/.cache/grain_cells`), named by a digest of the weights, and the pickle
holds the file's path; each worker maps it read-only (`np.memmap`): its
pages are the kernel's page cache, shared by every process.

An entry is a `.npy` file followed by its name's digest; writing goes to a
temporary file renamed over the entry (atomic), so a reader sees a whole
entry or none, and processes that race write the same bytes. Reading checks
the header (float64, one value per block), the file's size and the digest
at its end. A folder that cannot be written leaves the table in the pickle.
Delete the folder only while no loader is starting workers: a worker that
finds its entry gone raises `FileNotFoundError`, naming it.
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

    Args:
        values: A 1-D float64 array.
        digest: At least `_STAMP` hex digits that name these values.

    Returns:
        The entry's path, or None when the folder cannot be written.
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


__all__ = ["MIN_BYTES", "load", "share"]

"""Chunk starts of a file's matrix, cached in the user's cache folder.

Which rows begin a chunk of a CSR matrix's `data` (`CsrReader.chunk_starts`)
is known only from `indptr`: a compressed file's whole `indptr` is decoded
to find them (8 bytes per cell; 1.4 CPU-s of inflating at 100M cells here),
on every construction of a source without a `block_size` and at every
`chunk_aligned`. The answer is small (one int64 per chunk of `data`: 64 KiB
for a thin 100M-cell file, a few MB for an atlas) and never changes while
the file does not, so it is kept in `$GRAIN_CELLS_CACHE/chunk-starts/`
(else `$XDG_CACHE_HOME/grain_cells` or `~/.cache/grain_cells`, as
`grain_cells.corpus_stats` does), one `.npy` per file, and a second
construction reads it instead of opening the file again.

The key is the file's identity as the source took it
(`grain_cells.io._identity.FileIdentity`): path, device, inode, size,
modification and status-change times (or ETag / store digest), the matrix
element, and the digests of its layout and sampled values. A file written
in any way gets a new key; an entry is never trusted beyond its shape (a
1-D int64 array, sorted, from row 0, within the file's rows), and anything
wrong with it, or with the folder, falls back to computing the starts.
Writes go to a temporary file renamed into place, so readers never see half
an entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Callable

import numpy as np

from grain_cells.io import FileIdentity

_VERSION = "chunk-starts-v1"


def cache_dir() -> str:
    """The folder of cached chunk starts: never the folder of the data."""
    folder = os.environ.get("GRAIN_CELLS_CACHE")
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
            os.path.expanduser("~"), ".cache"
        )
        folder = os.path.join(base, "grain_cells")
    return os.path.join(folder, "chunk-starts")


def cache_key(identity: FileIdentity) -> str:
    """The entry's name: a digest of everything that identifies the file."""
    parts = [
        _VERSION,
        identity.path,
        identity.element,
        dataclasses.astuple(identity.stat),
        identity.layout,
        identity.sample,
        identity.format,
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def cached_chunk_starts(
    identity: FileIdentity, n_obs: int, compute: Callable[[], np.ndarray]
) -> np.ndarray:
    """Local chunk starts of one file: from the cache, else `compute()` (kept).

    Args:
        identity: The file's identity, taken when the source was built.
        n_obs: The file's rows.
        compute: Returns the starts (`reader.chunk_starts()`), opening the
            file; called only on a miss.

    Returns:
        A sorted int64 array of local rows, starting at 0.
    """
    path = os.path.join(cache_dir(), cache_key(identity) + ".npy")
    starts = _load(path, n_obs)
    if starts is not None:
        return starts
    starts = np.asarray(compute(), np.int64)
    _save(path, starts)
    return starts


def _load(path: str, n_obs: int) -> np.ndarray | None:
    try:
        starts = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if (
        starts.dtype != np.int64
        or starts.ndim != 1
        or starts.size == 0
        or starts[0] != 0
        or starts[-1] >= max(n_obs, 1)
        or (starts.size > 1 and not (np.diff(starts) > 0).all())
    ):
        return None
    return starts


def _save(path: str, starts: np.ndarray) -> None:
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from others
            with os.fdopen(fd, "wb") as out:
                np.save(out, starts, allow_pickle=False)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:  # a read-only or full cache: compute again next time
        return


__all__ = ["cache_dir", "cache_key", "cached_chunk_starts"]

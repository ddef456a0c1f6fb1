"""Chunk starts of a file's matrix, cached in the user's cache folder.

The rows that begin a chunk of a CSR matrix's `data` (`CsrReader.chunk_starts`,
which decodes all of a compressed `indptr`) are kept in
`$GRAIN_CELLS_CACHE/chunk-starts/` (else `$XDG_CACHE_HOME/grain_cells` or
`~/.cache/grain_cells`), one `.npy` per file identity; a later construction
reads them instead of opening the file.

Design notes: docs/reference/design.md#source-chunk-cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable

import numpy as np

from grain_cells._util.cache_files import cache_root, write_atomic
from grain_cells.io import FileIdentity

_VERSION = "chunk-starts-v1"


def cache_dir() -> str:
    """The folder of cached chunk starts: never the folder of the data."""
    return os.path.join(cache_root(), "chunk-starts")


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

    `compute` (`reader.chunk_starts()`) opens the file; called only on a
    miss. A sorted int64 array of local rows, starting at 0.
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
    try:
        write_atomic(path, lambda out: np.save(out, starts, allow_pickle=False))
    except OSError:  # a read-only or full cache: compute again next time
        return


__all__ = ["cache_dir", "cache_key", "cached_chunk_starts"]

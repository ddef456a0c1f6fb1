"""Which rows begin each chunk of a CSR matrix's values: a scan of `indptr`.

A compressed CSR file is decoded chunk by chunk of `data` (and `indices`),
and the blocks of a source built without `block_size` follow those chunks
(`grain_cells.source._chunk_grid`). Row r belongs to the chunk that holds
its first value, so chunk k's first row is the first row whose pointer
reaches `k * values_per_chunk`: `indptr` says it, and nothing else does
(HDF5's chunk table gives a chunk's bytes, not its rows).

Design notes: docs/reference/design.md#io-chunk-rows.
"""

from __future__ import annotations

import numpy as np

# `indptr` entries per read of the scan (8 MiB of int64).
SCAN_ROWS = 1 << 20


def scan_chunk_starts(reader, n_rows: int, values_per_chunk: int) -> np.ndarray:
    """Local rows where a chunk of values begins, from row 0, sorted, unique.

    `reader` reads `indptr` (best uncached: the scan reads every chunk once);
    `values_per_chunk`: values per chunk of `data`.
    """
    n = int(n_rows)
    ptr_chunk = reader.chunk_length or SCAN_ROWS
    piece = max(1, SCAN_ROWS // ptr_chunk) * ptr_chunk
    last = np.empty(1, reader.dtype)
    reader.read(np.array([n]), np.array([n + 1]), last)
    n_chunks = max(1, -(-int(last[0]) // values_per_chunk))
    targets = np.arange(n_chunks, dtype=np.int64) * values_per_chunk
    starts = np.full(n_chunks, n, np.int64)  # "no row reaches it" until found
    buf = np.empty(min(piece, n), reader.dtype)
    done = 0
    for a in range(0, n, piece):
        if done == n_chunks:
            break
        b = min(a + piece, n)
        ptr = buf[: b - a]
        reader.read(np.array([a]), np.array([b]), ptr)
        ptr = ptr.astype(np.int64, copy=False)
        # Targets up to this piece's last pointer are passed inside it (the
        # earlier ones were passed before it).
        upto = int(np.searchsorted(targets, ptr[-1], side="right"))
        if upto > done:
            found = np.searchsorted(ptr, targets[done:upto], side="left")
            starts[done:upto] = a + found
            done = upto
    starts = np.unique(starts)
    # A last chunk that holds only the tail of the last row starts none.
    return starts[starts < n]


__all__ = ["SCAN_ROWS", "scan_chunk_starts"]

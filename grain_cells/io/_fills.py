"""Whether CSR values read from never-written chunks are consistent.

A format may skip writing a chunk whose values all equal the fill value (0),
and anndata writes with that default: a chunk of `indices` all in column 0
(cells that express only gene 0) or of `data` all 0.0 (stored zeros) is
absent from a valid store, and anndata reads it as zeros. So
`CsrReader` reads such chunks as the fill value, and only the rows can tell
a lost chunk from one never needed: a row that then stores column 0 twice
is not what anndata writes (SciPy's CSR from a matrix keeps one entry per
column), so its chunk was lost. A lost `data` chunk reads as stored zeros,
which no check can tell from real ones. Design notes:
docs/reference/design.md ("Missing chunks").
"""

from __future__ import annotations

import numpy as np

from grain_cells import errors


def check_filled_indices(reader, plan, indices: np.ndarray, info) -> None:
    """Raises if a row's column-0 entries from fill chunks repeat.

    `reader` reads `indices`; one that reads missing chunks as the fill value
    lists them (`filled_ranges`).

    Raises:
        errors.CorruptChunkError: A row holds a value from a never-written
            chunk and column 0 more than once; names store, array, chunk key
            and row.
    """
    filled = getattr(reader, "filled_ranges", None)
    ranges = filled() if filled is not None and plan.nnz else []
    if not ranges:
        return
    spans = plan.lasts - plan.firsts
    offsets = np.cumsum(spans) - spans  # where each range's values begin
    from_fill = np.zeros(plan.nnz, bool)
    for a, b, _ in ranges:
        lo = np.maximum(plan.firsts, a) - plan.firsts + offsets
        hi = np.minimum(plan.lasts, b) - plan.firsts + offsets
        for x, y in zip(lo.tolist(), hi.tolist(), strict=True):
            if y > x:
                from_fill[x:y] = True
    ptr = plan.indptr

    def per_row(mask):
        total = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        return total[ptr[1:]] - total[ptr[:-1]]

    zeros = per_row(indices == 0)
    bad = np.flatnonzero((per_row(from_fill) > 0) & (zeros > 1))
    if bad.size == 0:
        return
    r = int(bad[0])
    lengths = plan.lengths
    at = int(np.searchsorted(np.cumsum(lengths), r, side="right"))
    row = int(plan.starts[at] + r - (np.cumsum(lengths)[at] - lengths[at]))
    p = int(ptr[r] + np.flatnonzero(from_fill[ptr[r] : ptr[r + 1]])[0])
    i = int(np.searchsorted(offsets, p, side="right")) - 1
    value = int(plan.firsts[i] + p - offsets[i])
    a, b, key = next(x for x in ranges if x[0] <= value < x[1])
    raise errors.CorruptChunkError(
        f"{info.path}: {info.element}/indices chunk key {key!r} was never "
        f"written, so it reads as the fill value (column 0) for values "
        f"[{a}, {b}); but then row {row} stores column 0 {int(zeros[r])} "
        "times, which anndata never writes. The chunk was lost (an "
        "interrupted write or copy): the store is damaged; rewrite or "
        "re-copy it.",
        path=info.path,
        dataset=f"/{info.element}/indices",
        rows=(row, row + 1),
        chunk_key=key,
    )

"""The width of `PaddedSparseOutput()`, fitted once per source from a sample.

**The rule.** `PaddedSparseOutput(width=None)` (the default) is fitted when
a pipeline is built (`fetch_operations`, `cell_dataset`,
`grain_cells.DataLoader`), in the process that builds it:

1. *Sample*: up to `SAMPLE_CELLS` (4,096) cells, as whole blocks of the
   source at `ceil(SAMPLE_CELLS / block_size)` evenly spaced block keys
   (`np.linspace(0, len(source) - 1, k)`, rounded, without repeats): no
   random draw, so the same source (files, selection, genes) always gives
   the same sample. A source of fewer cells is read whole.
2. *Count* each sampled cell's stored values in output columns (after the
   source's gene selection and join; for a dense X, its non-zero values).
3. *Width*: the `quantile` (0.999 by default) of those counts (NumPy's
   `method="higher"`: a count that some cell has), rounded up to a multiple
   of `WIDTH_MULTIPLE` (128), and at least 128.

Design notes: docs/reference/design.md#outputs-width.
"""

from __future__ import annotations

import math

import numpy as np

from grain_cells.io import RowBuffer

SAMPLE_CELLS = 4096
"""Cells (at most) whose stored values decide a fitted width."""

WIDTH_MULTIPLE = 128
"""A fitted width is a multiple of this (lanes of an accelerator's vector unit)."""


def sample_ranges(source) -> tuple[np.ndarray, np.ndarray]:
    """Global row ranges `(starts, stops)` of the sample, sorted by start.

    Whole blocks of `source` at evenly spaced keys (see the design notes).
    """
    n_blocks = len(source)
    k = min(n_blocks, max(1, math.ceil(SAMPLE_CELLS / source.block_size)))
    keys = np.unique(np.rint(np.linspace(0, n_blocks - 1, k)).astype(np.int64))
    _, starts, stops = source.block_ranges(keys)
    order = np.argsort(starts, kind="stable")
    return starts[order], stops[order]


def stored_counts(rows) -> np.ndarray:
    """Stored values per row of a read (`csr` or `dense`, see `FetchedRows`)."""
    if rows.csr is not None:
        return np.diff(rows.csr.indptr)
    return np.count_nonzero(rows.dense, axis=1)


def width_for(counts: np.ndarray, quantile: float) -> int:
    """The rule's width for per-cell counts (see the design notes)."""
    top = int(np.quantile(counts, quantile, method="higher")) if counts.size else 0
    return max(WIDTH_MULTIPLE, -(-top // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)


def fit_width(source, quantile: float, read=None) -> int:
    """The width fitted to `source`'s sample.

    Args:
        source: An `AnnDataSource` (or view).
        quantile: Which quantile of the sampled counts.
        read: `read(starts, stops, buffer)` returning rows with `csr` or
            `dense` (an extra layer's reader); `source.fetch_ranges` (X) by
            default.
    """
    if len(source) == 0:
        return WIDTH_MULTIPLE
    starts, stops = sample_ranges(source)
    rows = (read or source.fetch_ranges)(starts, stops, RowBuffer())
    return width_for(stored_counts(rows), quantile)

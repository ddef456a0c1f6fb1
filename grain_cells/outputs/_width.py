"""The width of `PaddedSparseOutput()`, fitted once per source from a sample.

The `quantile` of stored values per cell over up to `SAMPLE_CELLS` cells in evenly
spaced blocks (no random draw), rounded up to a multiple of `WIDTH_MULTIPLE` (lanes
of an accelerator's vector unit). Design notes: docs/reference/design.md#outputs-width.
"""

from __future__ import annotations

import math

import numpy as np

from grain_cells.io import RowBuffer

SAMPLE_CELLS = 4096
WIDTH_MULTIPLE = 128


def sample_ranges(source) -> tuple[np.ndarray, np.ndarray]:
    """Global row ranges `(starts, stops)` of the sample's blocks, sorted by start."""
    n_blocks = len(source)
    k = min(n_blocks, max(1, math.ceil(SAMPLE_CELLS / source.block_size)))
    keys = np.unique(np.rint(np.linspace(0, n_blocks - 1, k)).astype(np.int64))
    _, starts, stops = source.block_ranges(keys)
    order = np.argsort(starts, kind="stable")
    return starts[order], stops[order]


def fit_width(source, quantile: float, read=None) -> int:
    """The width fitted to `source`'s sample; `read` reads another matrix than X."""
    if len(source) == 0:
        return WIDTH_MULTIPLE
    starts, stops = sample_ranges(source)
    rows = (read or source.fetch_ranges)(starts, stops, RowBuffer())
    if rows.csr is not None:
        counts = np.diff(rows.csr.indptr)
    else:
        counts = np.count_nonzero(rows.dense, axis=1)
    top = int(np.quantile(counts, quantile, method="higher")) if counts.size else 0
    return max(WIDTH_MULTIPLE, -(-top // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)

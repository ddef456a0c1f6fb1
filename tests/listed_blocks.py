"""A reference for tests: blocks over runs of selected rows, listed one by one."""

from __future__ import annotations

import itertools

import numpy as np


def blocks_over_runs(mask, cuts, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`(starts, stops)` of blocks of `block_size` rows from each run of True in
    `mask`, a run ending at a gap and at every cut (file boundaries: `cuts`)."""
    mask = np.asarray(mask, bool)
    starts, stops = [], []
    for a, b in itertools.pairwise(cuts):
        edges = np.diff(np.concatenate([[0], mask[a:b].astype(np.int8), [0]]))
        runs = zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True)
        for first, end in runs:
            for row in range(a + first, a + end, block_size):
                starts.append(row)
                stops.append(min(row + block_size, a + end))
    return np.array(starts, np.int64), np.array(stops, np.int64)

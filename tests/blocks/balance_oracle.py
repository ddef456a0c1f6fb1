"""The documented class balance, computed plainly over a dense table.

`balanced_block_weights` iterates on class x class sums exact per block
length, then weights each block by the final multipliers. Here the same
steps on a dense blocks x classes table of integer counts (column 0: cells
without a label): the oracle of `test_composition.py` (random tables) and
`test_balance_at_scale.py` (a file written by anndata). Both compare bit
for bit, so the order of every sum is the documented one.
"""

from __future__ import annotations

import numpy as np


def balance(table, lengths, target, max_iterations, tolerance):
    """(block weights, shares reached, gap, multipliers used) of `table`.

    Args:
        table: Blocks x classes cell counts (int64).
        lengths: Cells of each block.
        target: The wanted share of each class.
    """
    width = target.size
    matrix = np.zeros((width, width))
    for length in np.unique(lengths):
        rows = table[lengths == length]
        matrix += (rows.T @ rows).astype(np.float64) / length  # integers: exact
    total = table.sum(0).astype(np.float64)
    multiplier = np.divide(target, total, out=np.zeros(width), where=total > 0)
    for _ in range(max_iterations + 1):
        used = multiplier.copy()
        emitted = np.zeros(width)
        for k in range(width):
            if used[k]:
                emitted += used[k] * matrix[k]
        got = emitted / emitted.sum()
        gap = float(np.abs(got - target).max())
        if gap <= tolerance:
            break
        multiplier *= np.divide(target, got, out=np.ones(width), where=got > 0)
        multiplier /= multiplier.max()
    sums = np.zeros(lengths.size)
    for k in range(width):
        if used[k]:
            sums += used[k] * table[:, k]
    return sums / lengths, got, gap, used

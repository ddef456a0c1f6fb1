"""Class x class sums over blocks, `M[k, j] = sum_b c_bk c_bj / n_b`.

What `balanced_block_weights` iterates on; exact integer sums, so the weights are
the same on every machine. Design notes: docs/reference/design.md#blocks-pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from grain_cells._util.ranges import expand_ranges

_PIECE_CELLS = 1 << 18  # cells counted at a time
_DENSE_ENTRIES = 1 << 21  # blocks x classes of a dense piece, at most
_DENSE_COST = 512  # dense when width**2 <= this * longest (measured, ~10x BLAS)


class Pairs(NamedTuple):
    """Per class index: cells (float64, exact), and `M` (width x width)."""

    counts: np.ndarray
    matrix: np.ndarray

    def emitted(self, multiplier: np.ndarray) -> np.ndarray:
        """`sum_k multiplier[k] * M[k]`, added in increasing `k`."""
        out = np.zeros(self.matrix.shape[1])
        for k in np.flatnonzero(multiplier):
            out += multiplier[k] * self.matrix[k]
        return out


def pieces(codes, ranges, num_blocks: int, longest: int, width: int):
    """Yields `(first block, class index per cell, cells per block)` per piece.

    `codes`: one per global row (-1: missing, class 0); `ranges(a, b)`: blocks'
    `(starts, stops)`.
    """
    step = max(1, _PIECE_CELLS // max(1, longest))
    if _dense(width, longest):
        step = max(1, min(step, _DENSE_ENTRIES // width))
    for a in range(0, num_blocks, step):
        b = min(num_blocks, a + step)
        starts, stops = ranges(a, b)
        n = (stops - starts).astype(np.int64)
        if stops[-1] - starts[0] == int(n.sum()):  # contiguous
            c = codes[starts[0] : stops[-1]]
        else:
            c = codes[expand_ranges(starts, n)]
        yield a, c.astype(np.int64) + 1, n


def entries(codes, ranges, num_blocks: int, longest: int, width: int):
    """Yields `(first block, block, class, count)` per piece, by block then class."""
    for a, klass, n in pieces(codes, ranges, num_blocks, longest, width):
        yield (a, *_piece_entries(klass, n, width))


def class_sums(codes, ranges, num_blocks: int, longest: int, width: int, weights=None):
    """Per class: the sum of `weights[block] * count` (None: `count`), exact."""
    total = np.zeros(width)
    head = np.arange(width)
    for a, block, klass, count in entries(codes, ranges, num_blocks, longest, width):
        values = count if weights is None else weights[a + block] * count
        total = np.bincount(
            np.concatenate([head, klass]),
            np.concatenate([total, values]),
            minlength=width,
        )
    return total


def _piece_entries(klass: np.ndarray, lengths: np.ndarray, width: int):
    """`(block, class, count)` of one piece's cells, sorted by block, class."""
    firsts = np.cumsum(lengths) - lengths
    change = np.empty(klass.size, bool)
    change[0] = True
    np.not_equal(klass[1:], klass[:-1], out=change[1:])
    change[firsts] = True
    seg = np.flatnonzero(change)
    del change
    seg_len = np.diff(seg, append=klass.size)
    seg_block = np.searchsorted(firsts, seg, side="right") - 1
    key = seg_block * width + klass[seg]
    if key.size < 2 or (key[1:] > key[:-1]).all():  # labels in runs: no sort
        return seg_block, key - seg_block * width, seg_len
    if lengths.size * width <= _DENSE_ENTRIES:
        dense = np.bincount(key, seg_len, minlength=lengths.size * width)
        keys = np.flatnonzero(dense)
        counts = dense[keys].astype(np.int64)
    else:
        keys, inverse = np.unique(key, return_inverse=True)
        counts = np.bincount(inverse, seg_len).astype(np.int64)
    return keys // width, keys % width, counts


def _dense(width: int, longest: int) -> bool:
    return width * width <= _DENSE_COST * max(1, longest)


def _piece_counts(klass: np.ndarray, n: np.ndarray, width: int, dense: bool):
    """The piece's blocks x classes counts: dense float64, or sparse CSR."""
    if dense:
        block = np.repeat(np.arange(n.size), n)
        counts = np.bincount(block * width + klass, minlength=n.size * width)
        return counts.reshape(n.size, width).astype(np.float64)
    import scipy.sparse as sp  # here: workers never import scipy

    block, klass, count = _piece_entries(klass, n, width)  # sorted, unique
    values = count.astype(np.float64)
    return sp.csr_matrix((values, (block, klass)), shape=(n.size, width))


def pairs(codes, ranges, num_blocks: int, longest: int, width: int) -> Pairs:
    """Class counts and `M` of the blocks, in one pass."""
    from threadpoolctl import threadpool_limits  # here: workers never need it

    # One BLAS thread: products of width x width over a piece gain nothing
    # from more, and OpenBLAS's idle threads spin (at 100M cells on 2 busy
    # cores: 20 CPU-s with its default threads, 3 with one).
    with threadpool_limits(limits=1, user_api="blas"):
        dense = _dense(width, longest)
        counts = np.zeros(width, np.int64)
        by_length: dict[int, np.ndarray] = {}
        for _, klass, n in pieces(codes, ranges, num_blocks, longest, width):
            counts += np.bincount(klass, minlength=width)
            table = _piece_counts(klass, n, width, dense)
            lengths = np.unique(n)
            for length in lengths.tolist():
                rows = table if lengths.size == 1 else table[n == length]
                product = rows.T @ rows
                if not dense:
                    product = product.toarray()
                by_length[length] = by_length.get(length, 0) + product
    matrix = np.zeros((width, width))
    for length in sorted(by_length):
        matrix += by_length[length] / length
    return Pairs(counts.astype(np.float64), matrix)


def block_sums(
    codes, ranges, num_blocks: int, longest: int, multiplier: np.ndarray
) -> np.ndarray:
    """Per block: `sum_k multiplier[k] * c_bk / n_b` (float64, one per block)."""
    width = multiplier.size
    dense = _dense(width, longest)
    out = np.empty(num_blocks)
    for a, klass, n in pieces(codes, ranges, num_blocks, longest, width):
        if dense:
            columns = np.ascontiguousarray(_piece_counts(klass, n, width, True).T)
            sums = np.zeros(n.size)
            for k in np.flatnonzero(multiplier):
                sums += multiplier[k] * columns[k]
        else:  # entries in (block, class) order, as np.bincount adds them
            block, klass, count = _piece_entries(klass, n, width)
            sums = np.bincount(block, multiplier[klass] * count, minlength=n.size)
        out[a : a + n.size] = sums / n
    return out

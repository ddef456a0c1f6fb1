"""How many cells of each class each block holds, and the sums over it.

Sparse entries `(block, class, count)` sorted by block, then class; class
index 0 is a missing label (code -1), index `c + 1` code `c`.

Design notes: docs/reference/design.md#blocks-composition.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from grain_cells._util.ranges import expand_ranges

_CHUNK_CELLS = 1 << 20  # cells of a part
_BUILD_CELLS = 1 << 18  # cells counted at a time (transients: ~40 bytes each)
_DENSE_ENTRIES = 1 << 23  # blocks x classes counted densely per part, at most


class Part(NamedTuple):
    """Entries of blocks `[first, first + lengths.size)`."""

    first: int
    block: np.ndarray  # local to the part: uint16 up to 65,536 blocks, else 32 bits
    klass: np.ndarray
    count: np.ndarray
    lengths: np.ndarray  # cells per block of the part, float64


class Composition(NamedTuple):
    """The block x class count table of a source's blocks over one column."""

    parts: list[Part]
    width: int
    num_blocks: int
    categories: np.ndarray

    @property
    def num_entries(self) -> int:
        """Entries (block, class) with at least one cell."""
        return sum(p.block.size for p in self.parts)

    def class_counts(self) -> np.ndarray:
        """Cells per class index, float64."""
        return self.class_sums(None)

    def block_sums(self, multiplier: np.ndarray) -> np.ndarray:
        """Per block: the sum over its entries of `multiplier[class] * count`,
        divided by the block's cells (float64, one per block).
        """  # noqa: D205
        out = np.empty(self.num_blocks)
        for p in self.parts:
            sums = np.bincount(p.block, multiplier[p.klass] * p.count)
            out[p.first : p.first + p.lengths.size] = sums / p.lengths
        return out

    def class_sums(self, block_weights: np.ndarray | None) -> np.ndarray:
        """Per class index: the sum over entries of `weights[block] * count`
        (`count` alone for None), in entry order.
        """  # noqa: D205
        total = np.zeros(self.width)
        head = np.arange(self.width)
        for p in self.parts:
            if block_weights is None:
                values = p.count.astype(np.float64)
            else:
                local = block_weights[p.first : p.first + p.lengths.size]
                values = local[p.block] * p.count
            total = np.bincount(
                np.concatenate([head, p.klass]),
                np.concatenate([total, values]),
                minlength=self.width,
            )
        return total


def composition(
    codes: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    categories: np.ndarray,
) -> Composition:
    """The count table of blocks `[starts[k], stops[k])` over `codes` (-1: missing)."""
    longest = max(1, int((stops - starts).max(initial=1)))
    return table_composition(
        codes, lambda a, b: (starts[a:b], stops[a:b]), starts.size, longest, categories
    )


def table_composition(
    codes: np.ndarray, ranges, num_blocks: int, longest: int, categories: np.ndarray
) -> Composition:
    """The count table of `num_blocks` blocks whose rows `ranges(a, b)` gives.

    Blocks are expanded a piece at a time; `longest` is the most cells in one.
    """
    width = len(categories) + 1
    count_type = np.min_scalar_type(longest)
    class_type = np.min_scalar_type(width)
    step = max(1, _BUILD_CELLS // longest)
    parts, pending, cells = [], [], 0
    for a in range(0, num_blocks, step):  # built in small pieces
        b = min(num_blocks, a + step)
        starts, stops = ranges(a, b)
        n = stops - starts
        total = int(n.sum())
        if stops[-1] - starts[0] == total:  # contiguous
            c = codes[starts[0] : stops[-1]]
        else:
            c = codes[expand_ranges(starts, n)]
        block, klass, count = _part_entries(c, n, width)
        first = pending[0][0] if pending else a
        pending.append(
            (
                a,
                (block + (a - first)).astype(np.int32),
                klass.astype(class_type),
                count.astype(count_type),
                n.astype(np.float64),
            )
        )
        cells += total
        if cells >= _CHUNK_CELLS or b == num_blocks:  # joined into parts
            block, klass, count, lengths = (
                np.concatenate([p[i] for p in pending]) for i in (1, 2, 3, 4)
            )
            parts.append(
                Part(
                    first,
                    block.astype(np.min_scalar_type(b - first)),
                    klass,
                    count,
                    lengths,
                )
            )
            pending, cells = [], 0
    return Composition(parts, width, int(num_blocks), categories)


def _part_entries(codes: np.ndarray, lengths: np.ndarray, width: int):
    """`(block, class, count)` of one part's cells, sorted by block, class."""
    firsts = np.cumsum(lengths) - lengths
    change = np.empty(codes.size, bool)
    change[0] = True
    np.not_equal(codes[1:], codes[:-1], out=change[1:])
    change[firsts] = True
    seg = np.flatnonzero(change)
    del change
    seg_len = np.diff(seg, append=codes.size)
    seg_block = np.searchsorted(firsts, seg, side="right") - 1
    key = seg_block * width + (codes[seg].astype(np.int64) + 1)
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


__all__ = ["Composition", "Part", "composition", "table_composition"]

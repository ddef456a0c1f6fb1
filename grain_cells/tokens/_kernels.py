"""Vectorised (NumPy) kernels of the token outputs: per-row sorts and bins.

Design notes: docs/reference/design.md#tokens-kernels.
"""

from __future__ import annotations

import sys

import numpy as np

from grain_cells._util import counter_rng
from grain_cells._util.ranges import expand_ranges

_U32_MAX = np.uint32(0xFFFFFFFF)
_SHIFT = np.uint64(32)
MAX_CELLS_PER_CHUNK_VALUES = 1 << 23  # keys per 2-D sort (64 MB)


def inverted(values: np.ndarray) -> np.ndarray:
    """uint32 complements of float32 bit patterns: descending for positives."""
    return ~np.ascontiguousarray(values, np.float32).view(np.uint32)


def key_values(keys: np.ndarray) -> np.ndarray:
    """The float32 values back from keys (`inverted` in the high word)."""
    return (~(keys >> _SHIFT).astype(np.uint32)).view(np.float32)


def key_tokens(keys: np.ndarray, width: int) -> np.ndarray:
    """The int32 tokens (low words) of the first `width` columns of keys."""
    return keys[:, :width].view(np.uint32)[:, 0::2].view(np.int32)


def sorted_rows(lengths, keep, inv, tokens, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """`(sorted keys [n_rows, width], n_kept)`: each row's kept `(inv, token)` keys.

    `keep` None: all. Past `n_kept` a row holds the sentinel `(2**32 - 1, pad)`.
    """
    n_rows = lengths.size
    width = max(1, int(lengths.max(initial=0)))
    sentinel = (np.uint64(0xFFFFFFFF) << _SHIFT) | np.uint64(pad)
    out = np.full((n_rows, width), sentinel, np.uint64)
    if keep is not None:
        inv = np.where(keep, inv, _U32_MAX)
        tokens = np.where(keep, tokens, pad)
    inside = np.arange(width)[None, :] < lengths[:, None]
    if sys.byteorder == "little":
        halves = out.view(np.uint32).reshape(n_rows, width, 2)
        halves[:, :, 0][inside] = tokens
        halves[:, :, 1][inside] = inv
    else:
        out[inside] = (inv.astype(np.uint64) << _SHIFT) | tokens.astype(np.uint64)
    out.sort(axis=1)
    if keep is None:
        return out, lengths
    kept = np.zeros(keep.size + 1, np.int64)
    np.cumsum(keep, out=kept[1:])
    ends = np.cumsum(lengths)
    return out, kept[ends] - kept[ends - lengths]


def length_chunks(indptr: np.ndarray, rows_per_chunk: int = 128):
    """Yields `(rows, value positions)`: chunks of rows of similar length (bounded)."""
    lengths = np.diff(indptr)
    order = np.argsort(lengths, kind="stable")
    a = 0
    while a < order.size:
        longest = int(lengths[order[min(order.size, a + rows_per_chunk) - 1]])
        step = min(rows_per_chunk, MAX_CELLS_PER_CHUNK_VALUES // max(1, longest))
        rows = order[a : a + max(1, step)]
        yield rows, expand_ranges(indptr[rows], lengths[rows])
        a += rows.size


def bins_of_sorted(
    keys: np.ndarray, n_kept: np.ndarray, n_bins: int, pad_value: int = 0
) -> np.ndarray:
    """int32 bins (scGPT's) of rows sorted by value descending, `pad_value` after.

    Bit for bit `np.digitize(x, np.quantile(values, np.linspace(0, 1, n_bins - 1)))`.
    """
    n_rows, width = keys.shape
    nz = np.flatnonzero(n_kept)
    if nz.size == 0:
        return np.full((n_rows, width), pad_value, np.int32)
    q = np.linspace(0, 1, n_bins - 1)
    n = n_kept[nz][:, None]
    virtual = (n - 1) * q[None, :]
    prev = np.floor(virtual)
    gamma = virtual - prev
    prev = prev.astype(np.int64)
    above = virtual >= n - 1
    prev = np.where(above, n - 1, prev)
    nxt = np.where(above, prev, np.minimum(prev + 1, n - 1))
    # Ascending index j of a row is descending column n - 1 - j.
    rows = nz[:, None]
    a = key_values(keys[rows, n - 1 - prev])
    b = key_values(keys[rows, n - 1 - nxt])
    diff = b - a  # float32, as NumPy computes it
    d64 = diff.astype(np.float64)
    edges = a.astype(np.float64) + d64 * gamma
    hi = gamma >= 0.5
    edges[hi] = (b.astype(np.float64) - d64 * (1 - gamma))[hi]
    # x >= e  <=>  x >= c, c the smallest float32 >= e.
    c = edges.astype(np.float32)
    up = c.astype(np.float64) < edges
    c[up] = np.nextafter(c[up], np.float32(np.inf))
    # end_k: a row's first column whose value is below c_k, found by one binary
    # search over all rows (order words with the row number above them).
    flat = keys >> _SHIFT
    flat |= np.arange(n_rows, dtype=np.uint64)[:, None] << _SHIFT
    cut = inverted(c).astype(np.uint64) | (nz.astype(np.uint64)[:, None] << _SHIFT)
    ends = np.searchsorted(flat.reshape(-1), cut.reshape(-1), side="right")
    ends = ends.reshape(cut.shape) - rows * width
    # Columns [0, end_{B-2}) get bin B - 1, [end_{B-2}, end_{B-3}) B - 2, ...,
    # [end_0 = n, width) the padding.
    bounds = np.pad(ends[:, ::-1], ((0, 0), (1, 1)), constant_values=(0, width))
    runs = np.diff(bounds, axis=1).reshape(-1)
    steps = np.arange(n_bins - 1, -1, -1, dtype=np.int32)
    steps[-1] = pad_value
    levels = np.tile(steps, nz.size)
    filled = np.repeat(levels, runs).reshape(nz.size, width)
    if nz.size == n_rows:
        return filled
    bins = np.full((n_rows, width), pad_value, np.int32)
    bins[nz] = filled
    return bins


def zero_genes(key, row_ids, need, vocab_tokens, expressed, stream_offset: int):
    """`(rows, tokens)`: sampled non-expressed genes per row, in stream order.

    Row `i` gets the first `need[i]` distinct tokens of
    `vocab_tokens[hash64(key, row_ids[i], stream_offset + j) % len]`, j = 0, 1, ...,
    not in its `expressed` set (sorted `row * 2**32 + token`).
    """
    got_r, got_t = [], []
    todo = np.flatnonzero(need > 0)
    drawn, span = 0, max(16, 2 * int(need.max(initial=0)))
    rr = tt = np.zeros(0, np.int64)
    while todo.size:  # draws of the rows still short, spans doubling
        j = np.uint64(stream_offset) + np.arange(drawn, drawn + span, dtype=np.uint64)
        rows = row_ids[todo].astype(np.uint64)[:, None]
        h = counter_rng.hash64(np.uint64(key), rows, j[None, :])
        got_r.append(np.repeat(todo, span))
        pick = (h % np.uint64(vocab_tokens.size)).astype(np.int64).reshape(-1)
        got_t.append(vocab_tokens[pick])
        drawn, span = drawn + span, span * 2
        rr = np.concatenate(got_r)
        order = np.argsort(rr, kind="stable")  # rows ascending, draws in order
        rr = rr[order]
        tt = np.concatenate(got_t).astype(np.int64)[order]
        pair = rr * (1 << 32) + tt
        pos = np.searchsorted(expressed, pair)
        new = pos >= expressed.size
        new[~new] = expressed[pos[~new]] != pair[~new]
        _, first = np.unique(pair[new], return_index=True)
        first.sort()
        rr, tt = rr[new][first], tt[new][first]
        todo = np.flatnonzero(np.bincount(rr, minlength=need.size) < need)
    starts = np.searchsorted(rr, np.arange(need.size))
    sel = np.arange(rr.size) - starts[rr] < need[rr]
    return rr[sel], tt[sel]

"""Vectorised kernels behind `grain_cells.tokens`: per-row sorts and bins.

The fetch's CSR values are laid out as a 2-D array, one row per cell (padded
with a sentinel to the longest row), of 64-bit keys `(order bits << tb) |
token`, and sorted along rows with one `np.sort(axis=1)` call: rows are
short enough to sort in cache, which is several times faster than sorting
all values at once with the row in the key, and no argsort or gather is
needed since the token travels in the key. Floats are compared through
their IEEE-754 bit patterns: for positive float32 values the bits, read as
an unsigned integer, order like the values.
"""

from __future__ import annotations

import numpy as np

from grain_cells import counter_rng

_U32_MAX = np.uint64(0xFFFFFFFF)
MAX_CELLS_PER_CHUNK_VALUES = 1 << 23  # keys per 2-D sort (64 MB)


def float_bits(values: np.ndarray) -> np.ndarray:
    """uint64 of float32 bit patterns (ordered like positive values)."""
    return np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)


def desc_keys(values: np.ndarray, tokens: np.ndarray, token_bits: int) -> np.ndarray:
    """Keys ordering by value descending, then token ascending."""
    inv = ~np.ascontiguousarray(values, np.float32).view(np.uint32)
    keys = inv.astype(np.uint64)
    keys <<= np.uint64(token_bits)
    keys |= tokens.astype(np.uint64)
    return keys


def key_values(keys: np.ndarray, token_bits: int) -> np.ndarray:
    """The float32 values back from `desc_keys`."""
    bits = (_U32_MAX - (keys >> np.uint64(token_bits))).astype(np.uint32)
    return bits.view(np.float32)


def sorted_rows(
    indptr: np.ndarray, keep: np.ndarray | None, keys: np.ndarray, key_bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's kept keys, sorted ascending, in a 2-D array.

    Args:
        indptr: CSR row pointers of the rows.
        keep: Which stored values take part (None: all).
        keys: One key per stored value, below `2**key_bits - 1`.
        key_bits: Bits of a key; the sentinel is `2**key_bits - 1`.

    Returns:
        `(sorted_keys [n_rows, width], n_kept [n_rows])`: row `i` holds its
        `n_kept[i]` keys first, then sentinels.
    """
    lengths = np.diff(indptr)
    n_rows = lengths.size
    width = max(1, int(lengths.max(initial=0)))
    sentinel = np.uint64((1 << key_bits) - 1)
    out = np.full((n_rows, width), sentinel, np.uint64)
    pos = np.arange(keys.size, dtype=np.int64)
    pos += np.repeat(np.arange(n_rows, dtype=np.int64) * width - indptr[:-1], lengths)
    out.reshape(-1)[pos] = keys if keep is None else np.where(keep, keys, sentinel)
    out.sort(axis=1)
    if keep is None:
        return out, lengths
    kept = np.zeros(keys.size + 1, np.int64)
    np.cumsum(keep, out=kept[1:])
    return out, kept[indptr[1:]] - kept[indptr[:-1]]


def row_chunks(indptr: np.ndarray) -> list[tuple[int, int]]:
    """Row ranges whose padded 2-D layout stays under the size cap."""
    lengths = np.diff(indptr)
    n = lengths.size
    width = max(1, int(lengths.max(initial=0)))
    step = max(1, MAX_CELLS_PER_CHUNK_VALUES // width)
    return [(a, min(n, a + step)) for a in range(0, max(n, 1), step)]


def bins_of_sorted(
    keys: np.ndarray, n_kept: np.ndarray, token_bits: int, n_bins: int
) -> np.ndarray:
    """Bins (scGPT's) of rows sorted by value descending (`desc_keys`).

    Edges per row are `np.quantile(values, np.linspace(0, 1, n_bins - 1))`
    with NumPy's linear interpolation reproduced bit for bit (its `_lerp`,
    with the difference taken in float32), and a value's bin is
    `np.digitize(value, edges)`: the number of edges <= value.

    Args:
        keys: `[n_rows, width]` sorted keys from `sorted_rows`. Modified in
            place: the row number is written above the key's bits (the
            token bits stay as they were).
        n_kept: Kept values per row.
        token_bits: Bits of the token in a key.
        n_bins: Bins `B`.

    Returns:
        int32 `[n_rows, width]` bins (0 past each row's kept values).
    """
    n_rows, width = keys.shape
    nz = np.flatnonzero(n_kept)
    if nz.size == 0:
        return np.zeros((n_rows, width), np.int32)
    key_bits = 32 + token_bits
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
    low = np.uint64((1 << key_bits) - 1)
    a = key_values(keys[rows, n - 1 - prev] & low, token_bits)
    b = key_values(keys[rows, n - 1 - nxt] & low, token_bits)
    diff = b - a  # float32, as NumPy computes it
    d64 = diff.astype(np.float64)
    edges = a.astype(np.float64) + d64 * gamma
    hi = gamma >= 0.5
    edges[hi] = (b.astype(np.float64) - d64 * (1 - gamma))[hi]
    # x >= e  <=>  x >= c, c the smallest float32 >= e (x is a float32).
    c = edges.astype(np.float32)
    up = c.astype(np.float64) < edges
    c[up] = np.nextafter(c[up], np.float32(np.inf))
    # A row's values sit at columns [0, n), descending; the value at column p
    # counts edge k when p < end_k, the first column whose value is below
    # c_k. Find every end_k by one binary search over all rows, their row
    # number written above the keys so that the rows sort one after another.
    cut = (np.uint64(0xFFFFFFFF) - float_bits(c)) << np.uint64(token_bits)
    cut |= np.uint64((1 << token_bits) - 1)
    row_bits = max(1, int(n_rows - 1).bit_length())
    if row_bits + key_bits <= 64:
        shift = np.uint64(key_bits)
        keys |= np.arange(n_rows, dtype=np.uint64)[:, None] << shift
        cut |= nz.astype(np.uint64)[:, None] << shift
        ends = np.searchsorted(keys.reshape(-1), cut.reshape(-1), side="right")
        ends = ends.reshape(cut.shape) - rows * width
    else:  # too many rows for one key: search row by row of the chunk
        ends = np.stack(
            [np.searchsorted(keys[i], cut[k], side="right") for k, i in enumerate(nz)]
        )
    # Ends shrink as k grows (edges grow, values descend): columns
    # [0, end_{B-2}) get bin B - 1, [end_{B-2}, end_{B-3}) B - 2, ...,
    # [end_0, width) 0 (the padding past n included).
    bounds = np.concatenate(
        [
            np.zeros((nz.size, 1), np.int64),
            ends[:, ::-1],
            np.full((nz.size, 1), width),
        ],
        axis=1,
    )
    runs = np.diff(bounds, axis=1).reshape(-1)
    levels = np.tile(np.arange(n_bins - 1, -1, -1, dtype=np.int32), nz.size)
    filled = np.repeat(levels, runs).reshape(nz.size, width)
    if nz.size == n_rows:
        return filled
    bins = np.zeros((n_rows, width), np.int32)
    bins[nz] = filled
    return bins


def zero_genes(
    key: int,
    row_ids: np.ndarray,
    need: np.ndarray,
    vocab_tokens: np.ndarray,
    expressed: np.ndarray,
    stream_offset: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Sampled non-expressed genes per row, without replacement.

    Row `i` gets the first `need[i]` distinct tokens of the stream
    `vocab_tokens[hash64(key, row_ids[i], stream_offset + j) % len]`,
    j = 0, 1, ..., that are not in its expressed set (rejection sampling).

    Args:
        key: The fetch key.
        row_ids: Global row id per row.
        need: Genes wanted per row (at most the non-expressed vocabulary).
        vocab_tokens: Token ids to draw from.
        expressed: Sorted `row * 2**32 + token` of each row's expressed genes.
        stream_offset: Counter offset of this stream.

    Returns:
        `(rows, tokens)`: rows ascending, each row's genes in stream order.
    """
    n_vocab = vocab_tokens.size
    got_r, got_t = [], []
    todo = np.flatnonzero(need > 0)
    first = 0
    span = max(16, 2 * int(need.max(initial=0)))
    have = np.zeros(need.size, np.int64)
    while todo.size:
        j = np.arange(first, first + span, dtype=np.uint64)
        h = counter_rng.hash64(
            np.uint64(key),
            row_ids[todo].astype(np.uint64)[:, None],
            np.uint64(stream_offset) + j[None, :],
        )
        got_r.append(np.repeat(todo, span))
        got_t.append(
            vocab_tokens[(h % np.uint64(n_vocab)).astype(np.int64)].reshape(-1)
        )
        first += span
        span *= 2
        pair = _distinct_new(got_r, got_t, expressed)[2]
        have = np.bincount(pair >> 32, minlength=need.size)
        todo = np.flatnonzero(have < need)
    if not got_r:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    rr, tt, _ = _distinct_new(got_r, got_t, expressed)
    starts = np.searchsorted(rr, np.arange(need.size))
    rank = np.arange(rr.size) - starts[rr]
    sel = rank < need[rr]
    return rr[sel], tt[sel]


def _distinct_new(got_r, got_t, expressed):
    """First occurrences of not-expressed (row, token) pairs, stream order."""
    rr = np.concatenate(got_r)
    tt = np.concatenate(got_t).astype(np.int64)
    order = np.argsort(rr, kind="stable")  # rows ascending, draws in order
    rr, tt = rr[order], tt[order]
    pair = rr * (1 << 32) + tt
    pos = np.searchsorted(expressed, pair)
    hit = pos < expressed.size
    hit[hit] = expressed[pos[hit]] == pair[hit]
    rr, tt, pair = rr[~hit], tt[~hit], pair[~hit]
    _, first = np.unique(pair, return_index=True)
    first.sort()
    return rr[first], tt[first], pair[first]

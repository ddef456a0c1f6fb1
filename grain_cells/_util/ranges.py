"""Row ranges `[start, stop)` and runs of consecutive ids: vectorised, int64."""

from __future__ import annotations

import numpy as np


def expand_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every id of ranges `[starts[i], starts[i] + lengths[i])`, in order (int64)."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    out = np.arange(int(lengths.sum()), dtype=np.int64)
    out += np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return out


def runs(sorted_ids: np.ndarray, cuts: np.ndarray | None = None):
    """`(starts, stops)` of runs of consecutive sorted ids, also cut at `cuts`."""
    ids = np.asarray(sorted_ids, np.int64).reshape(-1)
    if ids.size == 0:
        return ids.copy(), ids.copy()
    new_run = np.diff(ids) != 1
    if cuts is not None:
        new_run |= np.isin(ids[1:], cuts)
    breaks = np.flatnonzero(new_run) + 1
    starts = ids[np.concatenate([[0], breaks])]
    stops = ids[np.concatenate([breaks - 1, [ids.size - 1]])] + 1
    return starts, stops


def merge_touching(starts, stops) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint ranges (int64), merged where one stops at the next's start."""
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    if starts.size <= 1:
        return starts, stops
    breaks = np.flatnonzero(starts[1:] != stops[:-1]) + 1
    first = np.concatenate([[0], breaks])
    last = np.concatenate([breaks - 1, [starts.size - 1]])
    return starts[first], stops[last]


def nonempty(starts, stops) -> tuple[np.ndarray, np.ndarray]:
    """Ranges `[starts[i], stops[i])` as int64 arrays, without the empty ones."""
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    keep = stops > starts
    if not keep.all():
        starts, stops = starts[keep], stops[keep]
    return starts, stops


def chunk_pieces(starts, stops, chunk_len: int):
    """`(chunk, start, stop)` of non-empty ranges cut at multiples of `chunk_len`."""
    starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
    first = starts // chunk_len
    n_pieces = (stops - 1) // chunk_len - first + 1
    if int(n_pieces.sum()) == starts.size:  # no range crosses a chunk boundary
        return first, starts, stops
    chunk = expand_ranges(first, n_pieces)
    start = np.maximum(np.repeat(starts, n_pieces), chunk * chunk_len)
    stop = np.minimum(np.repeat(stops, n_pieces), (chunk + 1) * chunk_len)
    return chunk, start, stop


def chunks_touched(starts: np.ndarray, stops: np.ndarray, chunk_len: int) -> np.ndarray:
    """Sorted unique indices of the `chunk_len`-row chunks non-empty ranges touch."""
    first = np.asarray(starts, np.int64) // chunk_len
    last = (np.asarray(stops, np.int64) - 1) // chunk_len
    return np.unique(expand_ranges(first, last - first + 1))

"""Row ranges `[start, stop)` and runs of consecutive ids: vectorised, int64.

Design notes: docs/reference/design.md#util-ranges.
"""

from __future__ import annotations

import numpy as np


def expand_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every id of ranges `[starts[i], starts[i] + lengths[i])`, range after range.

    Args:
        starts: First id of each range.
        lengths: Non-negative length of each range.

    Returns:
        An int64 array of `lengths.sum()` ids.
    """
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    out = np.arange(total, dtype=np.int64)
    out += np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return out


def runs(
    sorted_ids: np.ndarray, cuts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive ids in sorted, distinct ids, as ranges.

    Args:
        sorted_ids: Sorted distinct integer ids.
        cuts: Optional ids where a run must start even if the previous id
            precedes it by one (file boundaries, chunk starts).

    Returns:
        `(starts, stops)`: one `[start, stop)` per run, in order.
    """
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


def merge_touching(
    starts: np.ndarray, stops: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Merges sorted, disjoint ranges where one stops at the next one's start.

    Args:
        starts: Range starts, sorted.
        stops: Matching exclusive ends; ranges do not overlap.

    Returns:
        `(starts, stops)` of the merged ranges (the inputs when at most one).
    """
    if starts.size <= 1:
        return starts, stops
    breaks = np.flatnonzero(starts[1:] != stops[:-1]) + 1
    first = np.concatenate([[0], breaks])
    last = np.concatenate([breaks - 1, [starts.size - 1]])
    return starts[first], stops[last]


def nonempty(starts, stops) -> tuple[np.ndarray, np.ndarray]:
    """Ranges `[starts[i], stops[i])` as int64 arrays, without the empty ones."""
    starts = np.asarray(starts, np.int64)
    stops = np.asarray(stops, np.int64)
    keep = stops > starts
    if not keep.all():
        starts, stops = starts[keep], stops[keep]
    return starts, stops


def chunks_touched(starts: np.ndarray, stops: np.ndarray, chunk_len: int) -> np.ndarray:
    """Sorted unique indices of the `chunk_len`-row chunks non-empty ranges touch."""
    first = np.asarray(starts, np.int64) // chunk_len
    last = (np.asarray(stops, np.int64) - 1) // chunk_len
    return np.unique(expand_ranges(first, last - first + 1))


__all__ = ["chunks_touched", "expand_ranges", "merge_touching", "nonempty", "runs"]

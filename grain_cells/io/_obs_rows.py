"""A fetch's obs values: a file's in-memory columns stacked, one slice per file.

A collection's fetch touches ~60 files; slicing each of them once per column
cost more than its reads. Design notes: docs/reference/design.md#io-obs-rows.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from grain_cells._util.ranges import expand_ranges

_KEYS: dict = {}  # one object per layout: files compare by identity
_KEY = operator.attrgetter("key")


class StackedObs(dict):
    """Obs columns by name, row views of one `(columns, cells)` array per dtype."""

    groups: tuple  # ((names, array), ...)
    key: tuple  # ((dtype, names), ...), interned
    # Its views and blocks beyond the values (~0.9 KB with tracemalloc, 4 columns).
    OVERHEAD_BYTES = 1024

    def __reduce__(self):  # a copy stacks copies of the values again
        return stacked, ({n: v.copy() for n, v in self.items()},)


def stacked(obs: dict) -> dict:
    """`obs` with its columns stacked, or as given (mapped, broadcast or stacked)."""
    if isinstance(obs, StackedObs) or not obs:
        return obs
    if not all(type(v) is np.ndarray and v.base is None for v in obs.values()):
        return obs  # a shared map or a missing column's broadcast: not copied
    by_dtype: dict = {}
    for name, values in obs.items():
        by_dtype.setdefault(values.dtype, []).append(name)
    groups = tuple(
        (tuple(names), np.stack([obs[n] for n in names])) for names in by_dtype.values()
    )
    out = StackedObs()
    views = {n: block[j] for names, block in groups for j, n in enumerate(names)}
    out.update((n, views[n]) for n in obs)
    key = tuple((block.dtype, names) for names, block in groups)
    out.groups, out.key = groups, _KEYS.setdefault(key, key)
    return out


def obs_rows(names, file_obs, group, starts, stops) -> dict[str, np.ndarray]:
    """Each obs column's value for every fetched row (range j: file `group[j]`)."""
    if not names:
        return {}
    try:  # one stacked layout: its key is one object
        same = len(set(map(id, map(_KEY, file_obs)))) == 1
    except AttributeError:  # a file's columns are not stacked
        same = False
    if not same:
        return _by_column(names, file_obs, group, starts, stops)
    out = {}
    for j, (_, block_names) in enumerate(file_obs[0].key):
        blocks = [o.groups[j][1] for o in file_obs]
        rows = _rows(blocks, group, starts, stops)
        out.update(zip(block_names, rows, strict=True))
    return {n: out[n] for n in names}


def _by_column(names, file_obs, group, starts, stops) -> dict[str, np.ndarray]:
    out = {}
    for c in names:
        out[c] = _rows([obs[c] for obs in file_obs], group, starts, stops)
    return out


def _rows(arrays: list, group, starts, stops) -> np.ndarray:
    """Rows (last axis) of `arrays[group[j]]` in ranges j, in order.

    A range or two per file: a slice each (4x cheaper at 63 files than a gather).
    """
    if group.size <= 2 * len(arrays):
        g, a, b = group.tolist(), starts.tolist(), stops.tolist()
        parts = [arrays[k][..., s:e] for k, s, e in zip(g, a, b, strict=True)]
        if not parts:
            return arrays[0][..., :0].copy()
        return np.concatenate(parts, axis=-1)
    local = expand_ranges(starts, stops - starts)
    ends = np.cumsum(np.bincount(group, stops - starts, len(arrays))).astype(int)
    bounds = itertools.pairwise([0, *ends.tolist()])
    parts = [x[..., local[a:b]] for x, (a, b) in zip(arrays, bounds, strict=True)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

"""A fetch's obs values: a file's in-memory columns stacked, one slice per file.

A collection's fetch touches ~60 files; slicing each of them once per column
cost more than its reads. Design notes: docs/reference/design.md#io-obs-rows.
"""

from __future__ import annotations

import collections.abc
import itertools
import operator

import numpy as np

from grain_cells._util.ranges import expand_ranges

_LAYOUTS: dict = {}  # one (key, places) per layout: files compare by identity
_KEY = operator.attrgetter("key")


class StackedObs(collections.abc.Mapping):
    """Obs columns by name: rows of one `(columns, cells)` array per dtype.

    Lighter than a dict of arrays (no array per column is kept), so a record
    counts only its values.
    """

    __slots__ = ("_places", "groups", "key")

    def __init__(self, groups: tuple, layout: tuple):
        self.groups = groups  # a `(columns, cells)` array per dtype
        self.key, self._places = layout  # key: ((dtype, names), ...)

    def __getitem__(self, name: str) -> np.ndarray:
        group, row = self._places[name]
        return self.groups[group][row]

    def __iter__(self):
        return iter(self._places)

    def __len__(self) -> int:
        return len(self._places)

    def __reduce__(self):  # a copy stacks copies of the values again
        return stacked, ({n: v.copy() for n, v in self.items()},)


def stacked(obs):
    """`obs` with its columns stacked, or as given (mapped, broadcast or stacked)."""
    if isinstance(obs, StackedObs) or not obs:
        return obs
    if not all(type(v) is np.ndarray and v.base is None for v in obs.values()):
        return obs  # a shared map or a missing column's broadcast: not copied
    by_dtype: dict = {}
    for name, values in obs.items():
        by_dtype.setdefault(values.dtype, []).append(name)
    names = list(by_dtype.values())
    key = (tuple(obs), tuple((d, tuple(n)) for d, n in by_dtype.items()))
    layout = _LAYOUTS.get(key)
    if layout is None:
        places = {n: (g, j) for g, ns in enumerate(names) for j, n in enumerate(ns)}
        layout = _LAYOUTS[key] = (key, {n: places[n] for n in obs})
    return StackedObs(tuple(np.stack([obs[n] for n in ns]) for ns in names), layout)


def obs_rows(names, file_obs, group, starts, stops) -> dict[str, np.ndarray]:
    """Each obs column's value for every fetched row (range j: file `group[j]`)."""
    if not names:
        return {}
    take = _taker(len(file_obs), group, starts, stops)
    try:  # one stacked layout: its key is one object
        same = len(set(map(id, map(_KEY, file_obs)))) == 1
    except AttributeError:  # a file's columns are not stacked
        same = False
    if not same:
        return {c: take([obs[c] for obs in file_obs]) for c in names}
    out = {}
    for j, (_, block_names) in enumerate(file_obs[0].key[1]):
        rows = take([o.groups[j] for o in file_obs])
        out.update(zip(block_names, rows, strict=True))
    return {n: out[n] for n in names}


def _taker(n_files: int, group, starts, stops):
    """A function of one array per file: its rows (last axis) in ranges j of
    file `group[j]`, in order; worked out once for every column of a fetch.

    A range or two per file: a slice each (4x cheaper at 63 files than a gather).
    """  # noqa: D205
    if group.size <= 2 * n_files:
        spans = list(map(slice, starts.tolist(), stops.tolist()))
        keys = list(zip(group.tolist(), spans, strict=True))

        def sliced(arrays: list) -> np.ndarray:
            parts = [arrays[k][..., s] for k, s in keys]
            if not parts:
                return arrays[0][..., :0].copy()
            return np.concatenate(parts, axis=-1)

        return sliced
    local = expand_ranges(starts, stops - starts)
    ends = np.cumsum(np.bincount(group, stops - starts, n_files)).astype(int)
    bounds = list(itertools.pairwise([0, *ends.tolist()]))

    def gathered(arrays: list) -> np.ndarray:
        parts = [x[..., local[a:b]] for x, (a, b) in zip(arrays, bounds, strict=True)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

    return gathered

"""A fetch's obs values from stacked columns equal those column by column."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from grain_cells.io._obs_rows import StackedObs, obs_rows, stacked


def _file(k: int, n: int) -> dict:
    """Columns whose values encode (file, row): codes of two widths and floats."""
    rows = np.arange(n)
    return {
        "plate": ((rows + k) % 7).astype(np.int8),
        "n": (1000 * k + rows).astype(np.float64),
        "donor": ((rows * 3 + k) % 300).astype(np.int16),
        "type": ((rows + 2 * k) % 5).astype(np.int8),
    }


def _expected(files, group, starts, stops):
    return {
        c: np.concatenate(
            [files[g][c][a:b] for g, a, b in zip(group, starts, stops, strict=True)]
        )
        for c in files[0]
    }


@pytest.mark.parametrize("ranges_per_file", [1, 5])
def test_stacked_rows_equal_each_column_sliced(ranges_per_file):
    rng = np.random.default_rng(ranges_per_file)
    plain = [_file(k, 200) for k in range(6)]
    obs = [stacked(dict(f)) for f in plain]
    assert all(isinstance(o, StackedObs) for o in obs)
    assert len({id(o.key) for o in obs}) == 1  # one layout: compared by identity
    group = np.repeat(np.arange(6), ranges_per_file)
    starts = np.concatenate(
        [np.sort(rng.choice(np.arange(0, 200, 20), ranges_per_file, False))] * 6
    )
    stops = starts + rng.integers(0, 20, starts.size)
    names = ("type", "n", "plate", "donor")
    got = obs_rows(names, obs, group, starts, stops)
    want = _expected(plain, group, starts, stops)
    assert list(got) == list(names)
    for c in names:
        assert got[c].dtype == want[c].dtype
        np.testing.assert_array_equal(got[c], want[c])
    # The same through the column-by-column path (a file not stacked).
    mixed = [*obs[:-1], plain[-1]]
    again = obs_rows(names, mixed, group, starts, stops)
    for c in names:
        np.testing.assert_array_equal(again[c], want[c])


def test_shared_or_broadcast_columns_are_not_copied():
    values = np.arange(10, dtype=np.int8)
    view = values[:]  # e.g. a map of the shared obs cache: not owned
    given = {"a": view}
    assert stacked(given) is given
    missing = np.broadcast_to(np.int8(-1), (10,))
    assert not isinstance(stacked({"a": values.copy(), "b": missing}), StackedObs)


def test_a_copy_is_stacked_on_its_own_values():
    obs = stacked(_file(1, 50))
    twin = copy.deepcopy(obs)
    assert isinstance(twin, StackedObs) and twin.key is obs.key
    twin["plate"][0] = 99  # the copy's values are its own
    assert obs["plate"][0] != 99
    for c in obs:
        np.testing.assert_array_equal(twin[c][1:], obs[c][1:])

"""`runs_of_mask` finds runs a window at a time: the same runs as one pass
over the whole mask, for any window size and file boundaries."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from grain_cells.source import _selection


def _whole(mask, cell_offsets):
    n = mask.size
    inner = np.asarray(cell_offsets[1:-1], np.int64)
    inner = inner[(inner > 0) & (inner < n)]
    begins = mask.copy()
    begins[1:] &= ~mask[:-1]
    begins[inner] = mask[inner]
    starts = np.flatnonzero(begins)
    begins[:] = mask
    begins[:-1] &= ~mask[1:]
    begins[inner - 1] = mask[inner - 1]
    return starts, np.flatnonzero(begins) + 1


@settings(max_examples=300, deadline=None)
@given(
    mask=st.lists(st.booleans(), min_size=1, max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=5),
    window=st.integers(1, 9),
)
def test_windows_give_the_runs_of_the_whole_mask(mask, cuts, window):
    mask = np.array(mask, bool)
    offsets = np.unique([0, mask.size, *(c for c in cuts if c <= mask.size)])
    old, _selection._RUN_WINDOW = _selection._RUN_WINDOW, window
    try:
        starts, stops = _selection.runs_of_mask(mask, offsets)
    finally:
        _selection._RUN_WINDOW = old
    want = _whole(mask, offsets)
    np.testing.assert_array_equal(starts, want[0])
    np.testing.assert_array_equal(stops, want[1])

"""Run-length block tables against listed blocks, on random small selections.

A view table stores runs of blocks (`grain_cells.source._table`); the
reference here lists every block as the tables did before (two int64
arrays) and derives ids, offsets, ranges and masks from the list.
"""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from listed_blocks import blocks_over_runs

from grain_cells.source import BlockTable, blocks_of_mask


def _reference(table: BlockTable, starts, stops) -> dict:
    digest = hashlib.sha256(starts.astype("<i8").tobytes())
    digest.update(stops.astype("<i8").tobytes())
    lengths = stops - starts
    mask = np.zeros(table.num_cells, bool)
    for a, b in zip(starts, stops, strict=True):
        mask[a:b] = True
    return {
        "blocks_id": f"{starts.size} blocks of {int(lengths.sum())} cells "
        f"sha256:{digest.hexdigest()[:16]}",
        "block_offsets": np.searchsorted(starts, table.cell_offsets, "left"),
        "mask": mask,
        "fragmented": table.block_size > 1
        and 2 * float(np.mean(lengths)) < (table.block_size),
    }


def _check(view: BlockTable, grid: BlockTable, starts, stops) -> None:
    want = _reference(grid, starts, stops)
    assert view.blocks_id == want["blocks_id"]
    np.testing.assert_array_equal(view.block_offsets, want["block_offsets"])
    np.testing.assert_array_equal(view.cell_mask(), want["mask"])
    assert view.fragmented == want["fragmented"]
    assert len(view) == starts.size
    assert view.num_selected_cells == int((stops - starts).sum())
    files, got_starts, got_stops = view.ranges(np.arange(len(view)))
    np.testing.assert_array_equal(got_starts, starts)
    np.testing.assert_array_equal(got_stops, stops)
    np.testing.assert_array_equal(
        files, np.searchsorted(grid.cell_offsets, starts, side="right") - 1
    )
    for k in {0, len(view) // 2, len(view) - 1}:
        block = view.block(k)
        assert (block.file, block.start, block.stop) == (
            files[k],
            starts[k],
            stops[k],
        )
    # Never more bytes than listing the blocks, and pickled without caches.
    stored = sum(
        a.nbytes
        for a in (view.run_starts, view.run_stops, view.run_blocks)
        if a is not None
    )
    assert stored <= 16 * starts.size
    again = pickle.loads(pickle.dumps(view))
    assert again.blocks_id == view.blocks_id
    np.testing.assert_array_equal(again.ranges(np.arange(len(view)))[1], starts)


@st.composite
def selections(draw):
    n_obs = draw(st.lists(st.integers(1, 60), min_size=1, max_size=4))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 16]))
    n = sum(n_obs)
    kind = draw(st.sampled_from(["runs", "random", "all"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "all":
        mask = np.ones(n, bool)
    elif kind == "random":
        mask = rng.random(n) < draw(st.sampled_from([0.2, 0.5, 0.9]))
    else:  # long runs with gaps
        mask = np.repeat(rng.random(n // 5 + 1) < 0.6, 5)[:n]
    if not mask.any():
        mask[rng.integers(n)] = True
    return n_obs, block_size, mask


@settings(max_examples=200, deadline=None)
@given(selections())
def test_runs_match_listed_blocks(case):
    n_obs, block_size, mask = case
    grid = BlockTable.grid(n_obs, block_size)
    starts, stops = blocks_over_runs(mask, grid.cell_offsets, block_size)
    from_runs = blocks_of_mask(grid, mask)
    from_blocks = grid.with_blocks(starts, stops)
    _check(from_runs, grid, starts, stops)
    _check(from_blocks, grid, starts, stops)
    # A view of a view: any sub-list of the blocks.
    keep = np.random.default_rng(len(starts)).random(starts.size) < 0.7
    keep[0] = True
    _check(grid.with_blocks(starts[keep], stops[keep]), grid, starts[keep], stops[keep])


def test_a_donor_split_is_a_few_runs():
    grid = BlockTable.grid([1_000_000, 2_000_003], 16)
    mask = np.ones(grid.num_cells, bool)
    mask[123_457:400_001] = False
    view = blocks_of_mask(grid, mask)
    assert view.run_starts.size == 3  # cut at the gap and at the file boundary
    assert len(pickle.dumps(view)) < 2_000
    starts, stops = blocks_over_runs(mask, grid.cell_offsets, 16)
    assert view.blocks_id == grid.with_blocks(starts, stops).blocks_id

"""Block tables as values, the ranges helper, and the source's parts."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import grain_cells
from grain_cells._util import ranges
from grain_cells.source import Block, BlockTable

FILE_SIZES = (97, 130, 61)  # conftest's files


def test_grid_blocks_match_vectorised_ranges():
    table = BlockTable.grid(FILE_SIZES, 16)
    assert len(table) == 7 + 9 + 4
    assert table.block(7) == Block(7, 1, 97, 113)
    assert table.block(6) == Block(6, 0, 96, 97)  # a file's short last block
    files, starts, stops = table.ranges(np.arange(len(table)))
    for k in range(len(table)):
        assert table.block(k) == Block(k, files[k], starts[k], stops[k])
    assert not table.is_view and table.blocks_id == ""
    assert table.num_selected_cells == table.num_cells == sum(FILE_SIZES)
    with pytest.raises(IndexError, match="block 20 out of range"):
        table.block(20)


def test_with_blocks_is_pure():
    table = BlockTable.grid(FILE_SIZES, 16)
    before = pickle.dumps(table)
    view = table.with_blocks([0, 20, 97], [5, 36, 100])
    assert pickle.dumps(table) == before  # the grid is unchanged
    assert view is not table and view.is_view
    assert len(view) == 3 and view.num_selected_cells == 5 + 16 + 3
    assert view.block(2) == Block(2, 1, 97, 100)
    np.testing.assert_array_equal(view.block_offsets, [0, 2, 3, 3])
    assert view.blocks_id.startswith("3 blocks of 24 cells sha256:")
    # Equal ranges give an equal id; a view of a view only needs the files.
    again = view.with_blocks([0, 20, 97], [5, 36, 100])
    assert again.blocks_id == view.blocks_id
    mask = view.cell_mask()
    assert mask.sum() == 24 and mask[20:36].all() and not mask[5:20].any()


@pytest.mark.parametrize(
    ("starts", "stops", "error", "match"),
    [
        pytest.param([0], [17], ValueError, "holds 1 to block_size=16", id="long"),
        pytest.param([5], [5], ValueError, "holds 1 to", id="empty"),
        pytest.param([0, 3], [5, 8], ValueError, "sorted and disjoint", id="overlap"),
        pytest.param([90], [100], ValueError, "straddles two files", id="straddle"),
        pytest.param([280], [290], ValueError, "the source has 288", id="outside"),
        pytest.param([0.0], [1.0], TypeError, "must be integers", id="floats"),
    ],
)
def test_with_blocks_rejects(starts, stops, error, match):
    with pytest.raises(error, match=match):
        BlockTable.grid(FILE_SIZES, 16).with_blocks(starts, stops)


def test_expand_ranges_and_runs_match_python():
    rng = np.random.default_rng(0)
    starts = np.sort(rng.choice(1000, 40, replace=False)) * 3
    lengths = rng.integers(0, 4, 40)
    want = [s + i for s, n in zip(starts, lengths, strict=True) for i in range(n)]
    got = ranges.expand_ranges(starts, lengths)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    ids = np.unique(got)
    run_starts, run_stops = ranges.runs(ids)
    np.testing.assert_array_equal(
        ranges.expand_ranges(run_starts, run_stops - run_starts), ids
    )
    assert (run_starts[1:] > run_stops[:-1]).all()  # maximal: a gap between runs
    cut_starts, _ = ranges.runs(np.arange(10, 20), cuts=np.array([15]))
    np.testing.assert_array_equal(cut_starts, [10, 15])
    empty = ranges.runs(np.zeros(0, np.int64))
    assert empty[0].size == empty[1].size == 0


def test_merge_touching():
    starts, stops = ranges.merge_touching(
        np.array([0, 5, 9, 12]), np.array([5, 7, 12, 13])
    )
    np.testing.assert_array_equal(starts, [0, 9])
    np.testing.assert_array_equal(stops, [7, 13])


def test_source_view_needs_a_table_of_its_files(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=16)
    other = grain_cells.AnnDataSource(csr_paths[:1], block_size=16)
    try:
        table = source.block_table.with_blocks([0], [12])
        view = source.view(table)
        assert view.block_table is table and len(view) == 1
        assert "blocks=" not in repr(source)  # the source is unchanged
        with pytest.raises(ValueError, match="build the table from"):
            other.view(table)
        # A view pickles without handles and reads in the new process's copy.
        view.read([1])
        clone = pickle.loads(pickle.dumps(view))
        assert repr(clone) == repr(view)
        np.testing.assert_array_equal(clone.read([1, 3]).row_ids, [1, 3])
        clone.close()
        view.close()
    finally:
        source.close()
        other.close()


def test_selection_and_splits_are_tables(csr_paths):
    from grain_cells.blocks import _splits as splits
    from grain_cells.source import _selection as selection

    source = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=["plate"])
    try:
        before = repr(source)
        table = selection.selected_blocks(source, where={"plate": ["plate1"]})
        assert repr(source) == before and table.num_selected_cells == 40
        np.testing.assert_array_equal(np.flatnonzero(table.cell_mask()), range(40, 80))
        view = source.select(where={"plate": ["plate1"]})
        assert view.blocks_id == table.blocks_id
        tables = splits.fraction_split_blocks(source, {"a": 0.5, "b": 0.5}, seed=3)
        views = grain_cells.split_by_fraction(source, {"a": 0.5, "b": 0.5}, seed=3)
        assert {k: t.blocks_id for k, t in tables.items()} == {
            k: v.blocks_id for k, v in views.items()
        }
        held = splits.obs_split_blocks(source, "plate", {"val": ["plate0"]})
        assert held["val"].num_selected_cells == 40
        assert held["train"].num_selected_cells == source.num_cells - 40
        for v in (view, *views.values()):
            v.close()
    finally:
        source.close()


def test_a_view_is_a_new_source_of_the_same_values(csr_paths):
    source = grain_cells.AnnDataSource(csr_paths, block_size=16, obs_columns=["idx"])
    try:
        source.read([0])  # opens file 0 in this process
        view = source.view(source.block_table.with_blocks([0, 100], [12, 110]))
        assert view.files is source.files and view.block_size == source.block_size
        assert repr(view).startswith(repr(source)[:-1])
        # Its own handles: closing the view leaves the source open.
        assert view._file(0) is not source._file(0)
        view.close()
        np.testing.assert_array_equal(source.read([1]).obs["idx"], [1])
        np.testing.assert_array_equal(view.read_blocks([1]).row_ids, range(100, 110))
        # Pickles as its values: no open file, buffer or thread travels.
        data = pickle.dumps(view)
        assert b"h5py" not in data and b"ThreadPool" not in data
        view.close()
    finally:
        source.close()


def test_chunk_aligned_and_condition_tables_are_pure(csr_paths):
    from grain_cells.sampling._conditions import condition_table
    from grain_cells.source import chunk_aligned_blocks

    source = grain_cells.AnnDataSource(csr_paths, block_size=16, obs_columns=["plate"])
    try:
        view = source.select(where={"plate": ["plate0", "plate2", "plate3"]})
        table = view.block_table
        before = repr(view)
        aligned = chunk_aligned_blocks(table, view.chunk_starts(), 2)
        assert aligned.blocks_id == grain_cells.chunk_aligned(view, 2).blocks_id
        np.testing.assert_array_equal(aligned.cell_mask(), table.cell_mask())
        plates = view.obs_values("plate")
        pure = condition_table(table, plates)
        assert pure.blocks_id == grain_cells.condition_blocks(view, "plate").blocks_id
        np.testing.assert_array_equal(pure.cell_mask(), table.cell_mask())
        _, starts, stops = pure.ranges(np.arange(len(pure)))
        for a, b in zip(starts, stops, strict=True):
            assert np.unique(plates[a:b]).size == 1  # one plate per block
        assert len(pure) > len(table)  # plate1's gap and plate changes cut blocks
        assert repr(view) == before
    finally:
        source.close()

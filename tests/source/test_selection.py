"""Cell selection (views over runs of cells) and deterministic splits."""

from __future__ import annotations

import pickle

import cloudpickle
import numpy as np
import pytest
from grain import sharding

import grain_cells
from grain_cells.source import BlockTable, blocks_of_mask

OBS = ("plate", "cell_type", "idx")


@pytest.fixture(scope="module")
def source(csr_paths):
    s = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=OBS)
    yield s
    s.close()


def rows_of(view) -> np.ndarray:
    """Global rows of a source's blocks, block after block."""
    _, starts, stops = view.block_ranges(np.arange(len(view)))
    parts = [np.arange(a, b) for a, b in zip(starts, stops, strict=True)]
    return np.concatenate(parts)


def check_blocks(view, selected: np.ndarray):
    """The view's blocks cover exactly `selected`, over runs, within files."""
    offsets = view.cell_offsets
    files, starts, stops = view.block_ranges(np.arange(len(view)))
    assert (starts[1:] >= stops[:-1]).all()  # sorted, disjoint
    assert ((stops - starts >= 1) & (stops - starts <= view.block_size)).all()
    np.testing.assert_array_equal(offsets[files] <= starts, True)
    np.testing.assert_array_equal(stops <= offsets[files + 1], True)
    np.testing.assert_array_equal(rows_of(view), np.flatnonzero(selected))
    assert view.num_selected_cells == selected.sum()
    # A block is short only at the end of a run (a gap or a file boundary).
    short = np.flatnonzero(stops - starts < view.block_size)
    for k in short:
        end = stops[k]
        assert end == view.num_cells or end in offsets or not selected[end]
    # Blocks start a run or follow a full block of the same run.
    follows = np.flatnonzero(starts[1:] == stops[:-1]) + 1
    follows = follows[~np.isin(starts[follows], offsets)]
    assert (stops[follows - 1] - starts[follows - 1] == view.block_size).all()
    # The descriptors agree with the table.
    for k in (0, len(view) // 2, len(view) - 1):
        b = view[k]
        assert (b.index, b.file, b.start, b.stop) == (k, files[k], starts[k], stops[k])


# -- blocks over runs ---------------------------------------------------------


@pytest.mark.parametrize(
    "mask, offsets, size, starts, stops",
    [
        pytest.param("11111", [0, 5], 2, [0, 2, 4], [2, 4, 5], id="one-run"),
        pytest.param("11011", [0, 5], 2, [0, 3], [2, 5], id="gap"),
        pytest.param("11111", [0, 3, 5], 2, [0, 2, 3], [2, 3, 5], id="file-edge"),
        pytest.param("01010", [0, 5], 4, [1, 3], [2, 4], id="scattered"),
        pytest.param("00000", [0, 5], 2, [], [], id="empty"),
        pytest.param("1", [0, 1], 3, [0], [1], id="single"),
        pytest.param("111111", [0, 2, 2, 6], 3, [0, 2, 5], [2, 5, 6], id="empty-file"),
    ],
)
def test_blocks_over_runs(mask, offsets, size, starts, stops):
    m = np.array([c == "1" for c in mask])
    table = BlockTable.grid(np.diff(offsets), size)
    if not m.any():
        with pytest.raises(ValueError, match="at least one"):
            blocks_of_mask(table, m)
        return
    view = blocks_of_mask(table, m)
    _, got_starts, got_stops = view.ranges(np.arange(len(view)))
    np.testing.assert_array_equal(got_starts, starts)
    np.testing.assert_array_equal(got_stops, stops)
    assert got_starts.dtype == got_stops.dtype == np.int64


# -- selection -----------------------------------------------------------------


def test_select_by_labels(source, helpers, csr_paths):
    view = source.select(where={"cell_type": ["B", "T"]})
    truth = helpers.Truth(source, csr_paths)
    labels = truth.obs(np.arange(source.num_cells), "cell_type")
    selected = np.isin(labels, ["B", "T"])
    check_blocks(view, selected)
    cells = view.read_blocks(np.arange(len(view)))
    np.testing.assert_array_equal(cells.row_ids, np.flatnonzero(selected))
    np.testing.assert_array_equal(cells.X.toarray(), truth.x(np.flatnonzero(selected)))
    # Labels over files whose categories are listed in other orders.
    assert set(source.categories["cell_type"][cells.obs["cell_type"]]) == {"B", "T"}


@pytest.mark.parametrize(
    "where, expected",
    [
        pytest.param(
            {"idx": lambda v: v % 3 != 0},
            lambda idx, ct, plate: idx % 3 != 0,
            id="numeric-predicate",
        ),
        pytest.param(
            {"idx": [5, 6, 7, 200]},
            lambda idx, ct, p: np.isin(idx, [5, 6, 7, 200]),
            id="numeric-values",
        ),
        pytest.param(
            {"cell_type": lambda labels: np.char.startswith(labels.astype(str), "N")},
            lambda idx, ct, plate: ct == "NK",
            id="category-predicate",
        ),
        pytest.param(
            {"plate": ["plate1", "plate6"], "cell_type": ["Mono", "DC", "B"]},
            lambda idx, ct, p: (
                np.isin(p, ["plate1", "plate6"]) & np.isin(ct, ["Mono", "DC", "B"])
            ),
            id="two-columns",
        ),
        pytest.param(
            {"plate": ["plate2"]},
            lambda idx, ct, p: p == "plate2",
            id="a-run-across-files",
        ),
    ],
)
def test_select_where(source, helpers, csr_paths, where, expected):
    truth = helpers.Truth(source, csr_paths)
    rows = np.arange(source.num_cells)
    want = expected(
        rows, truth.obs(rows, "cell_type"), truth.obs(rows, "plate")
    ).astype(bool)
    check_blocks(source.select(where=where), want)


def test_mask_row_ids_and_where_agree(source):
    where = {"cell_type": ["NK"]}
    by_where = source.select(where=where)
    mask = by_where.block_table.cell_mask()
    by_mask = source.select(mask)
    by_rows = source.select(np.flatnonzero(mask)[::-1])  # any order
    assert repr(by_mask) == repr(by_where) == repr(by_rows)
    # cells and where combine with "and".
    both = source.select(np.arange(100), where=where)
    check_blocks(both, mask & (np.arange(source.num_cells) < 100))


def test_select_on_a_view_intersects(source):
    view = source.select(where={"plate": ["plate0", "plate1", "plate2"]})
    inner = view.select(where={"cell_type": ["B"]})
    want = (
        view.block_table.cell_mask()
        & source.select(where={"cell_type": ["B"]}).block_table.cell_mask()
    )
    check_blocks(inner, want)
    assert repr(inner) == repr(source.select(want))


def test_loader_over_a_view_visits_the_selection_once(source, helpers, csr_paths):
    view = source.select(where={"cell_type": ["T", "Mono"]})
    loader = grain_cells.DataLoader(
        data_source=view,
        sampler=grain_cells.BlockSampler(view, seed=1),
        operations=grain_cells.fetch_operations(
            view, batch_size=4, fetch_factor=5, seed=1
        ),
    )
    batches = helpers.run(loader)
    rows = np.concatenate([b["row_ids"][b["mask"]] for b in batches])
    np.testing.assert_array_equal(
        np.sort(rows), np.flatnonzero(view.block_table.cell_mask())
    )
    truth = helpers.Truth(source, csr_paths)
    for b in batches[:5]:
        real = b["row_ids"][b["mask"]]
        assert set(truth.obs(real, "cell_type")) <= {"T", "Mono"}
        np.testing.assert_array_equal(b["obs/idx"][b["mask"]], real)


def test_cell_dataset_over_a_view(source):
    view = source.select(where={"plate": ["plate1", "plate4"]})
    ds = grain_cells.cell_dataset(view, batch_size=5, fetch_factor=2, seed=0)
    rows = np.concatenate([b["row_ids"][b["mask"]] for b in ds])
    np.testing.assert_array_equal(
        np.sort(rows), np.flatnonzero(view.block_table.cell_mask())
    )


def test_repr_identifies_the_selection(source):
    a = source.select(where={"cell_type": ["B"]})
    b = source.select(where={"cell_type": ["T"]})
    assert repr(a) != repr(b) != repr(source)
    assert repr(a).startswith(repr(source)[:-1])  # the full source's repr, plus
    assert "blocks=" in repr(a) and "blocks=" not in repr(source)
    for copy in (
        pickle.loads(pickle.dumps(a)),
        cloudpickle.loads(cloudpickle.dumps(a)),
    ):
        assert repr(copy) == repr(a)
        assert len(copy) == len(a)
        np.testing.assert_array_equal(
            copy.read_blocks([0, len(a) - 1]).row_ids,
            a.read_blocks([0, len(a) - 1]).row_ids,
        )
    # Same cells, other blocks: the repr differs.
    other = grain_cells.AnnDataSource(source.paths, block_size=3, obs_columns=OBS)
    assert repr(other.select(where={"cell_type": ["B"]})) != repr(a)


def test_a_view_does_not_close_its_parent(csr_paths):
    parent = grain_cells.AnnDataSource(csr_paths, block_size=5, obs_columns=OBS)
    parent.read([1, 2])
    view = parent.select(np.arange(50))
    view.read([3])
    view.close()
    del view
    np.testing.assert_array_equal(parent.read([1, 2]).row_ids, [1, 2])
    parent.close()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        pytest.param({"where": {"donor": ["x"]}}, KeyError, "obs_columns", id="column"),
        pytest.param({"where": {"cell_type": ["Q"]}}, ValueError, "'Q'", id="label"),
        pytest.param({"where": {"cell_type": "B"}}, TypeError, "list", id="str"),
        pytest.param({"where": ["cell_type"]}, TypeError, "map", id="not-mapping"),
        pytest.param(
            {"where": {"idx": lambda v: v}}, ValueError, "one bool", id="predicate"
        ),
        pytest.param({"cells": np.ones(5, bool)}, ValueError, "shape", id="mask-len"),
        pytest.param({"cells": [0, 288]}, ValueError, "288", id="row-range"),
        pytest.param({"cells": [0.5]}, TypeError, "dtype", id="float-cells"),
        pytest.param({"cells": np.zeros(288, bool)}, ValueError, "no cell", id="empty"),
    ],
)
def test_select_errors(source, kwargs, error, message):
    with pytest.raises(error, match=message):
        source.select(**kwargs)


@pytest.mark.parametrize(
    "starts, stops, message",
    [
        pytest.param([], [], "at least one", id="none"),
        pytest.param([0, 3], [3], "as many", id="lengths"),
        pytest.param([0], [6], "1 to block_size=5", id="too-long"),
        pytest.param([4], [4], "1 to block_size=5", id="empty"),
        pytest.param([5, 0], [8, 3], "sorted and disjoint", id="unsorted"),
        pytest.param([0, 2], [3, 4], "sorted and disjoint", id="overlap"),
        pytest.param([95], [99], "straddles two files", id="straddle"),
        pytest.param([287], [289], "288 cells", id="past-end"),
    ],
)
def test_with_blocks_errors(source, starts, stops, message):
    with pytest.raises(ValueError, match=message):
        source.with_blocks(np.array(starts, np.int64), np.array(stops, np.int64))


# -- splits --------------------------------------------------------------------


def check_partition(splits, parent):
    masks = [v.block_table.cell_mask() for v in splits.values()]
    total = np.sum(masks, axis=0)
    np.testing.assert_array_equal(total, parent.block_table.cell_mask().astype(int))


FRACTIONS = {"train": 0.7, "val": 0.2, "test": 0.1}


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="blocks"),
        pytest.param({"unit_cells": 8}, id="grid"),
        pytest.param({"by": "plate"}, id="by-plate"),
    ],
)
def test_split_by_fraction_partitions(source, kwargs):
    splits = grain_cells.split_by_fraction(source, FRACTIONS, seed=3, **kwargs)
    assert list(splits) == list(FRACTIONS)
    check_partition(splits, source)
    for v in splits.values():
        check_blocks(v, v.block_table.cell_mask())
    # Deterministic: rebuilt, same; another seed, another split.
    again = grain_cells.split_by_fraction(source, FRACTIONS, seed=3, **kwargs)
    assert [repr(v) for v in again.values()] == [repr(v) for v in splits.values()]
    other = grain_cells.split_by_fraction(source, FRACTIONS, seed=4, **kwargs)
    assert [repr(v) for v in other.values()] != [repr(v) for v in splits.values()]


def test_split_sizes_follow_the_fractions(source):
    splits = grain_cells.split_by_fraction(source, FRACTIONS, seed=0)
    for name, view in splits.items():  # within one block of its share
        assert abs(view.num_selected_cells - FRACTIONS[name] * 288) <= 5
    # Block units: the splits' blocks are blocks of the source.
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    for view in splits.values():
        _, a, b = view.block_ranges(np.arange(len(view)))
        k = np.searchsorted(starts, a)
        np.testing.assert_array_equal(starts[k], a)
        np.testing.assert_array_equal(stops[k], b)


def test_grid_units_do_not_depend_on_block_size(csr_paths):
    by_size = []
    for block_size in (2, 4, 7):
        s = grain_cells.AnnDataSource(csr_paths, block_size=block_size)
        splits = grain_cells.split_by_fraction(s, FRACTIONS, seed=5, unit_cells=8)
        by_size.append([v.block_table.cell_mask() for v in splits.values()])
        s.close()
    for other in by_size[1:]:
        for a, b in zip(by_size[0], other, strict=True):
            np.testing.assert_array_equal(a, b)


def test_groups_stay_whole(source, helpers, csr_paths):
    splits = grain_cells.split_by_fraction(
        source, {"train": 0.5, "val": 0.5}, seed=1, by="plate"
    )
    truth = helpers.Truth(source, csr_paths)
    seen = [
        set(truth.obs(np.flatnonzero(v.block_table.cell_mask()), "plate"))
        for v in splits.values()
    ]
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == {f"plate{i}" for i in range(8)}


def test_split_of_a_selection_covers_it(source):
    view = source.select(where={"cell_type": ["B", "NK", "DC"]})
    for kwargs in ({}, {"unit_cells": 6}, {"by": "plate"}):
        splits = grain_cells.split_by_fraction(
            view, {"a": 0.6, "b": 0.4}, seed=2, **kwargs
        )
        check_partition(splits, view)


def test_splits_do_not_depend_on_sharding(source, helpers):
    """Each shard of a split reads only that split's cells; shards cover it."""
    splits = grain_cells.split_by_fraction(source, FRACTIONS, seed=0)
    val = splits["val"]
    seen = []
    for i in range(2):
        loader = grain_cells.DataLoader(
            data_source=val,
            sampler=grain_cells.BlockSampler(
                val, seed=0, shard_options=sharding.ShardOptions(i, 2)
            ),
            operations=grain_cells.fetch_operations(val, batch_size=5, fetch_factor=1),
        )
        seen.append(
            np.concatenate([b["row_ids"][b["mask"]] for b in helpers.run(loader)])
        )
    rows = np.concatenate(seen)
    assert np.unique(rows).size == rows.size
    assert np.isin(rows, np.flatnonzero(val.block_table.cell_mask())).all()
    # All blocks but the remainder of an odd block count over two shards.
    assert rows.size >= val.num_selected_cells - val.block_size


def test_split_by_obs(source, helpers, csr_paths):
    splits = grain_cells.split_by_obs(
        source, "plate", {"val": ["plate3"], "test": ["plate5", "plate7"]}
    )
    assert list(splits) == ["val", "test", "train"]
    check_partition(splits, source)
    truth = helpers.Truth(source, csr_paths)
    plates = {
        k: set(truth.obs(np.flatnonzero(v.block_table.cell_mask()), "plate"))
        for k, v in splits.items()
    }
    assert plates["val"] == {"plate3"}
    assert plates["test"] == {"plate5", "plate7"}
    assert plates["train"] == {f"plate{i}" for i in (0, 1, 2, 4, 6)}
    # rest=None leaves the other cells out.
    held = grain_cells.split_by_obs(source, "plate", {"val": ["plate3"]}, rest=None)
    assert list(held) == ["val"]
    assert repr(held["val"]) == repr(splits["val"])


@pytest.mark.parametrize(
    "call, error, message",
    [
        pytest.param(
            lambda s: grain_cells.split_by_fraction(s, {"a": 0.5, "b": 0.4}),
            ValueError,
            "sum to 1",
            id="sum",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_fraction(s, {"a": 1.2, "b": -0.2}),
            ValueError,
            "positive",
            id="negative",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_fraction(s, {}),
            ValueError,
            "map",
            id="empty",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_fraction(
                s, {"a": 0.999, "b": 0.001}, by="plate"
            ),
            ValueError,
            r"\['b'\] get none",
            id="too-small",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_fraction(s, {"a": 1.0}, seed=-1),
            ValueError,
            "seed",
            id="seed",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_fraction(
                s, {"a": 1.0}, by="plate", unit_cells=4
            ),
            ValueError,
            "not both",
            id="both-units",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_fraction(s, {"a": 1.0}, unit_cells=0),
            ValueError,
            "unit_cells",
            id="unit-cells",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_fraction(s, {"a": 1.0}, by="donor"),
            KeyError,
            "obs_columns",
            id="by-column",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_obs(
                s, "plate", {"a": ["plate1"], "b": ["plate1", "plate2"]}
            ),
            ValueError,
            "shares cells",
            id="overlap",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_obs(s, "plate", {"train": ["plate1"]}),
            ValueError,
            "rest='train'",
            id="rest-name",
        ),
        pytest.param(
            lambda s: grain_cells.split_by_obs(
                s.select(where={"plate": ["plate0"]}), "plate", {"a": ["plate1"]}
            ),
            ValueError,
            "no cell",
            id="empty-holdout",
        ),
        pytest.param(  # every cell held out: no KeyError later on "train"
            lambda s: grain_cells.split_by_obs(
                s, "plate", {"all": lambda values: np.ones(len(values), bool)}
            ),
            ValueError,
            r"take every one of the source's \d+ cells, so 'train' would be "
            "empty. Hold out fewer values, or pass rest=None",
            id="empty-rest",
        ),
    ],
)
def test_split_errors(source, call, error, message):
    with pytest.raises(error, match=message):
        call(source)

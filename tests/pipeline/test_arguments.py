"""Arguments a new user gets wrong: refused by name, never silently coerced.

Also: AnnData objects passed as sources, passes that `remainder="drop"`
empties, and selections that fragment blocks.
"""

from __future__ import annotations

import logging

import anndata
import grain
import numpy as np
import pytest

import grain_cells
from grain_cells._util import arguments

BAD_INTS = [
    pytest.param(None, id="None"),
    pytest.param(1.7, id="float"),
    pytest.param(2.0, id="integral-float"),
    pytest.param(True, id="bool"),
    pytest.param("3", id="str"),
]


def make(kind, paths, value):
    """Calls the entry point `kind` with the bad `value` in its argument."""
    source = grain_cells.AnnDataSource(paths, block_size=5)
    if kind == "AnnDataSource.block_size":
        return grain_cells.AnnDataSource(paths, block_size=value)
    if kind == "BlockSampler.seed":
        return grain_cells.BlockSampler(source, seed=value)
    if kind == "BlockSampler.num_epochs":
        return grain_cells.BlockSampler(source, num_epochs=value)
    if kind == "WeightedBlockSampler.seed":
        return grain_cells.WeightedBlockSampler(
            source, np.ones(len(source)), seed=value
        )
    if kind == "fetch_operations.seed":
        return grain_cells.fetch_operations(source, batch_size=4, seed=value)
    if kind == "fetch_operations.batch_size":
        return grain_cells.fetch_operations(source, batch_size=value)
    if kind == "fetch_operations.fetch_factor":
        return grain_cells.fetch_operations(source, batch_size=4, fetch_factor=value)
    if kind == "cell_dataset.seed":
        return grain_cells.cell_dataset(source, batch_size=4, seed=value)
    if kind == "split_by_fraction.seed":
        return grain_cells.split_by_fraction(source, {"a": 0.5, "b": 0.5}, seed=value)
    raise AssertionError(kind)


ENTRY_POINTS = [
    "AnnDataSource.block_size",
    "BlockSampler.seed",
    "BlockSampler.num_epochs",
    "WeightedBlockSampler.seed",
    "fetch_operations.seed",
    "fetch_operations.batch_size",
    "fetch_operations.fetch_factor",
    "cell_dataset.seed",
    "split_by_fraction.seed",
]


@pytest.mark.parametrize("value", BAD_INTS)
@pytest.mark.parametrize("kind", ENTRY_POINTS)
def test_non_integers_are_refused_by_name(csr_paths, kind, value):
    if kind == "BlockSampler.num_epochs" and value is None:
        pytest.skip("num_epochs=None is an endless stream")
    if kind in ("AnnDataSource.block_size", "fetch_operations.fetch_factor") and (
        value is None
    ):
        pytest.skip("None picks the default (tests/source/test_compressed_defaults.py)")
    name = kind.split(".")[1]
    with pytest.raises(TypeError) as info:
        make(kind, csr_paths, value)
    assert f"{name}={value!r}" in str(info.value)
    assert isinstance(info.value, ValueError)  # as these errors were before


@pytest.mark.parametrize(
    "kind, value",
    [
        ("BlockSampler.seed", -1),
        ("BlockSampler.seed", 2**63),
        ("split_by_fraction.seed", 2**63),
        ("cell_dataset.seed", -1),
        ("fetch_operations.seed", -3),
        ("AnnDataSource.block_size", 0),
        ("fetch_operations.batch_size", 0),
        ("BlockSampler.num_epochs", 0),
    ],
)
def test_out_of_range_integers_are_refused_by_name(csr_paths, kind, value):
    name = kind.split(".")[1]
    with pytest.raises(ValueError, match=rf"{name}={value}"):
        make(kind, csr_paths, value)


@pytest.mark.parametrize(
    "genes, error",
    [
        pytest.param([], ValueError, id="empty-list"),
        pytest.param(np.array([], dtype=np.int64), ValueError, id="empty-array"),
        pytest.param(np.zeros(12, bool), ValueError, id="all-false-mask"),
        pytest.param("g3", TypeError, id="one-string"),
    ],
)
def test_gene_selections_that_select_nothing_are_refused(csr_paths, genes, error):
    with pytest.raises(error, match="genes="):
        grain_cells.AnnDataSource(csr_paths, genes=genes)


def test_a_backed_anndata_is_read_from_its_file(csr_paths):
    adata = anndata.read_h5ad(csr_paths[0], backed="r")
    try:
        by_object = grain_cells.AnnDataSource(adata, obs_columns=["idx"])
        by_path = grain_cells.AnnDataSource(csr_paths[0], obs_columns=["idx"])
        rows = np.array([3, 0, 50, 96])
        a, b = by_object.read(rows), by_path.read(rows)
        np.testing.assert_array_equal(a.X.toarray(), b.X.toarray())
        np.testing.assert_array_equal(a.obs["idx"], rows)
        both = grain_cells.AnnDataSource([adata, csr_paths[1]])
        assert both.num_cells == adata.n_obs + 130
    finally:
        adata.file.close()


def test_an_anndata_in_memory_is_refused_with_the_fix(csr_paths):
    adata = anndata.read_h5ad(csr_paths[0])
    with pytest.raises(TypeError, match=r"write_h5ad") as info:
        grain_cells.AnnDataSource(adata)
    assert "97 x 12" in str(info.value)
    with pytest.raises(TypeError, match=r"write_h5ad"):
        grain_cells.AnnDataSource([csr_paths[1], adata])


def test_a_view_of_a_backed_anndata_is_refused(csr_paths):
    adata = anndata.read_h5ad(csr_paths[0], backed="r")
    try:
        with pytest.raises(TypeError, match=r"view .*select"):
            grain_cells.AnnDataSource(adata[:10])
    finally:
        adata.file.close()


def test_drop_that_empties_a_pass_warns_and_is_true(csr_paths, helpers):
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)
    few = source.select(np.arange(10))  # 10 cells, minibatches of 16
    with pytest.warns(UserWarning, match=r"yields no minibatches"):
        operations = grain_cells.fetch_operations(
            few, batch_size=16, fetch_factor=5, remainder="drop"
        )
    loader = grain.DataLoader(
        data_source=few,
        sampler=grain_cells.BlockSampler(few, seed=0, num_epochs=1),
        operations=operations,
        read_options=grain_cells.pipeline.READ_OPTIONS,
    )
    assert helpers.run(loader) == []  # the warning told the truth
    # With pad, or when a pass holds minibatches, nothing to say (warnings
    # are errors here).
    grain_cells.fetch_operations(few, batch_size=16, fetch_factor=5)
    grain_cells.fetch_operations(
        source, batch_size=16, fetch_factor=5, remainder="drop"
    )


def test_fragmented_selections_say_so_in_the_log_and_repr(csr_paths, caplog):
    source = grain_cells.AnnDataSource(csr_paths, block_size=8)
    with caplog.at_level(logging.WARNING, logger="grain_cells"):
        every_third = source.select(np.arange(0, source.num_cells, 3))
    assert "fragmented" in repr(every_third)
    assert any(
        "fragmented" in r.getMessage() and "block_size=8" in r.getMessage()
        for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grain_cells"):
        runs = source.select(np.arange(40, 200))
    assert "fragmented" not in repr(runs)
    assert not caplog.records


def test_check_int_accepts_numpy_integers():
    assert arguments.check_int("k", np.int32(4), minimum=1) == 4
    assert arguments.check_seed(np.uint16(7)) == 7


@pytest.mark.parametrize("seed", [2**31, 2**63 - 1], ids=["2**31", "2**63-1"])
def test_every_loader_seed_takes_the_same_range(csr_paths, seed):
    """Samplers took seeds in [0, 2**31) and splits [0, 2**63): now both take
    [0, 2**63), and a large seed gives a stream of its own, the same each time."""
    source = grain_cells.AnnDataSource(csr_paths, block_size=5)

    def block_order(s):
        sampler = grain_cells.BlockSampler(source, seed=s, num_epochs=1)
        return [sampler[i] for i in range(len(source))]

    def weighted_order(s):
        sampler = grain_cells.WeightedBlockSampler(
            source, np.ones(len(source)), seed=s, num_epochs=1
        )
        return [sampler[i] for i in range(len(source))]

    assert block_order(seed) == block_order(seed)
    assert block_order(seed) != block_order(seed % 2**31)
    assert weighted_order(seed) == weighted_order(seed)
    assert weighted_order(seed) != weighted_order(seed % 2**31)
    splits = grain_cells.split_by_fraction(source, {"a": 0.5, "b": 0.5}, seed=seed)
    assert sum(len(s) for s in splits.values()) == len(source)  # blocks
    batches = list(
        grain_cells.cell_dataset(source, batch_size=4, seed=seed, num_epochs=1)
    )
    assert batches
    assert arguments.check_seed(np.uint64(seed)) == seed


def test_a_source_of_empty_files_is_refused_by_every_entry_point(tmp_path):
    """Files with no rows build a source (a collection may hold some), but a
    pipeline over no cell at all names the files instead of dividing by zero.
    """
    import scipy.sparse as sp

    path = str(tmp_path / "empty.h5ad")
    anndata.AnnData(sp.csr_matrix((0, 5), dtype=np.float32)).write_h5ad(path)
    source = grain_cells.AnnDataSource(path)
    assert source.num_cells == 0
    calls = [
        lambda: grain_cells.loader(source, batch_size=4),
        lambda: grain_cells.cell_dataset(source, batch_size=4),
        lambda: grain_cells.fetch_operations(source, batch_size=4),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="holds no cells") as e:
            call()
        assert path in str(e.value)

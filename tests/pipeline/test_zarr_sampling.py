"""Sampling on zarr stores: chunk grid, compressed defaults, weights, splits,
conditions.

The conftest files copied by anndata into zarr stores (`tests/zarr_copies.py`)
with X in chunks of 11 values (zarr's default codecs: blosc lz4 for v2,
zstd for v3), so a chunk holds about three cells; sharded, 4 chunks a
shard. The chunk grid a source reports must be the stores' own (from their
zarr metadata: inner chunks when sharded, the unit zarr decodes); a source
built without a `block_size` follows it, as on compressed `.h5ad`; and every
sampler and view gives over a zarr copy exactly the row sequence it gives
over the `.h5ad` originals.
"""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr_copies import Truth, copy_as, layout_params, read

import grain_cells

CHUNK = 11
LAYOUTS = layout_params("zarr-v2", "zarr-v3-sharded", "zarr-zip", slow=("zarr-zip",))
OBS = ("plate", "cell_type", "idx")


@pytest.fixture(scope="module")
def stores(csr_paths, tmp_path_factory):
    made = {}

    def get(layout):
        if layout not in made:
            folder = tmp_path_factory.mktemp(f"grid-{layout}")
            made[layout] = copy_as(csr_paths, folder, layout, chunk=CHUNK)
        return made[layout]

    return get


def _data_chunk_length(path: str) -> int:
    store = zarr.storage.ZipStore(path, mode="r") if path.endswith(".zip") else path
    try:
        return zarr.open_group(store, mode="r")["X/data"].chunks[0]
    finally:
        if path.endswith(".zip"):
            store.close()


def chunk_of_rows(paths) -> np.ndarray:
    """Global row -> (file, chunk of X/data holding the row's first value)."""
    parts = []
    for f, path in enumerate(paths):
        length = _data_chunk_length(path)
        assert length == CHUNK  # inner chunks when sharded
        indptr = read(path).X.indptr.astype(np.int64)
        chunk = np.minimum(indptr[:-1], max(indptr[-1] - 1, 0)) // length
        parts.append(np.stack([np.full(chunk.size, f), chunk], axis=1))
    return np.concatenate(parts)


def expected_chunk_starts(paths) -> np.ndarray:
    where = chunk_of_rows(paths)
    change = np.any(where[1:] != where[:-1], axis=1)
    return np.concatenate([[0], np.flatnonzero(change) + 1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_starts_are_the_stores_chunks(stores, layout):
    paths = stores(layout)
    source = grain_cells.AnnDataSource(paths, block_size=16)
    np.testing.assert_array_equal(source.chunk_starts(), expected_chunk_starts(paths))


def _blocks(source):
    _, starts, stops = source.block_ranges(np.arange(len(source)))
    return starts, stops


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_aligned_blocks_follow_the_chunk_grid(stores, layout):
    paths = stores(layout)
    aligned = grain_cells.chunk_aligned(
        grain_cells.AnnDataSource(paths, block_size=16), chunks_per_block=2
    )
    starts, stops = _blocks(aligned)
    np.testing.assert_array_equal(starts[1:], stops[:-1])  # every cell once
    where = chunk_of_rows(paths)
    first, last = where[starts], where[stops - 1]
    assert (first[:, 0] == last[:, 0]).all()  # never across files
    assert (last[:, 1] - first[:, 1] < 2).all()  # at most 2 chunks of cells
    assert np.isin(starts, expected_chunk_starts(paths)).mean() > 0.9


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compressed_defaults_follow_the_chunk_grid(stores, layout, helpers):
    paths = stores(layout)
    source = grain_cells.AnnDataSource(paths, obs_columns=OBS)
    assert source.fetch_blocks == 64  # compressed: 64 blocks per fetch
    # As on compressed .h5ad (tests/source/test_compressed_defaults.py): 88
    # decoded bytes a chunk, 4 chunks a block, blocks of at most 16 cells.
    assert source.block_size == 16
    grid = grain_cells.AnnDataSource(paths, block_size=16, obs_columns=OBS)
    want = _blocks(grain_cells.chunk_aligned(grid, chunks_per_block=4))
    for got, expected in zip(_blocks(source), want, strict=True):
        np.testing.assert_array_equal(got, expected)
    batches = helpers.run(
        grain_cells.loader(source, batch_size=4, seed=3, num_epochs=1)
    )
    truth, seen = Truth(paths), []
    for b in batches:
        rows = b["row_ids"][b["mask"]]
        np.testing.assert_array_equal(b["obs/idx"][b["mask"]], truth.obs(rows, "idx"))
        seen.append(rows)
    assert np.sort(np.concatenate(seen)).tolist() == list(range(helpers.N_CELLS))


# -- weights, splits, conditions: the same rows as over the .h5ad files ----------


def _rows(dataset) -> np.ndarray:
    iterator = iter(dataset)
    try:
        return np.concatenate([np.array(b["row_ids"]) for b in iterator])
    finally:
        iterator.close()


def _sequences(paths) -> dict[str, np.ndarray]:
    source = grain_cells.AnnDataSource(paths, block_size=5, obs_columns=OBS)
    kw = {"batch_size": 4, "fetch_factor": 5, "seed": 3}
    weights = grain_cells.balanced_block_weights(source, "cell_type")
    by_fraction = grain_cells.split_by_fraction(source, {"train": 0.8, "val": 0.2})
    by_obs = grain_cells.split_by_obs(source, "plate", {"val": ["plate2"]})
    return {
        "weights": weights,
        "weighted": _rows(
            grain_cells.cell_dataset(
                source,
                sampler=grain_cells.WeightedBlockSampler(source, weights, seed=3),
                **kw,
            )
        ),
        "fraction-val": _rows(grain_cells.cell_dataset(by_fraction["val"], **kw)),
        "obs-train": _rows(grain_cells.cell_dataset(by_obs["train"], **kw)),
        "condition": _rows(grain_cells.cell_dataset(source, condition="plate", **kw)),
    }


@pytest.mark.slow  # the not-slow subset keeps one smoke test per capability
@pytest.mark.parametrize("layout", layout_params("zarr-v2", "zarr-v3-sharded"))
def test_weights_splits_conditions_equal_h5ad(stores, csr_paths, layout):
    want = _sequences(csr_paths)
    got = _sequences(stores(layout))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)

"""A fetch_factor the user gives is honoured on blocks along a chunk grid.

A compressed file (gzip `.h5ad`) or zarr store built without a `block_size`
has blocks along its chunk grid, of varying size up to `block_size` cells
(`grain_cells.source._chunk_grid`). `fetch_factor=16` with `batch_size=256`
(the README's spelling) asks for fetches of 4,096 cells, which `block_size`
(here 944 and 160) does not divide: a fetch takes enough blocks to hold
them, its cells are split into full minibatches of 256 and only its last
one is padded, as for the fetches of the chunk grid's own default. Checked
through `grain_cells.loader` and through `grain.DataLoader` with
`fetch_operations`, against anndata's reads.
"""

from __future__ import annotations

import warnings

import anndata
import grain
import numpy as np
import pytest
import scipy.sparse as sp
from zarr_copies import write_store

import grain_cells

N_OBS, N_VARS = 12_000, 50
BATCH, FACTOR = 256, 16


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fetch_factor_grid")
    x = sp.random(N_OBS, N_VARS, density=0.1, format="csr", dtype=np.float32, rng=0)
    x.data[:] = np.repeat(np.arange(N_OBS), np.diff(x.indptr)) + 1  # row + 1
    adata = anndata.AnnData(X=x)
    gz = str(folder / "gz.h5ad")
    adata.write_h5ad(gz, compression="gzip")
    zarr_path = write_store(adata, folder / "z.zarr", "zarr-v3-sharded", chunk=300)
    return {"gzip": gz, "zarr": zarr_path}, x


def _oracle(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path.endswith(".h5ad"):
            return anndata.read_h5ad(path).X
        return anndata.read_zarr(path).X


def _expected_minibatches(source, blocks_per_fetch):
    """Minibatches of an epoch: per fetch of consecutive sampled blocks,
    its cells in minibatches of BATCH, the last one padded."""
    sampler = grain_cells.BlockSampler(source, seed=0, num_epochs=1)
    cells = [source[sampler[i].record_key] for i in range(len(sampler))]
    sizes = np.array([b.stop - b.start for b in cells])
    total = 0
    for a in range(0, sizes.size, blocks_per_fetch):
        total += -(-int(sizes[a : a + blocks_per_fetch].sum()) // BATCH)
    return total


@pytest.mark.parametrize("kind", ["gzip", "zarr"])
@pytest.mark.parametrize("spelling", ["loader", "grain.DataLoader"])
def test_fetch_factor_is_honoured_on_chunk_grid_blocks(stores, kind, spelling):
    paths, x = stores
    path = paths[kind]
    source = grain_cells.AnnDataSource(path)
    b = source.block_size
    assert source.fetch_blocks is not None  # blocks along the chunk grid
    assert (BATCH * FACTOR) % b  # no whole number of blocks makes 4,096
    operations = grain_cells.fetch_operations(
        source, batch_size=BATCH, fetch_factor=FACTOR, seed=0
    )
    blocks = operations[0].batch_size
    assert blocks == -(-BATCH * FACTOR // b)  # enough blocks for 4,096 cells
    if spelling == "loader":
        loader = grain_cells.loader(
            source, batch_size=BATCH, fetch_factor=FACTOR, seed=0
        )
        batches = list(loader)
        assert len(loader) == len(batches)
    else:
        loader = grain.DataLoader(
            data_source=source,
            sampler=grain_cells.BlockSampler(source, seed=0, num_epochs=1),
            operations=operations,
            worker_count=0,
        )
        batches = list(loader)
    assert len(batches) == _expected_minibatches(source, blocks)
    assert all(batch["mask"].size == BATCH for batch in batches)
    # Every cell once, with its values.
    rows = np.concatenate([batch["row_ids"][batch["mask"]] for batch in batches])
    np.testing.assert_array_equal(np.sort(rows), np.arange(N_OBS))
    got = sp.vstack(
        [
            sp.csr_matrix(
                (batch["data"], batch["indices"], batch["indptr"]),
                shape=(BATCH, N_VARS),
            )[batch["mask"]]
            for batch in batches
        ]
    )
    oracle = _oracle(path)
    np.testing.assert_array_equal(got.toarray(), oracle[rows].toarray())
    np.testing.assert_array_equal(oracle.toarray(), x.toarray())
    source.close()

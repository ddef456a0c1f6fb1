"""densify turns padded-sparse minibatches into the dense rows, inside jit."""

from __future__ import annotations

import anndata as ad
import jax
import numpy as np
import pandas as pd
import scipy.sparse as sp

import grain_cells


def test_densify_inside_jit_matches_the_file(tmp_path):
    rng = np.random.default_rng(0)
    n, g = 120, 30
    mask = rng.random((n, g)) < 0.4
    rows, cols = np.nonzero(mask)
    x = sp.csr_matrix(
        ((rows * 100 + cols + 1).astype(np.float32), (rows, cols)), shape=(n, g)
    )
    path = tmp_path / "a.h5ad"
    ad.AnnData(
        x,
        obs=pd.DataFrame(index=[f"c{i}" for i in range(n)]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(g)]),
    ).write_h5ad(path)
    genes = np.array([3, 0, 29, 7])
    source = grain_cells.AnnDataSource(path, block_size=4, genes=genes)
    loader = grain_cells.DataLoader(
        data_source=source,
        sampler=grain_cells.BlockSampler(source, seed=1),
        operations=grain_cells.fetch_operations(
            source,
            batch_size=8,
            fetch_factor=2,
            output=grain_cells.PaddedSparseOutput(width=g),
        ),
    )
    dense = jax.jit(grain_cells.densify, static_argnums=2)
    seen = 0
    for batch in loader:
        got = np.asarray(dense(batch["values"], batch["indices"], genes.size))
        real = batch["mask"]
        want = x[batch["row_ids"][real]][:, genes].toarray()
        np.testing.assert_array_equal(got[real], want)
        assert not got[~real].any()
        seen += real.sum()
    assert seen == n


def test_densify_drops_padding_and_out_of_range_indices():
    values = np.array([[1.0, 2.0, 0.0], [3.0, 5.0, 0.0]], np.float32)
    indices = np.array([[0, 4, 0], [2, 9, 0]], np.int32)  # 9 is past num_genes
    got = np.asarray(grain_cells.densify(values, indices, 5))
    np.testing.assert_array_equal(got, [[1, 0, 0, 0, 2], [0, 0, 3, 0, 0]])

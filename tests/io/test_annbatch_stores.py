"""annbatch's pre-shuffled collections open as one source (annbatch_stores).

The collection test writes a real one with annbatch (Python >= 3.12: it
skips on 3.11 and runs on the CI's second leg); the oracle is
`anndata.read_zarr` of each dataset. The listing and refusal tests build
the layout annbatch writes (one zarr v3 group marked
`annbatch-preshuffled`, AnnData groups `dataset_N` under it) with anndata
and zarr, so they run everywhere.
"""

from __future__ import annotations

import warnings

import anndata
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
import zarr

import grain_cells
from grain_cells import errors
from grain_cells.synthetic import write_tahoe_like

N_CELLS, SMALL = 600, {"n_genes": 120, "mean_nnz": 15.0}


def _collection_by_hand(path, n_datasets, var_of=lambda n: ["a", "b", "c"]):
    root = zarr.open_group(path, mode="w", zarr_format=3)
    for n in range(n_datasets):
        adata = anndata.AnnData(
            X=sp.csr_matrix(np.full((2, 3), n + 1, np.float32)),
            obs=pd.DataFrame({"n": [n, n]}, index=[f"c{n}_0", f"c{n}_1"]),
            var=pd.DataFrame(index=var_of(n)),
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # anndata's shard note
            anndata.io.write_elem(root, f"dataset_{n}", adata)
    root.attrs.update(
        {"encoding-type": "annbatch-preshuffled", "encoding-version": "0.1.0"}
    )
    return path


def test_datasets_listed_in_annbatch_order(tmp_path):
    path = _collection_by_hand(tmp_path / "c.zarr", 11)
    stores = grain_cells.annbatch_stores(path)
    assert stores == [f"{path}/dataset_{n}" for n in range(11)]  # 2 before 10
    source = grain_cells.AnnDataSource(stores, block_size=2, obs_columns=["n"])
    assert source.num_cells == 22
    cells = source.read(np.array([21, 4, 0]))
    np.testing.assert_array_equal(cells.X.toarray()[:, 0], [11, 3, 1])


def test_not_a_collection_is_refused_by_name(tmp_path):
    plain = tmp_path / "plain.zarr"
    anndata.AnnData(X=np.ones((2, 2), np.float32)).write_zarr(plain)
    with pytest.raises(
        errors.AnnDataFormatError, match=r"plain\.zarr: not an annbatch"
    ):
        grain_cells.annbatch_stores(plain)
    empty = _collection_by_hand(tmp_path / "empty.zarr", 0)
    with pytest.raises(errors.AnnDataFormatError, match="no dataset_N group"):
        grain_cells.annbatch_stores(empty)


def test_datasets_with_other_genes_are_refused(tmp_path):
    path = _collection_by_hand(
        tmp_path / "c.zarr", 3, var_of=lambda n: ["a", "b", "x" if n == 2 else "c"]
    )
    with pytest.raises(errors.GeneMismatchError, match=r"dataset_2: var differs.*'x'"):
        grain_cells.annbatch_stores(path)


@pytest.mark.slow  # annbatch writes three datasets; two spawned workers
def test_collection_written_by_annbatch_reads_as_anndata(tmp_path):
    annbatch = pytest.importorskip("annbatch")  # Python >= 3.12
    h5ad = write_tahoe_like(tmp_path / "cells.h5ad", N_CELLS, **SMALL)
    folder = tmp_path / "shuffled.zarr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # annbatch's and dask's notes
        annbatch.DatasetCollection(folder).add_adatas(
            [str(h5ad)],
            dataset_size=200,
            shuffle_chunk_size=50,
            rng=np.random.default_rng(0),
        )
    stores = grain_cells.annbatch_stores(folder)
    assert stores == [f"{folder}/dataset_{n}" for n in range(3)]
    want = anndata.concat([anndata.read_zarr(s) for s in stores])
    source = grain_cells.AnnDataSource(stores, obs_columns=["n_counts"])
    rows = np.random.default_rng(1).permutation(N_CELLS)[:100]
    cells = source.read(rows)
    np.testing.assert_array_equal(cells.X.toarray(), want.X[rows].toarray())
    # Every cell once per epoch through the loader, rows whole: a row's sum
    # is its n_counts (the maker's invariant), whatever the worker count.
    for workers in (0, 2):
        loader = grain_cells.loader(
            stores,
            batch_size=64,
            obs_columns=["n_counts"],
            worker_count=workers,
            seed=0,
        )
        seen = 0
        for batch in loader:
            mask = batch["mask"]
            x = sp.csr_matrix(
                (batch["data"], batch["indices"], batch["indptr"]),
                shape=(mask.size, SMALL["n_genes"]),
            )
            sums = np.asarray(x.sum(axis=1)).ravel()
            np.testing.assert_allclose(sums[mask], batch["obs/n_counts"][mask])
            seen += int(mask.sum())
        assert seen == N_CELLS

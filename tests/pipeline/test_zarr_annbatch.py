"""annbatch's pre-shuffled collection as input, written by annbatch itself.

`annbatch.DatasetCollection(folder).add_adatas(...)` shuffles the conftest
files (value at (row i, gene j) = i * 100 + j + 1, obs `idx` = i) into
`dataset_N` zarr groups of about 100 cells, sharded, with one var. The
groups open as one source; every cell the loader gives must hold the values
of the original cell its `obs/idx` names, and an epoch must give every
original cell once. Skipped where annbatch is not installed (the `bench`
extra).
"""

from __future__ import annotations

import os
import re
import warnings

import numpy as np
import pytest
from absl import flags
from zarr_copies import Truth

annbatch = pytest.importorskip("annbatch", reason="annbatch is not installed")

import grain_cells  # noqa: E402


def collection_stores(folder: str) -> list[str]:
    """The collection's `dataset_N` groups by N (the one line a user writes)."""
    names = [n for n in os.listdir(folder) if re.fullmatch(r"dataset_\d+", n)]
    return [f"{folder}/{n}" for n in sorted(names, key=lambda n: int(n[8:]))]


@pytest.fixture(scope="module")
def collection(csr_paths, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("annbatch") / "collection.zarr")
    with warnings.catch_warnings():  # annbatch's own (settings, progress)
        warnings.simplefilter("ignore")
        annbatch.DatasetCollection(folder).add_adatas(
            csr_paths,
            dataset_size=100,
            shuffle_chunk_size=10,
            n_obs_per_chunk=16,
            shard_size=64,
            rng=np.random.default_rng(0),
        )
    stores = collection_stores(folder)
    assert len(stores) == 3
    return stores


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_collection_cells_are_the_originals(collection, csr_paths, helpers, workers):
    flags.FLAGS.mark_as_parsed()
    source = grain_cells.AnnDataSource(collection, block_size=8, obs_columns=["idx"])
    assert source.num_cells == helpers.N_CELLS
    loader = grain_cells.loader(
        source, batch_size=16, fetch_factor=4, seed=0, worker_count=workers
    )
    original, stored = Truth(csr_paths), Truth(collection)
    seen = []
    for b in helpers.run(loader):
        real = b["mask"]
        idx = b["obs/idx"][real]
        indptr = b["indptr"]
        x = np.zeros((indptr.size - 1, helpers.N_GENES))
        for r in range(indptr.size - 1):
            cols = b["indices"][indptr[r] : indptr[r + 1]]
            x[r, cols] = b["data"][indptr[r] : indptr[r + 1]]
        np.testing.assert_array_equal(x[real], original.matrix(idx))
        np.testing.assert_array_equal(x[real], stored.matrix(b["row_ids"][real]))
        seen.append(idx)
    assert np.sort(np.concatenate(seen)).tolist() == list(range(helpers.N_CELLS))

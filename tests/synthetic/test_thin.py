"""Thin atlas-shaped files (`write_thin_atlas`, `write_thin_collection`).

Checked against anndata itself: the rows of X equal `thin_rows` (values
encode the atlas row), the obs codes have the documented order, and a
collection's concatenation equals the one file of the same cells.
"""

from __future__ import annotations

import anndata
import numpy as np
import pytest

from grain_cells.synthetic import write_thin_atlas, write_thin_collection
from grain_cells.synthetic._thin import thin_rows

N = 3_000


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    path = tmp_path_factory.mktemp("thin") / "one.h5ad"
    # Several write steps, so the step boundaries are exercised.
    return anndata.read_h5ad(write_thin_atlas(path, N, n_donors=20, chunk_cells=700))


@pytest.mark.parametrize(
    "compression", [pytest.param(None, id="none"), pytest.param("gzip", id="gzip")]
)
def test_rows_equal_the_generator(tmp_path, compression):
    path = write_thin_atlas(
        tmp_path / "x.h5ad", N, compression=compression, chunk_cells=1_000
    )
    x = anndata.read_h5ad(path).X
    indptr, indices, data = thin_rows(0, N, 2_000)
    assert x.shape == (N, 2_000)
    np.testing.assert_array_equal(x.indptr, indptr)
    np.testing.assert_array_equal(x.indices, indices)
    np.testing.assert_array_equal(x.data, data)
    assert x.nnz / N == pytest.approx(4.0, abs=0.01)
    assert x.has_sorted_indices


def test_obs_and_var(one):
    assert list(one.obs.columns) == ["plate", "donor", "cell_type", "batch"]
    assert one.obs_names[7] == "cell_7"
    assert one.var_names[1] == "ENSG00000000001"
    codes = {c: one.obs[c].cat.codes.to_numpy() for c in one.obs}
    rows = np.arange(N)
    np.testing.assert_array_equal(codes["plate"], rows * 14 // N)
    np.testing.assert_array_equal(codes["donor"], rows * 20 // N)
    assert (np.diff(codes["plate"]) >= 0).all()
    assert one.obs["plate"].cat.categories[0] == "plate_00"
    counts = np.bincount(codes["cell_type"], minlength=50)
    assert counts[0] > counts[10] > 0  # Zipf-like shares


def test_collection_equals_one_file(one, tmp_path):
    paths = write_thin_collection(tmp_path / "c", 4, N // 4, n_donors=20)
    assert [p.name for p in paths] == [f"thin-{k:05d}.h5ad" for k in range(4)]
    parts = [anndata.read_h5ad(p) for p in paths]
    both = anndata.concat(parts)
    assert (both.X != one.X).nnz == 0
    np.testing.assert_array_equal(both.obs_names, one.obs_names)
    for column in one.obs:
        np.testing.assert_array_equal(
            both.obs[column].astype(str), one.obs[column].astype(str)
        )
        # Every file carries every category, so codes agree too.
        assert list(parts[1].obs[column].cat.categories) == list(
            one.obs[column].cat.categories
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"n_cells": 0}, id="no-cells"),
        pytest.param({"n_genes": 4}, id="too-few-genes"),
        pytest.param({"compression": "zstd"}, id="compression"),
        pytest.param({"first_cell": 10, "total_cells": 5}, id="total"),
    ],
)
def test_bad_arguments(tmp_path, kwargs):
    args = {"n_cells": 10} | kwargs
    with pytest.raises(ValueError):
        write_thin_atlas(tmp_path / "bad.h5ad", **args)

"""Tests for grain_cells.synthetic."""

from __future__ import annotations

import os

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

from grain_cells.synthetic import _tahoe as synthetic
from grain_cells.synthetic import cached_tahoe_like, write_tahoe_like

SMALL = {"n_genes": 2_000, "mean_nnz": 150.0, "chunk_cells": 700}
N_CELLS = 3_000


@pytest.fixture(scope="module")
def small_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("synthetic") / "small.h5ad"
    return write_tahoe_like(path, N_CELLS, **SMALL)


@pytest.fixture(scope="module")
def small(small_path):
    return anndata.read_h5ad(small_path)


def assert_same_csr(a, b):
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_array_equal(a.data, b.data)


def test_returns_path(small_path, tmp_path):
    assert small_path.name == "small.h5ad"
    out = write_tahoe_like(str(tmp_path / "s.h5ad"), 10, n_genes=60, mean_nnz=10)
    assert out == tmp_path / "s.h5ad"
    assert out.is_file()


def test_matrix(small):
    x = small.X
    assert small.shape == (N_CELLS, SMALL["n_genes"])
    assert isinstance(x, sp.csr_matrix)
    assert x.dtype == np.float32
    assert x.indices.dtype == np.int32
    assert x.indptr.dtype == np.int64
    assert x.has_sorted_indices
    assert x.has_canonical_format  # sorted and no duplicates
    for row in range(0, N_CELLS, 97):  # unique + sorted, checked directly
        cols = x.indices[x.indptr[row] : x.indptr[row + 1]]
        assert np.all(np.diff(cols) > 0)
    assert x.indices.min() >= 0 and x.indices.max() < SMALL["n_genes"]
    # Integer-valued counts, mostly small, with a tail.
    assert np.all(x.data >= 1) and np.all(x.data == np.round(x.data))
    assert np.mean(x.data <= 3) > 0.85
    assert x.data.max() >= 10
    # Rows have spread, within the clip range.
    nnz = np.diff(x.indptr)
    assert nnz.min() >= 1 and nnz.max() <= SMALL["n_genes"]
    assert nnz.std() > 0.2 * nnz.mean()


def test_gene_choice_is_skewed(small):
    detected = np.bincount(small.X.indices, minlength=small.n_vars) / small.n_obs
    assert (detected > 0.5).sum() >= 5  # some genes in most cells
    assert np.median(detected) < 0.1  # most genes rare
    assert (detected > 0.5).sum() < 0.05 * small.n_vars


def test_obs(small):
    obs = small.obs
    assert list(obs.columns) == ["plate", "cell_line", "drug", "n_counts"]
    for col in ("plate", "cell_line", "drug"):
        assert isinstance(obs[col].dtype, pd.CategoricalDtype), col
    assert list(obs["plate"].cat.categories) == [f"plate_{i:02d}" for i in range(1, 15)]
    assert list(obs["cell_line"].cat.categories) == [
        f"CVCL_{i:04d}" for i in range(1, 51)
    ]
    assert list(obs["drug"].cat.categories) == [f"drug_{i:03d}" for i in range(1, 381)]
    assert obs.index[0] == "cell_000000000"
    assert obs.index[-1] == f"cell_{N_CELLS - 1:09d}"
    assert obs.index.is_unique
    assert obs["n_counts"].dtype == np.float32
    np.testing.assert_array_equal(
        obs["n_counts"].to_numpy(), np.asarray(small.X.sum(axis=1)).ravel()
    )


def test_plates_sorted_and_balanced(small):
    codes = small.obs["plate"].cat.codes.to_numpy()
    assert np.all(np.diff(codes) >= 0)
    counts = np.bincount(codes, minlength=14)
    assert len(counts) == 14
    assert counts.max() - counts.min() <= 1
    for i in range(14):
        lo, hi = i * N_CELLS // 14, (i + 1) * N_CELLS // 14
        assert np.all(codes[lo:hi] == i)


def test_cell_lines_mixed_and_skewed(small):
    obs = small.obs
    for plate in ("plate_01", "plate_14"):
        lines = obs.loc[obs["plate"] == plate, "cell_line"]
        assert lines.nunique() >= 20  # a mix in every plate
        # Not sorted within the plate.
        assert not lines.cat.codes.is_monotonic_increasing
    freq = obs["cell_line"].value_counts().to_numpy()
    assert freq[0] > 4 * freq[-1]
    drugs = obs["drug"].value_counts().to_numpy()
    assert drugs[0] > 3 * max(drugs[-1], 1)


def test_var(small):
    var = small.var
    assert var.index[0] == "ENSG00000000001"
    assert var.index[-1] == f"ENSG{SMALL['n_genes']:011d}"
    assert var.index.is_unique
    assert list(var.columns) == ["gene_symbol"]
    assert all(isinstance(s, str) for s in var["gene_symbol"])


def test_backed_read(small_path, small):
    backed = anndata.read_h5ad(small_path, backed="r")
    try:
        assert backed.shape == small.shape
        rows = backed.X[100:260]
        assert_same_csr(sp.csr_matrix(rows), small.X[100:260])
        pd.testing.assert_frame_equal(backed.obs, small.obs)
    finally:
        backed.file.close()


def test_x_layout_matches_anndata(small_path, tmp_path):
    ref = tmp_path / "ref.h5ad"
    x = sp.csr_matrix(np.array([[0, 1, 0], [2, 0, 3]], dtype=np.float32))
    anndata.AnnData(X=x).write_h5ad(ref)
    with h5py.File(ref, "r") as f_ref, h5py.File(small_path, "r") as f:
        ours, theirs = f["X"], f_ref["X"]
        assert isinstance(ours, h5py.Group)
        assert set(ours.attrs) == set(theirs.attrs)
        for name in ("encoding-type", "encoding-version"):
            assert ours.attrs[name] == theirs.attrs[name]
            assert type(ours.attrs[name]) is type(theirs.attrs[name])
        assert ours.attrs["shape"].dtype == theirs.attrs["shape"].dtype
        assert tuple(ours.attrs["shape"]) == (N_CELLS, SMALL["n_genes"])
        assert set(ours) == {"data", "indices", "indptr"}
        for name in ("data", "indices", "indptr"):
            assert ours[name].maxshape == (None,)
            assert ours[name].compression is None
        assert ours["data"].chunks == (2**18,)
        assert ours["indices"].chunks == (2**18,)
        assert ours["indptr"].shape == (N_CELLS + 1,)
        assert set(f.attrs) == set(f_ref.attrs)


def test_deterministic(small_path, small, tmp_path):
    again = anndata.read_h5ad(write_tahoe_like(tmp_path / "b.h5ad", N_CELLS, **SMALL))
    assert_same_csr(again.X, small.X)
    pd.testing.assert_frame_equal(again.obs, small.obs)
    pd.testing.assert_frame_equal(again.var, small.var)


def test_different_seed_differs(small, tmp_path):
    other = anndata.read_h5ad(
        write_tahoe_like(tmp_path / "c.h5ad", N_CELLS, seed=1, **SMALL)
    )
    assert other.shape == small.shape
    assert (other.X != small.X).nnz > 0
    assert not other.obs["cell_line"].equals(small.obs["cell_line"])


def test_metadata_does_not_depend_on_chunk_cells(small, tmp_path):
    args = {**SMALL, "chunk_cells": 1_024}
    other = anndata.read_h5ad(write_tahoe_like(tmp_path / "d.h5ad", N_CELLS, **args))
    pd.testing.assert_frame_equal(other.obs, small.obs)
    np.testing.assert_array_equal(
        np.asarray(other.X.sum(axis=1)).ravel(), other.obs["n_counts"].to_numpy()
    )


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
def test_compression_round_trip(compression, small, tmp_path):
    path = write_tahoe_like(
        tmp_path / "z.h5ad", N_CELLS, compression=compression, **SMALL
    )
    with h5py.File(path, "r") as f:
        for name in ("data", "indices", "indptr"):
            assert f["X"][name].compression == compression
        assert f["X/data"].chunks == (2**16,)
    assert_same_csr(anndata.read_h5ad(path).X, small.X)


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_dense_equals_csr(compression, tmp_path):
    args = {"n_genes": 300, "mean_nnz": 40.0, "chunk_cells": 500}
    csr = anndata.read_h5ad(write_tahoe_like(tmp_path / "s.h5ad", 1_200, **args)).X
    path = write_tahoe_like(
        tmp_path / "d.h5ad", 1_200, dense=True, compression=compression, **args
    )
    with h5py.File(path, "r") as f:
        assert isinstance(f["X"], h5py.Dataset)
        assert f["X"].dtype == np.float32
        assert f["X"].attrs["encoding-type"] == "array"
        assert f["X"].attrs["encoding-version"] == "0.2.0"
        assert f["X"].compression == compression
        if compression is None:
            assert f["X"].chunks is None
        else:
            assert f["X"].chunks[1] == 300
    dense = anndata.read_h5ad(path)
    assert isinstance(dense.X, np.ndarray)
    assert dense.X.shape == (1_200, 300) and dense.X.dtype == np.float32
    np.testing.assert_array_equal(dense.X, csr.toarray())
    np.testing.assert_array_equal(dense.obs["n_counts"], dense.X.sum(axis=1))


def test_mean_nnz_close_to_target(tmp_path):
    path = write_tahoe_like(tmp_path / "m.h5ad", 3_000, n_genes=5_000, mean_nnz=300)
    with h5py.File(path, "r") as f:
        nnz = np.diff(f["X/indptr"][:])
    assert abs(nnz.mean() - 300) < 0.1 * 300


def test_tiny_shapes(tmp_path):
    # Fewer cells than plates, fewer genes than the lower nnz clip.
    a = anndata.read_h5ad(
        write_tahoe_like(tmp_path / "t.h5ad", 5, n_genes=20, mean_nnz=10)
    )
    assert a.shape == (5, 20)
    assert len(a.obs["plate"].cat.categories) == 14
    assert np.all(np.diff(a.obs["plate"].cat.codes.to_numpy()) >= 0)
    assert a.X.has_canonical_format
    one = anndata.read_h5ad(
        write_tahoe_like(tmp_path / "o.h5ad", 1, n_genes=1, mean_nnz=1)
    )
    assert one.shape == (1, 1) and one.X.nnz == 1


def test_category_widths_grow(tmp_path):
    a = anndata.read_h5ad(
        write_tahoe_like(
            tmp_path / "w.h5ad", 200, n_genes=50, mean_nnz=10, n_plates=120
        )
    )
    assert a.obs["plate"].cat.categories[0] == "plate_001"
    assert a.obs["plate"].cat.categories[-1] == "plate_120"


def test_progress(tmp_path, capsys):
    write_tahoe_like(
        tmp_path / "p.h5ad",
        300,
        n_genes=50,
        mean_nnz=10,
        chunk_cells=100,
        progress=True,
    )
    err = capsys.readouterr().err
    assert "write_tahoe_like p.h5ad: 100%" in err and "300/300" in err
    assert err.endswith("\n")
    write_tahoe_like(tmp_path / "q.h5ad", 300, n_genes=50, mean_nnz=10)
    assert capsys.readouterr().err == ""


def test_cached_file_announced_once(tmp_path, capsys):
    """The example's first run says what it makes before the bar starts."""
    kwargs = {"n_genes": 50, "mean_nnz": 10, "cache_dir": tmp_path, "progress": True}
    path = cached_tahoe_like(300, **kwargs)
    err = capsys.readouterr().err
    line = err.splitlines()[0]
    assert line == (
        f"making synthetic data: 300 cells x 50 genes into {path} "
        "(once; later runs reuse it)"
    )
    assert "300/300" in err
    assert cached_tahoe_like(300, **kwargs) == path
    assert capsys.readouterr().err == ""  # reused: nothing to say
    cached_tahoe_like(200, **{**kwargs, "progress": False})
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_cells": 0}, "n_cells must be a positive int, got n_cells=0"),
        ({"n_cells": -3}, "n_cells=-3"),
        ({"n_cells": 2.5}, "n_cells must be a positive int, got n_cells=2.5"),
        ({"n_cells": True}, "n_cells must be a positive int, got n_cells=True"),
        ({"n_genes": 0}, "n_genes must be a positive int, got n_genes=0"),
        ({"n_genes": 2**31}, "n_genes must be <="),
        ({"mean_nnz": 0}, "mean_nnz=0"),
        ({"mean_nnz": float("nan")}, "mean_nnz=nan"),
        ({"mean_nnz": 101}, "mean_nnz=101"),
        ({"n_plates": 0}, "n_plates must be a positive int, got n_plates=0"),
        ({"n_cell_lines": 0}, "n_cell_lines=0"),
        ({"n_drugs": -1}, "n_drugs=-1"),
        ({"seed": -1}, "seed must be a non-negative int, got seed=-1"),
        ({"seed": "a"}, "seed must be a non-negative int, got seed='a'"),
        ({"compression": "zstd"}, "compression='zstd'"),
        ({"dense": 1}, "dense=1"),
        ({"chunk_cells": 0}, "chunk_cells must be a positive int, got chunk_cells=0"),
        ({"progress": "yes"}, "progress='yes'"),
    ],
)
def test_validation(kwargs, message, tmp_path):
    args = {"n_cells": 10, "n_genes": 100, "mean_nnz": 10.0, **kwargs}
    path = tmp_path / "bad.h5ad"
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        write_tahoe_like(path, **args)
    assert not path.exists()  # validated before anything is written


def test_cached_makes_file_once(tmp_path):
    args = {"n_genes": 100, "mean_nnz": 10}
    path = cached_tahoe_like(500, cache_dir=tmp_path, **args)
    assert path.parent == tmp_path
    assert path.name == "tahoe_like-n500-g100-s0-none-nnz10.0.h5ad"
    mtime = os.stat(path).st_mtime_ns
    again = cached_tahoe_like(500, cache_dir=tmp_path, **args)
    assert again == path
    assert os.stat(path).st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert anndata.read_h5ad(path).shape == (500, 100)


def test_cached_names_encode_arguments(tmp_path):
    name = synthetic._cache_name(400_000, synthetic._DEFAULTS)
    assert name == "tahoe_like-n400000-g62710-s0-none.h5ad"
    base = {"n_genes": 100, "mean_nnz": 10}
    names = {
        cached_tahoe_like(50, cache_dir=tmp_path, **base, **extra).name
        for extra in (
            {},
            {"seed": 1},
            {"compression": "lzf"},
            {"dense": True},
            {"n_plates": 3},
            {"chunk_cells": 20},
        )
    }
    assert len(names) == 6
    assert "tahoe_like-n50-g100-s0-lzf-nnz10.0.h5ad" in names
    assert "tahoe_like-n50-g100-s0-none-nnz10.0-dense.h5ad" in names


def test_cached_default_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAIN_CELLS_CACHE", str(tmp_path / "cache"))
    path = cached_tahoe_like(20, n_genes=30, mean_nnz=5)
    assert path.parent == tmp_path / "cache"
    assert path.is_file()


def test_cached_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(path, n_cells, **kwargs):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "write_tahoe_like", boom)
    with pytest.raises(KeyboardInterrupt):
        cached_tahoe_like(20, cache_dir=tmp_path, n_genes=30, mean_nnz=5)
    assert list(tmp_path.iterdir()) == []


def test_cached_rejects_unknown_and_invalid(tmp_path):
    with pytest.raises(TypeError, match="n_gene"):
        cached_tahoe_like(20, cache_dir=tmp_path, n_gene=30)
    with pytest.raises(
        ValueError, match="n_cells must be a positive int, got n_cells=0"
    ):
        cached_tahoe_like(0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="mean_nnz"):
        cached_tahoe_like(20, cache_dir=tmp_path, n_genes=30, mean_nnz=50)
    assert list(tmp_path.iterdir()) == []

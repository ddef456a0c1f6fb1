"""Every stored value dtype reads back as stored, through every read path.

A gzip float16 `.h5ad` once read as wrong numbers with no error (the chunk
decoder copied 2-byte values into 4-byte rows). These cases cover the other
dtypes a user's X carries (integer counts of every width, float64, both byte
orders) through each reader: plain HDF5 (positional reads), gzip HDF5 (the
chunk decoder), zarr; CSR and dense. Values encode (row, gene) within the
dtype's range; `anndata` reads the oracle.
"""

from __future__ import annotations

import anndata
import h5py
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells.outputs import DenseOutput

N_OBS, N_VARS = 91, 23
LOADER_DTYPES = ("<i8", ">u2")  # the loader's cases (it reads as `read` does)
DTYPES = ["<i1", "<u2", "<i4", "<u4", "<i8", "<f8", ">i4", ">u2", ">f8"]


def _values(dtype: np.dtype) -> np.ndarray:
    """(row, gene) -> a distinct value in `dtype`'s range; a third are zeros."""
    rows, genes = np.meshgrid(np.arange(N_OBS), np.arange(N_VARS), indexing="ij")
    code = rows * N_VARS + genes + 1
    if dtype.kind in "iu" and dtype.itemsize == 1:
        code = code % 120 + 1
    if dtype.kind == "i":
        code = np.where((rows + genes) % 2, code, -code)  # negatives too
    code[(rows * 7 + genes) % 3 == 0] = 0
    return code.astype(dtype.newbyteorder("="))


def _write(path, dtype: np.dtype, dense: bool, fmt: str) -> np.ndarray:
    values = _values(dtype)
    x = values if dense else sp.csr_matrix(values)
    adata = anndata.AnnData(
        X=x,
        obs=pd.DataFrame(index=[f"c{i}" for i in range(N_OBS)]),
        var=pd.DataFrame(index=[f"g{j}" for j in range(N_VARS)]),
    )
    if fmt == "zarr":
        adata.write_zarr(path)
        return values
    adata.write_h5ad(path)
    key = "X" if dense else "X/data"
    with h5py.File(path, "r+") as f:  # stored exactly as `dtype` (byte order too)
        ds = f[key]
        stored, attrs = ds[()].astype(dtype), dict(ds.attrs)
        del f[key]
        kwargs = {}
        if fmt == "gzip":
            kwargs = {"compression": "gzip", "chunks": (13, N_VARS) if dense else (29,)}
        f.create_dataset(key, data=stored, **kwargs)
        f[key].attrs.update(attrs)
    return values


def _stored(path, fmt, dtype) -> np.ndarray:
    """X as anndata reads it (h5py for a big-endian CSR: scipy refuses those)."""
    if fmt == "zarr":
        return _dense(anndata.read_zarr(path).X)
    if dtype.byteorder != ">":
        return _dense(anndata.read_h5ad(path).X)
    with h5py.File(path) as f:
        x = f["X"]
        if isinstance(x, h5py.Dataset):
            return x[()]
        assert x["data"].dtype == dtype  # stored big-endian
        parts = (x["data"][()].astype(dtype.newbyteorder("=")), x["indices"][()])
        return sp.csr_matrix((*parts, x["indptr"][()]), (N_OBS, N_VARS)).toarray()


def _dense(x) -> np.ndarray:
    return x.toarray() if sp.issparse(x) else np.asarray(x)


ZARR_DTYPES = ("<i1", "<u2", "<i8", "<f8")  # anndata writes zarr in native order
CASES = [
    pytest.param(dtype, fmt, marks=[pytest.mark.slow] if slow else [])
    for fmt in ("plain", "gzip", "zarr")
    for dtype in (ZARR_DTYPES if fmt == "zarr" else DTYPES)
    for slow in [fmt == "zarr" or dtype in LOADER_DTYPES]
]


@pytest.mark.parametrize("dense", [False, True], ids=["csr", "dense"])
@pytest.mark.parametrize(("dtype", "fmt"), CASES)
def test_stored_dtype_reads_as_stored(tmp_path, dtype, dense, fmt):
    dtype = np.dtype(dtype)
    path = str(tmp_path / ("x.zarr" if fmt == "zarr" else "x.h5ad"))
    values = _write(path, dtype, dense, fmt)
    np.testing.assert_array_equal(_stored(path, fmt, dtype), values)  # as meant

    source = grain_cells.AnnDataSource(path, block_size=4)
    rows = np.random.default_rng(0).permutation(N_OBS)[:60]
    got = source.read(np.sort(rows)).X
    assert got.dtype == dtype.newbyteorder("=")
    np.testing.assert_array_equal(_dense(got), values[np.sort(rows)])
    if dtype.str not in LOADER_DTYPES:
        return
    # Through the loader: every cell once, each row equal to the file's.
    loader = grain_cells.loader(
        source, batch_size=16, seed=1, num_epochs=1, output=DenseOutput()
    )
    ids, xs = [], []
    for batch in loader:
        ids.append(batch["row_ids"][batch["mask"]])
        xs.append(batch["X"][batch["mask"]])
    ids = np.concatenate(ids)
    np.testing.assert_array_equal(np.sort(ids), np.arange(N_OBS))
    np.testing.assert_array_equal(np.concatenate(xs), values[ids].astype(np.float32))

"""Every format's range reader refuses rows outside its array, by name.

The check is one helper (`formats.checked_ranges`) shared by the positional,
chunk-decoding and h5py readers of `.h5ad` files and the zarr reader.
"""

from __future__ import annotations

import anndata
import numpy as np
import pytest
import scipy.sparse as sp

from grain_cells import formats
from grain_cells.errors import CorruptDataError
from grain_cells.io._h5ad import open_file

N_CELLS = 40


def _adata() -> anndata.AnnData:
    x = sp.random(N_CELLS, 30, density=0.2, format="csr", random_state=0)
    return anndata.AnnData(X=x.astype(np.float32))


def _reader(path, positional: bool, bare: bool = False):
    f = open_file(path)
    fmt = formats.of(f)
    fd = fmt.open_bytes(f, str(path), None, fmt.stat_of(f, str(path)))
    reader = fmt.range_reader(f["X/indices"], str(path), fd if positional else None)
    if bare:  # an uncompressed `.h5ad` array is read by a `formats.PositionalReader`
        assert isinstance(reader, formats.PositionalReader)
    return f, reader


@pytest.mark.parametrize(
    "kind, positional, bare",
    [
        pytest.param("h5ad", True, True, id="positional-reader"),
        pytest.param("h5ad", True, False, id="h5ad-positional"),
        pytest.param("h5ad", False, False, id="h5ad-h5py"),
        pytest.param("h5ad-gzip", True, False, id="h5ad-chunks"),
        pytest.param("zarr", False, False, id="zarr"),
    ],
)
def test_rows_outside_the_array_are_refused_by_name(tmp_path, kind, positional, bare):
    a = _adata()
    if kind == "zarr":
        path = tmp_path / "a.zarr"
        a.write_zarr(path)
    else:
        path = tmp_path / "a.h5ad"
        a.write_h5ad(path, compression="gzip" if kind == "h5ad-gzip" else None)
    f, reader = _reader(path, positional, bare)
    with f:
        n = reader.shape[0]
        out = np.empty(n + 10, reader.dtype)
        with pytest.raises(CorruptDataError, match=rf"X/indices has {n} elements"):
            reader.read(np.array([n - 5]), np.array([n + 5]), out)
        with pytest.raises(CorruptDataError, match=str(path.name)):
            reader.read(np.array([-3]), np.array([2]), out)
        # Empty ranges are dropped before the check; touching ones merge.
        reader.read(np.array([3, 7, n + 50]), np.array([7, 9, n + 50]), out)
        whole = np.empty(n, reader.dtype)
        reader.read(np.array([0]), np.array([n]), whole)
        np.testing.assert_array_equal(out[:6], whole[3:9])

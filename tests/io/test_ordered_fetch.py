"""`fetch_ranges(..., order=)`: a fetch read straight into its shuffled order.

The fetch stage asks for its cells in the order minibatches take them; a
local, uncompressed CSR file is then read with each cell's values placed
where they are used (repeated cells copied after the read), and other
layouts are read in file order as before (`ordered=False`). Checked against
anndata on files whose values encode (row, gene), on chunked, compressed
and dense layouts, with read threads on a cold cache, and with a corrupt
column index, which is still named by row.
"""

from __future__ import annotations

import os

import anndata as ad
import h5py
import numpy as np
import pytest
import scipy.sparse as sp

import grain_cells
from grain_cells import errors

N_CELLS, N_GENES = 3_000, 600


def _matrix(seed=0):
    """CSR whose value at (row, gene) is row * 1000 + gene + 1 (~300 per row)."""
    rng = np.random.default_rng(seed)
    mask = rng.random((N_CELLS, N_GENES)) < 0.5
    rows, cols = np.nonzero(mask)
    values = (rows * 1000 + cols + 1).astype(np.float32)
    return sp.csr_matrix((values, (rows, cols)), shape=(N_CELLS, N_GENES))


def _write(path, layout):
    x = _matrix()
    if layout == "dense":
        ad.AnnData(x.toarray()).write_h5ad(path)
    elif layout == "gzip":
        ad.AnnData(x).write_h5ad(path, compression="gzip")
    else:
        ad.AnnData(x).write_h5ad(path)
    if layout == "chunked":  # small chunks: cells straddle chunk boundaries
        with h5py.File(path, "r+") as f:
            for name in ("data", "indices"):
                values = f["X"][name][...]
                del f["X"][name]
                f["X"].create_dataset(name, data=values, chunks=(997,))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ordered")
    return {
        layout: _write(folder / f"{layout}.h5ad", layout)
        for layout in ("plain", "chunked", "gzip", "dense")
    }


def _fetch(source, starts, stops, order):
    rows = source.fetch_ranges(np.array(starts), np.array(stops), order=order)
    if rows.csr is not None:
        c = rows.csr
        x = sp.csr_matrix(
            (c.data.copy(), c.indices.copy(), c.indptr.copy()), (c.n_rows, N_GENES)
        ).toarray()
    else:
        x = rows.dense.copy()
    return rows, x


@pytest.mark.parametrize(
    ("layout", "ordered"),
    [
        pytest.param("plain", True, id="plain"),
        pytest.param("chunked", True, id="chunked"),
        pytest.param("gzip", False, id="compressed-in-file-order"),
        pytest.param("dense", False, id="dense-in-file-order"),
    ],
)
def test_order_matches_anndata(files, layout, ordered):
    path = files[layout]
    expected = ad.read_h5ad(path).X
    expected = expected.toarray() if sp.issparse(expected) else expected
    starts, stops = [2_000, 5, 700], [2_016, 400, 716]  # not sorted
    n = 16 + 395 + 16
    order = np.random.default_rng(1).permutation(n)
    order = np.concatenate([order, order[:40]])  # a block drawn twice
    source = grain_cells.AnnDataSource(path)
    try:
        rows, x = _fetch(source, starts, stops, order)
    finally:
        source.close()
    in_file_order = np.r_[5:400, 700:716, 2_000:2_016]
    assert rows.ordered is ordered
    want = in_file_order[order] if ordered else in_file_order
    np.testing.assert_array_equal(rows.row_ids, want)
    np.testing.assert_array_equal(x, expected[want])


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_read_threads_place_every_cell(files, cache):
    path = files["plain"]
    expected = ad.read_h5ad(path).X.toarray()
    starts = np.arange(0, N_CELLS, 16)
    stops = np.minimum(starts + 16, N_CELLS)  # every cell: 3.6 MB, two threads
    order = np.random.default_rng(2).permutation(N_CELLS)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cache == "warm":
            os.pread(fd, os.path.getsize(path), 0)
    finally:
        os.close(fd)
    source = grain_cells.AnnDataSource(path, read_threads=2)
    try:
        rows, x = _fetch(source, starts, stops, order)
    finally:
        source.close()
    assert rows.ordered
    np.testing.assert_array_equal(x, expected[order])


def test_order_must_cover_every_row(files):
    source = grain_cells.AnnDataSource(files["plain"])
    try:
        with pytest.raises(ValueError, match="at least once"):
            source.fetch_ranges(np.array([0]), np.array([4]), order=np.array([0, 1, 1]))
    finally:
        source.close()


def test_corrupt_column_index_is_named_by_row(tmp_path):
    path = _write(tmp_path / "bad.h5ad", "plain")
    with h5py.File(path, "r+") as f:
        first = int(f["X/indptr"][7])
        f["X/indices"][first + 2] = N_GENES + 5  # row 7
    source = grain_cells.AnnDataSource(path)
    try:
        with pytest.raises(errors.CorruptDataError, match="row 7;"):
            source.fetch_ranges(
                np.array([0]), np.array([16]), order=np.arange(16)[::-1]
            )
    finally:
        source.close()

"""`take_csr`: rows of a CSR read buffer gathered in any order.

Every minibatch of a CSR output is one `take_csr` of a fetch buffer. Rows
come shuffled (one slice each), in runs of consecutive rows (one slice per
run), repeated, or padded with empty rows; values are copied as raw bytes
when no cast is needed and through NumPy otherwise (a float64 file read as
float32, int64 column indices). Checked against SciPy's row indexing.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from grain_cells.io._cells import take_csr
from grain_cells.io._matrix import CsrRows


def _buffer(data_dtype, index_dtype):
    rng = np.random.default_rng(0)
    m = sp.random(200, 300, density=0.1, format="csr", random_state=1)
    m.data = (np.arange(m.nnz) + 1).astype(data_dtype)  # each value distinct
    rows = CsrRows(
        m.data,
        m.indices.astype(index_dtype),
        m.indptr.astype(np.int64),
        m.shape[1],
    )
    return m, rows, rng


@pytest.mark.parametrize(
    ("data_dtype", "index_dtype", "out_dtype"),
    [
        pytest.param(np.float32, np.int32, "float32", id="bytes"),
        pytest.param(np.float32, np.int32, None, id="bytes-file-dtype"),
        pytest.param(np.float64, np.int32, "float32", id="cast-data"),
        pytest.param(np.float32, np.int64, "float32", id="cast-indices"),
    ],
)
@pytest.mark.parametrize(
    "pick",
    [
        pytest.param(lambda rng: rng.permutation(200)[:64], id="shuffled"),
        pytest.param(lambda rng: np.r_[10:40, 100:110, 5, 6, 7], id="runs"),
        pytest.param(lambda rng: np.array([3, 3, 4, 3, 199, 0]), id="repeats"),
        pytest.param(lambda rng: np.zeros(0, np.int64), id="none"),
    ],
)
def test_matches_scipy(data_dtype, index_dtype, out_dtype, pick):
    m, buffer, rng = _buffer(data_dtype, index_dtype)
    rows = pick(rng)
    data, indices, indptr = take_csr(buffer, rows, dtype=out_dtype, n_rows=70)
    want = m[rows]
    n = rows.size
    assert data.dtype == np.dtype(out_dtype or data_dtype)
    assert indices.dtype == np.int32 and indptr.dtype == np.int64
    np.testing.assert_array_equal(indptr[: n + 1], want.indptr)
    np.testing.assert_array_equal(indptr[n + 1 :], want.nnz)  # empty padding rows
    np.testing.assert_array_equal(indices, want.indices)
    np.testing.assert_array_equal(data, want.data.astype(data.dtype))


def test_gathers_of_one_buffer_share_its_offsets():
    """A fetch's minibatches are gathers of one buffer: offsets made once."""
    m, buffer, rng = _buffer(np.float32, np.int32)
    for _ in range(3):
        rows = rng.permutation(200)[:64]
        data, indices, indptr = take_csr(buffer, rows, dtype="float32")
        want = m[rows]
        np.testing.assert_array_equal(indptr, want.indptr)
        np.testing.assert_array_equal(indices, want.indices)
        np.testing.assert_array_equal(data, want.data)
    assert buffer.spans is not None

"""Cells read from a source, and the vectorised gathers that produce them.

`Cells` is what `AnnDataSource.read` returns: the expression rows (a SciPy CSR
matrix or a dense array), the chosen obs columns and each row's global id.
`take_csr` picks rows out of a CSR read buffer in any order; it is shared by
the source's public reads and the output formats. Read buffers are already
in output columns (genes aligned and selected per file as they are read, see
`grain_cells.io._genes`), so dense rows need only `buffer[rows]`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from grain_cells.io._matrix import CsrRows

if TYPE_CHECKING:  # workers never build a csr_matrix: no scipy at their start
    import scipy.sparse as sp


@dataclasses.dataclass
class Cells:
    """Rows of a source in the order they were asked for.

    Attributes:
        X: `scipy.sparse.csr_matrix` for sparse files, `np.ndarray` for dense.
        obs: obs column name to one value per row (integer codes for
            categorical columns; see `AnnDataSource.categories`).
        row_ids: Global row id (0-based over the concatenated files) per row.
    """

    X: sp.csr_matrix | np.ndarray
    obs: dict[str, np.ndarray]
    row_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.row_ids.shape[0])


def take_csr(
    rows_buf: CsrRows, rows: np.ndarray, *, dtype=None, n_rows=None, empty=np.empty
):
    """Gathers `rows` of a CSR buffer into fresh arrays.

    Args:
        rows_buf: Rows read into a buffer.
        rows: Positions within the buffer, in output order (repeats allowed).
        dtype: dtype of `data` (cast while copying); None keeps the buffer's.
        n_rows: Rows of the result (at least `rows.size`): empty rows pad
            the end. None: `rows.size`.
        empty: Allocates the results (`np.empty`'s signature; see
            `grain_cells.transport._slot_writer`).

    Returns:
        `(data, indices, indptr)`: fresh arrays; indices are int32, indptr
        int64.
    """
    rows = np.asarray(rows, np.int64)
    n = rows.size
    src = rows_buf.indptr
    begin = src[rows]
    end = src[rows + 1]
    n_rows = n if n_rows is None else int(n_rows)
    indptr = empty((n_rows + 1,), np.int64)
    indptr[0] = 0
    np.cumsum(end - begin, out=indptr[1 : n + 1])
    total = int(indptr[n])
    indptr[n + 1 :] = total
    data = empty((total,), rows_buf.data.dtype if dtype is None else dtype)
    indices = empty((total,), np.int32)
    if n == 0:
        return data, indices, indptr
    follows = rows[1:] == rows[:-1] + 1
    if follows.any():
        # Runs of rows that follow each other in the buffer copy as one slice.
        breaks = np.flatnonzero(~follows) + 1
        heads = np.concatenate([[0], breaks])
        tails = np.concatenate([breaks, [n]])
        runs = (begin[heads], end[tails - 1], indptr[heads], indptr[tails])
    else:  # shuffled rows: one slice each
        runs = (begin, end, indptr[:n], indptr[1 : n + 1])
    pairs = ((data, rows_buf.data), (indices, rows_buf.indices))
    views = [_as_bytes(d, s) for d, s in pairs]
    if all(v is not None for v in views) and data.itemsize == indices.itemsize:
        # Both arrays as raw bytes in one loop, without a NumPy view per slice.
        k = data.itemsize
        (d_data, s_data), (d_idx, s_idx) = ([memoryview(x) for x in v] for v in views)
        for a, b, c, d in zip(*((r * k).tolist() for r in runs), strict=True):
            d_data[c:d] = s_data[a:b]
            d_idx[c:d] = s_idx[a:b]
    else:
        for dst, src_ in pairs:
            _copy_runs(dst, src_, *runs)
    return data, indices, indptr


def _as_bytes(dst: np.ndarray, src: np.ndarray):
    """`(dst, src)` as uint8 arrays when a byte copy is a faithful one, else None."""
    if dst.dtype != src.dtype or not (
        dst.flags.c_contiguous and src.flags.c_contiguous
    ):
        return None
    return dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)


def _copy_runs(dst, src, s_from, s_to, d_from, d_to) -> None:
    """`dst[d_from[i]:d_to[i]] = src[s_from[i]:s_to[i]]` for every run i."""
    both = _as_bytes(dst, src)
    if both is not None:
        k = dst.itemsize
        d_view, s_view = (memoryview(x) for x in both)
        runs = zip(
            *((r * k).tolist() for r in (s_from, s_to, d_from, d_to)), strict=True
        )
        for a, b, c, d in runs:
            d_view[c:d] = s_view[a:b]
        return
    for a, b, c, d in zip(
        s_from.tolist(), s_to.tolist(), d_from.tolist(), d_to.tolist(), strict=True
    ):
        dst[c:d] = src[a:b]  # casts (e.g. int64 indices to int32)

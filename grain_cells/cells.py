"""Cells read from a source, and the vectorised gathers that produce them.

`Cells` is what `AnnDataSource.read` returns: the expression rows (a SciPy CSR
matrix or a dense array), the chosen obs columns and each row's global id.
`take_csr` and `take_dense` pick rows out of a read buffer in any order and
apply a gene subset in the same pass; they are shared by the source's public
reads and the batched-fetch transform.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from grain_cells.matrix import CsrRows


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


def csr_gather_index(indptr: np.ndarray, rows: np.ndarray):
    """Source positions and row pointers for gathering `rows` of a CSR buffer.

    Returns:
        `(positions, out_indptr)`: `data[positions]` are the stored values of
        `rows` in order, and `out_indptr` their int64 row pointers.
    """
    begin = indptr[rows]
    lengths = indptr[rows + 1] - begin
    out_indptr = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lengths, out=out_indptr[1:])
    total = int(out_indptr[-1])
    positions = np.arange(total, dtype=np.int64)
    positions += np.repeat(begin - out_indptr[:-1], lengths)
    return positions, out_indptr


def take_csr(rows_buf: CsrRows, rows: np.ndarray,
             column_map: np.ndarray | None = None):
    """Gathers `rows` of a CSR buffer, optionally keeping a gene subset.

    Args:
        rows_buf: Rows read into a buffer.
        rows: Positions within the buffer, in output order (repeats allowed).
        column_map: For a gene subset, the output column of each stored
            column, or -1 to drop it.

    Returns:
        `(data, indices, indptr)`: fresh arrays; indices are int32.
    """
    positions, indptr = csr_gather_index(rows_buf.indptr, rows)
    indices = rows_buf.indices[positions]
    data = rows_buf.data[positions]
    if column_map is None:
        return data, indices.astype(np.int32, copy=False), indptr
    mapped = column_map[indices]
    keep = mapped >= 0
    kept = np.zeros(keep.size + 1, np.int64)
    np.cumsum(keep, out=kept[1:])
    return data[keep], mapped[keep], kept[indptr]


def take_dense(dense_buf: np.ndarray, rows: np.ndarray,
               columns: np.ndarray | None = None) -> np.ndarray:
    """Gathers `rows` (and a gene subset) of a dense buffer into a new array."""
    if columns is None:
        return dense_buf[rows]
    return dense_buf[np.ix_(rows, columns)]

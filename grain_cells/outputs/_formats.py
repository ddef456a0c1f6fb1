"""Output formats of a minibatch: CSR, padded sparse (static shapes), dense.

Every minibatch is a dict of NumPy arrays with, besides the expression:

* `row_ids` (int64 `[batch]`): global row id of each cell (-1 for padding);
* `mask` (bool `[batch]`): True for real cells, False for padding;
* `obs/<column>` (`[batch]`): the chosen obs columns (integer codes for
  categorical columns, see `AnnDataSource.categories`; 0 for padding).

and the expression in one of three formats:

* `CsrOutput`: `data` `[nnz]`, `indices` (int32 `[nnz]`) and `indptr`
  (int64 `[batch + 1]`); padding rows are empty. Shapes vary per batch.
* `PaddedSparseOutput(width=None)`: `values` `[batch, width]`, `indices`
  (int32 `[batch, width]`), `nnz` (int32 `[batch]`, the stored values the
  cell really has) and `truncated` (bool `[batch]`, `nnz > width`). Static
  shapes for `jax.jit`; unused slots hold index 0 and value 0, so
  scatter-adding them is harmless (see
  `grain_cells.outputs._densify.densify`). With `width=None` (the default)
  the width is fitted once from a deterministic sample of the source when the
  pipeline is built (the 99.9th percentile of stored values per cell, rounded
  up to a multiple of 128: `grain_cells.outputs._width`). A cell with more
  than `width` stored values is never cut silently: by the policy `truncate`,
  `"largest"` (default) keeps its `width` largest values (ties: lower column
  first), `"first"` keeps its first `width` values in column order, and
  either marks the cell in `truncated`, and the loader warns once, in the
  trainer, with the figures (`errors.TruncationWarning`; a fitted width only
  when it cuts clearly more cells than its quantile leaves out:
  `grain_cells.outputs._padded.TruncationReport`);
  `"error"` raises `errors.TruncationError` naming the cell.
  ("Column order" is the stored order where a source's `join` or `genes`
  reorders a file's genes; see `AnnDataSource`.)
* `DenseOutput()`: `X` `[batch, genes]` in `dtype` (float32 by default) over
  all genes or the source's gene subset. A dense minibatch over 62,710 genes
  is 250 KB per cell: subset genes, or use padded sparse and densify on the
  accelerator.

A row that stores one column more than once (a duplicate index, which SciPy
and anndata allow) means the sum of its values, in every format: CSR and
padded outputs keep the duplicates (`densify` and SciPy add them), while
`DenseOutput` and `AnnDataSource.read(...).X.toarray()` add them.

Token sequences for transformer foundation models (`RankValueTokens`,
`ValueBinTokens`) are further implementations of the same protocol; see
`grain_cells.tokens`.

The protocol every format implements, the `Fetch` it formats from and the
helpers formats share live in `grain_cells.outputs._protocol`; the padded
format in `grain_cells.outputs._padded`. This module re-exports them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grain_cells._util import arguments
from grain_cells.io._cells import take_csr
from grain_cells.io._matrix import CsrRows
from grain_cells.outputs._padded import TRUNCATE, PaddedSparseOutput
from grain_cells.outputs._protocol import (
    Fetch,
    Output,
    declared,
    dtype_name,
    zeros,
)

__all__ = [
    "TRUNCATE",
    "CsrOutput",
    "CsrRows",
    "DenseOutput",
    "Fetch",
    "Output",
    "PaddedSparseOutput",
    "declared",
    "dtype_name",
    "zeros",
]


@dataclasses.dataclass(frozen=True)
class CsrOutput(Output):
    """CSR pieces per minibatch (`data`, `indices`, `indptr`).

    Attributes:
        dtype: dtype of `data`; None keeps the file's dtype.
    """

    dtype: str | None = "float32"

    def __post_init__(self):
        arguments.check_dtype("dtype", self.dtype, optional=True)

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int, empty=np.empty
    ) -> dict[str, np.ndarray]:
        """Gathers `rows` of the buffer into CSR arrays padded to batch_size."""
        data, indices, indptr = take_csr(
            fetch.csr, rows, dtype=self.dtype, n_rows=batch_size, empty=empty
        )
        return {"data": data, "indices": indices, "indptr": indptr}

    def fingerprint(self) -> dict:
        """What a checkpoint records of this output (see the module docstring)."""
        return {"class": type(self).__name__, "dtype": dtype_name(self.dtype)}


@dataclasses.dataclass(frozen=True)
class DenseOutput(Output):
    """A dense `X` `[batch, genes]` per minibatch.

    Attributes:
        dtype: dtype of `X`.
    """

    dtype: str = "float32"

    def __post_init__(self):
        arguments.check_dtype("dtype", self.dtype)

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int, empty=np.empty
    ) -> dict[str, np.ndarray]:
        """Scatters `rows` into a zeroed `[batch_size, n_genes]` array.

        Rows of a dense file are gathered as they are.
        """
        if fetch.dense is not None:
            return self.format_dense(fetch.dense, rows, batch_size, empty)
        data, indices, indptr = take_csr(fetch.csr, rows)
        n_genes = fetch.n_genes
        X = zeros(empty, (batch_size, n_genes), self.dtype)
        flat = np.repeat(
            np.arange(rows.size, dtype=np.int64) * n_genes, np.diff(indptr)
        )
        flat += indices
        out, values = X.reshape(-1), data.astype(X.dtype, copy=False)
        if _all_distinct(flat):
            out[flat] = values
        else:  # a row stores a column twice: sum, as SciPy and anndata do
            np.add.at(out, flat, values)
        return {"X": X}

    def format_dense(
        self, dense: np.ndarray, rows: np.ndarray, batch_size: int, empty=np.empty
    ) -> dict[str, np.ndarray]:
        """Gathers `rows` of a dense buffer (already in output columns)."""
        X = empty((batch_size, dense.shape[1]), self.dtype)
        X[: rows.size] = dense[rows]
        X[rows.size :] = 0
        return {"X": X}

    def fingerprint(self) -> dict:
        """What a checkpoint records of this output (see the module docstring)."""
        return {"class": type(self).__name__, "dtype": dtype_name(self.dtype)}


def _all_distinct(flat: np.ndarray) -> bool:
    """Whether no position repeats (cheap when rows store sorted columns).

    Assignment is about 5x faster than `np.add.at` at minibatch sizes, so it
    is used whenever no row holds a duplicate column.
    """
    if flat.size < 2 or (flat[1:] > flat[:-1]).all():
        return True
    ordered = np.sort(flat)
    return bool((ordered[1:] != ordered[:-1]).all())

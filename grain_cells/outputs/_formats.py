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
  either warns once per process with the figures
  (`errors.TruncationWarning`) and marks the cell in `truncated`;
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

**The protocol.** An output format is any object that pickles and has
`format(fetch, rows, batch_size) -> dict[str, np.ndarray]`: `fetch` is the
`Fetch` being split (its rows, their row ids, the fetch's random key and a
per-fetch cache for work done once per fetch), `rows` the positions in the
fetch of the minibatch's real cells (at most `batch_size`), and every array
returned has `batch_size` rows (padding rows after the real ones), except
CSR's flat arrays. `format` may also take a keyword `empty` (a function
with `np.empty`'s signature): the built-in formats allocate every array they
return with it, and in a Grain worker it hands out the worker's shared
memory, so the minibatch is written where the trainer copies it from
(`grain_cells.transport._slot_writer`); formats without it work as before.
An output may also have `fit_to_source(source, read=None) -> output`: a
pipeline calls it once when it is built, in the building process, and uses
(and checkpoints) the output it returns (`PaddedSparseOutput(width=None)`
fits its width so).

**Checkpoints.** A saved iterator state records the output's configuration:
`fingerprint() -> dict`, of JSON values (class name and every parameter that
changes the arrays; see `fingerprint_of`). An output without the method is
recorded by its `repr`, which must then be stable: a state restores only
under an output of equal fingerprint (or repr).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Protocol, runtime_checkable

import numpy as np

from grain_cells import errors
from grain_cells._util import arguments
from grain_cells.io._cells import take_csr
from grain_cells.io._matrix import CsrRows
from grain_cells.outputs import _width


@dataclasses.dataclass
class Fetch:
    """The rows of one fetch, as output formats see them.

    Attributes:
        dense: The rows as a dense array when the files are dense, else None.
        row_ids: Global row id of each fetched row.
        n_genes: Output columns.
        key: A 64-bit key of the fetch (its seed and blocks): random choices
            of an output are functions of `(key, row id, ...)`, so a restored
            iterator repeats them.
        cache: Work an output does once per fetch, keyed by the output.
        order: The fetch's rows in the order its minibatches take them,
            minibatch `i` being `order[i * batch_size:(i + 1) * batch_size]`
            (the last may be shorter); None when minibatches are cut
            otherwise (one condition each) or the fetch is not split. An
            output may format every minibatch at once from it (see
            `grain_cells.tokens._base`).
    """

    dense: np.ndarray | None
    row_ids: np.ndarray
    n_genes: int
    key: int = 0
    cache: dict = dataclasses.field(default_factory=dict)
    _csr: CsrRows | None = None
    order: np.ndarray | None = None

    @property
    def csr(self) -> CsrRows:
        """The rows as CSR (converted once per fetch from a dense file)."""
        if self._csr is None:
            import scipy.sparse as sp  # here: workers of CSR files never need it

            m = sp.csr_matrix(self.dense)
            self._csr = CsrRows(
                m.data, m.indices, m.indptr.astype(np.int64), self.dense.shape[1]
            )
        return self._csr


@runtime_checkable
class Output(Protocol):
    """What an output format implements (see the module docstring)."""

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int
    ) -> dict[str, np.ndarray]:
        """Formats the fetch's `rows` as one minibatch of `batch_size` rows."""
        ...


@dataclasses.dataclass(frozen=True)
class CsrOutput:
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


TRUNCATE = ("largest", "first", "error")


@dataclasses.dataclass(frozen=True)
class PaddedSparseOutput:
    """Fixed-width sparse rows for `jax.jit`: `values`, `indices`, `nnz`, `truncated`.

    Attributes:
        width: Stored values kept per cell; None (default) fits it to the
            source when the pipeline is built: the `quantile` of stored
            values per cell over a deterministic sample of up to 4,096
            cells, rounded up to a multiple of 128 (see
            `grain_cells.outputs._width`). `fit_to_source(source)` returns
            the fitted output, e.g. to read its width.
        truncate: For a cell with more than `width` stored values:
            `"largest"` keeps its `width` largest values (ties: lower column
            first), `"first"` its first `width` in column order; both set
            its `truncated` flag and warn once per process
            (`errors.TruncationWarning`, with the figures). `"error"` raises
            `errors.TruncationError` naming the cell, its count and the width.
        dtype: dtype of `values`.
        quantile: Which quantile of the sampled counts a fitted width
            covers (used only when `width` is None); 1.0 takes the widest
            sampled cell.

    Example:
        >>> output = PaddedSparseOutput().fit_to_source(source)  # as a pipeline
        >>> output.width
        1280
    """

    width: int | None = None
    truncate: str = "largest"
    dtype: str = "float32"
    quantile: float = 0.999

    def __post_init__(self):
        if self.width is not None:
            arguments.check_int("width", self.width, minimum=1)
        arguments.check_dtype("dtype", self.dtype)
        arguments.check_choice("truncate", self.truncate, TRUNCATE)
        q = self.quantile
        if isinstance(q, (bool, np.bool_)) or not isinstance(q, (int, float)):
            raise arguments.ArgumentTypeError(
                f"quantile must be a number in (0, 1], got quantile={q!r}"
            )
        if not 0 < q <= 1:
            raise ValueError(f"quantile must lie in (0, 1], got quantile={q!r}")

    def fit_to_source(self, source, read=None) -> PaddedSparseOutput:
        """This output with its width fitted to `source` (itself if it has one).

        Args:
            source: The `AnnDataSource` (or view) the pipeline reads.
            read: The reader of another matrix than X (an extra `Layer`).
        """
        if self.width is not None:
            return self
        width = _width.fit_width(source, self.quantile, read)
        return dataclasses.replace(self, width=width)

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int, empty=np.empty
    ) -> dict[str, np.ndarray]:
        """Copies `rows` into `[batch_size, width]` padded arrays, row by row."""
        if self.width is None:
            raise ValueError(
                "PaddedSparseOutput(width=None) has no width yet: a pipeline "
                "fits it when it is built; to format by hand, use "
                "PaddedSparseOutput().fit_to_source(source) or pass width=..."
            )
        csr = fetch.csr
        data, indices, indptr = csr.data, csr.indices, csr.indptr
        begin = indptr[rows]
        lengths = indptr[rows + 1] - begin
        w = self.width
        over = lengths > w
        if over.any():
            self._report(over, lengths, fetch.row_ids[rows])
        values = zeros(empty, (batch_size, w), self.dtype)
        cols = zeros(empty, (batch_size, w), np.int32)
        largest = self.truncate == "largest"
        for r, (a, n) in enumerate(zip(begin.tolist(), lengths.tolist(), strict=True)):
            if n <= w:
                values[r, :n] = data[a : a + n]
                cols[r, :n] = indices[a : a + n]
            elif largest:  # the w largest values, ties to the lower column
                keep = a + np.sort(np.argsort(-data[a : a + n], kind="stable")[:w])
                values[r] = data[keep]
                cols[r] = indices[keep]
            else:
                values[r] = data[a : a + w]
                cols[r] = indices[a : a + w]
        nnz = zeros(empty, (batch_size,), np.int32)
        nnz[: lengths.size] = lengths
        truncated = zeros(empty, (batch_size,), bool)
        truncated[: lengths.size] = over
        return {"values": values, "indices": cols, "nnz": nnz, "truncated": truncated}

    def _report(self, over: np.ndarray, lengths: np.ndarray, row_ids) -> None:
        """Raises (`truncate="error"`) or warns once about truncated cells."""
        w, widest = self.width, int(np.argmax(lengths))
        if self.truncate == "error":
            r = int(np.flatnonzero(over)[0])
            raise errors.TruncationError(
                f"cell {int(row_ids[r])} (global row id) has {int(lengths[r])} "
                f"stored values, more than PaddedSparseOutput(width={w}) holds "
                "(truncate='error'); give a larger width (or, for a width fitted "
                "to the data, a higher quantile such as quantile=1.0), or "
                "choose truncate='largest' or 'first'"
            )
        if self.__dict__.get("_warned"):
            return
        object.__setattr__(self, "_warned", True)  # once per process
        kept = "largest" if self.truncate == "largest" else "first (column order)"
        warnings.warn(
            f"PaddedSparseOutput(width={w}): {int(over.sum())} of {lengths.size} "
            f"cells of a minibatch have more stored values than width (up to "
            f"{int(lengths[widest])}, cell {int(row_ids[widest])}); each keeps "
            f"its {w} {kept} values. batch['truncated'] marks such cells in "
            "every minibatch; this warning is shown once per process. Give a "
            "larger width (or, for a width fitted to the data, a higher "
            "quantile such as quantile=1.0), or pass truncate='error' to "
            "refuse such cells.",
            errors.TruncationWarning,
            stacklevel=2,
        )

    def fingerprint(self) -> dict:
        """What a checkpoint records of this output (see the module docstring).

        The width recorded is the fitted one (a pipeline fits before it
        records), so a restore that fits another width is refused.
        """
        fp = {
            "class": type(self).__name__,
            "width": None if self.width is None else int(self.width),
            "truncate": self.truncate,
            "dtype": dtype_name(self.dtype),
        }
        if self.width is None:
            fp["quantile"] = float(self.quantile)
        return fp


@dataclasses.dataclass(frozen=True)
class DenseOutput:
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


def fingerprint_of(component) -> dict | str:
    """What a checkpoint records of an output (or a sampler, a matrix spec).

    Its `fingerprint()` when it has one: a dict of JSON values naming its
    class and the parameters that decide what it yields. Otherwise (a user's
    own component) its `repr`, which must then be stable.
    """
    method = getattr(component, "fingerprint", None)
    if callable(method):
        return method()
    return repr(component)


def dtype_name(dtype) -> str | None:
    """A dtype as a fingerprint records it (`"float32"`; None stays None)."""
    if dtype is None:
        return None
    try:
        return np.dtype(dtype).name
    except TypeError:  # a name NumPy does not know
        return str(dtype)


def zeros(empty, shape: tuple, dtype) -> np.ndarray:
    """`np.zeros` through an allocator with `np.empty`'s signature."""
    out = empty(shape, dtype)
    out[...] = 0
    return out


@functools.cache
def takes_empty(output_type: type) -> bool:
    """Whether an output type's `format` takes the keyword `empty`."""
    try:
        params = inspect.signature(output_type.format).parameters
    except (TypeError, ValueError):
        return False
    return "empty" in params


def format_with(output, fetch: Fetch, rows, batch_size: int, empty=np.empty):
    """`output.format(...)`, passing `empty` when the output takes it."""
    if empty is not np.empty and takes_empty(type(output)):
        return output.format(fetch, rows, batch_size, empty=empty)
    return output.format(fetch, rows, batch_size)


def _all_distinct(flat: np.ndarray) -> bool:
    """Whether no position repeats (cheap when rows store sorted columns).

    Assignment is about 5x faster than `np.add.at` at minibatch sizes, so it
    is used whenever no row holds a duplicate column.
    """
    if flat.size < 2 or (flat[1:] > flat[:-1]).all():
        return True
    ordered = np.sort(flat)
    return bool((ordered[1:] != ordered[:-1]).all())

"""Output formats of a minibatch: the `Output` protocol, its `Fetch`, CSR, dense.

Design notes: docs/reference/design.md#outputs-protocol and #outputs-formats.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grain_cells._util import arguments
from grain_cells.io import CsrRows, take_csr


@dataclasses.dataclass
class Fetch:
    """The rows of one fetch, as output formats see them.

    `dense` (dense files) or `csr`; `key`: the fetch's 64-bit key (random choices are
    functions of `(key, row id, ...)`); `cache`: an output's once-per-fetch work;
    `order`: the rows in minibatch order (minibatch `i` is `order[i * batch_size:
    (i + 1) * batch_size]`), None when minibatches are cut otherwise.
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


class Output:
    """An output format: turns rows of a fetch into one minibatch's arrays.

    Subclass it and define `format`; `fit_to_source` and `fingerprint` have
    defaults. An output must pickle (workers receive it).
    """

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int, empty=np.empty
    ) -> dict[str, np.ndarray]:
        """Formats the fetch's `rows` as one minibatch of `batch_size` rows.

        `rows` are positions in `fetch` of the minibatch's real cells (at
        most `batch_size`); every array returned has `batch_size` rows
        (padding after the real ones), CSR's flat arrays aside. `empty`
        (`np.empty`'s signature) allocates them: in a worker, in the shared
        memory the minibatch is sent in; arrays made otherwise are copied.
        """
        raise NotImplementedError

    def fit_to_source(self, source, read=None) -> Output:
        """The output a pipeline over `source` uses (and checkpoints); this one.

        Called once, when the pipeline is built (a fitted width, say).

        Args:
            source: The `AnnDataSource` (or view) the pipeline reads.
            read: The reader of another matrix than X (an extra `Layer`).
        """
        return self

    def fingerprint(self) -> dict | str:
        """What a checkpoint records: JSON values naming the class and every parameter.

        By default the `repr`, which must then be stable.
        """
        return repr(self)


class _Declared(Output):
    """A user's output that does not subclass `Output`: the defaults."""

    def __init__(self, output):
        self.output = output

    def format(self, fetch, rows, batch_size, empty=np.empty):
        return self.output.format(fetch, rows, batch_size)

    def __repr__(self) -> str:
        return repr(self.output)


def declared(output, name: str = "output") -> Output:
    """`output` as an `Output`: itself, or a user's object given the defaults;
    `TypeError` unless it has `format(fetch, rows, batch_size)`.
    """  # noqa: D205
    if isinstance(output, (str, bytes, type)) or not callable(
        getattr(output, "format", None)
    ):
        raise arguments.ArgumentTypeError(
            f"{name} must be an output format (CsrOutput(), "
            "PaddedSparseOutput(), DenseOutput(), RankValueTokens, "
            "ValueBinTokens or any object with format(fetch, rows, "
            f"batch_size)), got {name}={output!r}"
        )
    return output if isinstance(output, Output) else _Declared(output)


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


def padded(empty, values: np.ndarray, rows: int, dtype=None, fill=0) -> np.ndarray:
    """`values` (as `dtype`), then `fill`, in a new `[rows, ...]` array by `empty`."""
    out = empty((rows, *values.shape[1:]), values.dtype if dtype is None else dtype)
    out[: len(values)] = values
    out[len(values) :] = fill
    return out


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
        """What a checkpoint records of this output: its class and dtype."""
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
        """Scatters `rows` into a zeroed `[batch_size, n_genes]` array."""
        if fetch.dense is not None:  # already in output columns
            return {"X": padded(empty, fetch.dense[rows], batch_size, self.dtype)}
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

    fingerprint = CsrOutput.fingerprint


def _all_distinct(flat: np.ndarray) -> bool:
    """Whether no position repeats (then assignment, 5x faster than `np.add.at`)."""
    if flat.size < 2 or (flat[1:] > flat[:-1]).all():
        return True
    ordered = np.sort(flat)
    return bool((ordered[1:] != ordered[:-1]).all())

"""What an output format is: the `Output` base, the `Fetch` it reads, helpers.

`Output` declares the protocol: `format(fetch, rows, batch_size, empty)` and, with
defaults, `fit_to_source(source, read)` and `fingerprint()`; any object with
`format(fetch, rows, batch_size)` works through `declared(output)`. A checkpoint
restores only under an output of equal fingerprint. Design notes:
docs/reference/design.md#outputs-protocol.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grain_cells.io import CsrRows


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
        """The output a pipeline over `source` uses; by default this one.

        Called once when the pipeline is built, in the building process; the
        pipeline uses (and checkpoints) what it returns
        (`PaddedSparseOutput(width=None)` fits its width so).

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


def declared(output) -> Output:
    """`output` as an `Output`: itself, or a user's object given the defaults."""
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

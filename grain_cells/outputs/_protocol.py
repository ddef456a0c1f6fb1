"""What an output format is: the protocol, the `Fetch` it reads, shared helpers.

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

Design notes: docs/reference/design.md#outputs-protocol.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class Output(Protocol):
    """What an output format implements (see the design notes)."""

    def format(
        self, fetch: Fetch, rows: np.ndarray, batch_size: int
    ) -> dict[str, np.ndarray]:
        """Formats the fetch's `rows` as one minibatch of `batch_size` rows."""
        ...


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

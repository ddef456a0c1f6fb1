"""`PaddedSparseOutput`: fixed-width sparse rows for `jax.jit` (static shapes).

See `grain_cells.outputs._formats` for what its arrays hold, and
`grain_cells.outputs._width` for the width fitted from a sample.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from grain_cells import errors
from grain_cells._util import arguments
from grain_cells.outputs import _width
from grain_cells.outputs._protocol import Fetch, dtype_name, zeros

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

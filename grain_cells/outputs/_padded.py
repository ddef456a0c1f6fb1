"""`PaddedSparseOutput`: fixed-width sparse rows for `jax.jit` (static shapes).

What its arrays hold, and how its width is fitted from a sample of cells:
docs/reference/design.md#outputs-formats and #outputs-width.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np

from grain_cells import errors
from grain_cells._util import arguments, stack
from grain_cells.io import RowBuffer
from grain_cells.outputs._formats import Fetch, Output, dtype_name, padded, zeros

TRUNCATE = ("largest", "first", "error")
_MARGIN_CELLS = 10  # cells a fitted width may cut beyond twice its quantile's share
SAMPLE_CELLS = 4096  # cells a width is fitted on, in evenly spaced blocks
WIDTH_MULTIPLE = 128  # a fitted width's multiple (lanes of a vector unit)


@dataclasses.dataclass(frozen=True)
class PaddedSparseOutput(Output):
    """Fixed-width sparse rows for `jax.jit`: `values`, `indices`, `nnz`, `truncated`.

    Attributes:
        width: Stored values kept per cell; None: the `quantile` of a sample
            of the source, fitted when the pipeline is built (design notes).
        truncate: For a cell with more than `width` stored values:
            `"largest"` keeps its `width` largest values, `"first"` its first
            (both flag it in `truncated`; the loader warns once); `"error"`
            raises `errors.TruncationError`.
        dtype: dtype of `values`.
        quantile: The quantile of the sampled counts a fitted width covers;
            1.0 takes the widest sampled cell.

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

        See `Output.fit_to_source`.
        """
        if self.width is not None:
            return self
        width = fit_width(source, self.quantile, read)
        fitted = dataclasses.replace(self, width=width)
        object.__setattr__(fitted, "_fitted", True)  # not a field: same fingerprint
        return fitted

    @property
    def fitted(self) -> bool:
        """Whether `width` was fitted to the data (`fit_to_source`)."""
        return bool(self.__dict__.get("_fitted"))

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
        if self.truncate == "error" and over.any():
            r = int(np.flatnonzero(over)[0])
            raise errors.TruncationError(
                f"cell {int(fetch.row_ids[rows][r])} (global row id) has "
                f"{int(lengths[r])} stored values, more than "
                f"PaddedSparseOutput(width={w}) holds (truncate='error'); give a "
                "larger width (or, for a width fitted to the data, a higher "
                "quantile such as quantile=1.0), or choose truncate='largest' "
                "or 'first'"
            )
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
        nnz = padded(empty, lengths, batch_size, np.int32)
        truncated = padded(empty, over, batch_size)
        return {"values": values, "indices": cols, "nnz": nnz, "truncated": truncated}

    def fingerprint(self) -> dict:
        """What a checkpoint records, with the fitted width (another is refused)."""
        fp = {
            "class": type(self).__name__,
            "width": None if self.width is None else int(self.width),
            "truncate": self.truncate,
            "dtype": dtype_name(self.dtype),
        }
        if self.width is None:
            fp["quantile"] = float(self.quantile)
        return fp


def sample_ranges(source) -> tuple[np.ndarray, np.ndarray]:
    """Global row ranges `(starts, stops)` of the sample's blocks, sorted by start."""
    n_blocks = len(source)
    k = min(n_blocks, max(1, math.ceil(SAMPLE_CELLS / source.block_size)))
    keys = np.unique(np.rint(np.linspace(0, n_blocks - 1, k)).astype(np.int64))
    _, starts, stops = source.block_ranges(keys)
    order = np.argsort(starts, kind="stable")
    return starts[order], stops[order]


def fit_width(source, quantile: float, read=None) -> int:
    """The width fitted to `source`'s sample; `read` reads another matrix than X."""
    if len(source) == 0:
        return WIDTH_MULTIPLE
    starts, stops = sample_ranges(source)
    rows = (read or source.fetch_ranges)(starts, stops, RowBuffer())
    if rows.csr is not None:
        counts = np.diff(rows.csr.indptr)
    else:
        counts = np.count_nonzero(rows.dense, axis=1)
    top = int(np.quantile(counts, quantile, method="higher")) if counts.size else 0
    return max(WIDTH_MULTIPLE, -(-top // WIDTH_MULTIPLE) * WIDTH_MULTIPLE)


class TruncationReport:
    """Warns once per loader about cells the padded `outputs` (by key prefix) cut:
    a fitted width only past twice its quantile's share plus `_MARGIN_CELLS`.
    """  # noqa: D205

    def __init__(self, outputs: dict[str, object]):
        self._outputs = {
            prefix: output
            for prefix, output in outputs.items()
            if isinstance(output, PaddedSparseOutput) and output.truncate != "error"
        }
        self._cells = 0
        self._truncated = dict.fromkeys(self._outputs, 0)
        self._warned = False

    def __bool__(self) -> bool:
        return bool(self._outputs) and not self._warned

    def observe(self, batch: dict) -> None:
        """Counts the minibatch's cells and truncated cells; warns once."""
        mask, cells = batch.get("mask"), None
        for prefix, output in self._outputs.items():
            flags = batch.get(prefix + "truncated")
            if self._warned or flags is None:
                continue
            if cells is None:
                cells = int(np.count_nonzero(mask)) if mask is not None else len(flags)
                self._cells += cells
            over = np.asarray(flags)
            self._truncated[prefix] += int(np.count_nonzero(over))
            allowed = 0
            if output.fitted:
                allowed = 2 * (1 - output.quantile) * self._cells + _MARGIN_CELLS
            if over.any() and self._truncated[prefix] > allowed:
                self._warned = True
                self._warn(prefix, output, batch, over, cells)

    def _warn(self, prefix, output, batch, over, cells) -> None:
        lengths = np.asarray(batch[prefix + "nnz"])
        row_ids = np.asarray(batch.get("row_ids", np.arange(lengths.size)))
        widest = int(np.argmax(np.where(over, lengths, -1)))
        w, q = output.width, output.quantile
        kept = "largest" if output.truncate == "largest" else "first (column order)"
        which = f" (extra matrix {prefix[:-1]!r})" if prefix else ""
        fitted = (
            f" The width was fitted to the data at quantile={q}, which leaves out "
            f"about {1 - q:.2%} of cells; this loader has cut "
            f"{self._truncated[prefix]} of {self._cells} so far."
            if output.fitted
            else ""
        )
        warnings.warn(
            f"PaddedSparseOutput(width={w}){which}: {int(over.sum())} of {cells} "
            f"cells of a minibatch have more stored values than width (up to "
            f"{int(lengths[widest])}, cell {int(row_ids[widest])}); each keeps "
            f"its {w} {kept} values.{fitted} batch['truncated'] marks such cells "
            "in every minibatch; this warning is shown once per loader. Give a "
            "larger width (or, for a width fitted to the data, a higher "
            "quantile such as quantile=1.0), or pass truncate='error' to "
            "refuse such cells.",
            errors.TruncationWarning,
            stacklevel=stack.stacklevel_outside_package(),
        )

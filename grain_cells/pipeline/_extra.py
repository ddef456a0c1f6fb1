"""More matrices per minibatch: layers, `raw/X` and `obsm` arrays beside X.

Design notes: docs/reference/design.md#pipeline-extra.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from grain_cells._util import arguments
from grain_cells.io import (
    OpenFiles,
    RowBuffer,
    element_files,
    fetch_ranges,
    matrix_element,
    obsm_element,
)
from grain_cells.outputs import CsrOutput, Fetch, Output, declared, dtype_name
from grain_cells.source import AnnDataSource


@dataclasses.dataclass(frozen=True)
class Layer:
    """A matrix of the cells read beside X: `layers/<name>`, or `raw`.

    Attributes:
        name: The layer's name; `"raw"` for `raw/X`, `"X"` for X itself (e.g.
            X in a second output format).
        output: Its output format (any `grain_cells.Output`).
    """

    name: str
    output: Output = dataclasses.field(default_factory=CsrOutput)

    def __post_init__(self):
        arguments.check_name("name", self.name)
        check_output(self.output)
        object.__setattr__(self, "output", declared(self.output))

    def fingerprint(self) -> dict:
        """What a checkpoint records of this matrix: its name and output."""
        return {
            "class": type(self).__name__,
            "name": self.name,
            "output": self.output.fingerprint(),
        }


@dataclasses.dataclass(frozen=True)
class Obsm:
    """An `obsm` array read beside X, as a dense `[batch, k]` array.

    Attributes:
        name: The key in `obsm` (e.g. `"X_pca"`).
        dtype: dtype of the output.
    """

    name: str
    dtype: str = "float32"

    def __post_init__(self):
        arguments.check_name("name", self.name)
        arguments.check_dtype("dtype", self.dtype)

    def fingerprint(self) -> dict:
        """What a checkpoint records of this array: its key and dtype."""
        return {
            "class": type(self).__name__,
            "name": self.name,
            "dtype": dtype_name(self.dtype),
        }


class ElementReader:
    """Reads a `Layer` or an `Obsm` array of a source's cells (picklable).

    Reads raise `MissingColumnError`, `AnnDataFormatError` or `SourceChangedError`.
    """

    def __init__(self, source: AnnDataSource, spec: Layer | Obsm):
        layer = isinstance(spec, Layer)
        element = (matrix_element if layer else obsm_element)(spec.name)
        self.spec = spec
        self.files = element_files(source.files, element)
        self.cell_offsets = source.cell_offsets
        self.check_indices = source.check_indices
        self._handles = OpenFiles(self.files, source.read_threads)
        if layer:  # e.g. PaddedSparseOutput(width=None), fitted on this layer
            fit = spec.output.fit_to_source(
                source, functools.partial(self.fetch, key=0)
            )
            self.spec = dataclasses.replace(spec, output=fit)

    def fetch(self, starts, stops, buffer: RowBuffer | None, key: int):
        """Rows of sorted global ranges: a layer's `Fetch`, or an obsm array."""
        rows = fetch_ranges(
            self._handles,
            self.cell_offsets,
            starts,
            stops,
            buffer,
            check_indices=self.check_indices,
        )
        if isinstance(self.spec, Obsm):
            return rows.dense.astype(self.spec.dtype)
        return Fetch(rows.dense, rows.row_ids, self.files.num_genes, key, _csr=rows.csr)

    def read(self, starts: np.ndarray, stops: np.ndarray):
        return self.fetch(starts, stops, None, 0)

    def close(self) -> None:
        self._handles.close()

    def __repr__(self) -> str:
        return f"{self.spec!r}"


def check_output(output, name: str = "output") -> None:
    """`TypeError` unless `output` has `format(fetch, rows, batch_size)`."""
    if isinstance(output, (str, bytes, type)) or not callable(
        getattr(output, "format", None)
    ):
        raise arguments.ArgumentTypeError(
            f"{name} must be an output format (CsrOutput(), "
            "PaddedSparseOutput(), DenseOutput(), RankValueTokens, "
            "ValueBinTokens or any object with format(fetch, rows, "
            f"batch_size)), got {name}={output!r}"
        )


def readers(source: AnnDataSource, extra: dict | None) -> dict:
    """Readers of the extra matrices by key (`TypeError`: not `Layer`/`Obsm`)."""
    arguments.check_mapping("extra", extra)
    for key, spec in (extra or {}).items():
        if not isinstance(spec, Layer | Obsm):
            raise TypeError(
                f"extra[{key!r}] must be grain_cells.Layer or grain_cells.Obsm, "
                f"got {spec!r}"
            )
    return {key: ElementReader(source, spec) for key, spec in (extra or {}).items()}

"""More matrices per minibatch: layers, `raw/X` and `obsm` arrays beside X.

Design notes: docs/reference/design.md#pipeline-extra.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from grain_cells._util import arguments
from grain_cells.io import (
    FetchedRows,
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


class _ElementReader:
    """Reads one element of a source's files for its row ranges, through `source.files`.

    Picklable (each process opens its own handles).
    """

    def __init__(self, source: AnnDataSource, spec, element: str):
        self.spec = spec
        self.files = element_files(source.files, element)
        self.cell_offsets = source.cell_offsets
        self.check_indices = source.check_indices
        self._handles = OpenFiles(self.files, source.read_threads)

    def _fetch(self, starts, stops, buffer: RowBuffer | None) -> FetchedRows:
        return fetch_ranges(
            self._handles,
            self.cell_offsets,
            starts,
            stops,
            buffer,
            check_indices=self.check_indices,
        )

    def close(self) -> None:
        """Closes this process's file handles; they reopen on next use."""
        self._handles.close()

    def __repr__(self) -> str:
        return f"{self.spec!r}"


class LayerReader(_ElementReader):
    """Reads one extra layer (`layers/<name>`, `raw/X` or X) of a source's cells.

    Raises:
        errors.MissingColumnError: A file has no such layer.
        errors.SourceChangedError: A file changed since the source was built.
    """

    def __init__(self, source: AnnDataSource, spec: Layer):
        super().__init__(source, spec, matrix_element(spec.name))
        # e.g. PaddedSparseOutput(width=None), fitted on this layer
        fitted = spec.output.fit_to_source(source, functools.partial(self.fetch, key=0))
        self.spec = dataclasses.replace(spec, output=fitted)

    def fetch(self, starts, stops, buffer, key: int) -> Fetch:
        """The layer's rows for the same ranges as X (in X's buffer order)."""
        rows = self._fetch(starts, stops, buffer)
        return Fetch(rows.dense, rows.row_ids, self.files.num_genes, key, _csr=rows.csr)


class ObsmReader(_ElementReader):
    """Reads rows of one `obsm` array of every file.

    Raises:
        errors.MissingColumnError: A file has no such `obsm` array.
        errors.AnnDataFormatError: The array is not a 2-D dense array with one
            row per cell, or its width differs between files.
        errors.SourceChangedError: A file changed since the source was built.
    """

    def __init__(self, source: AnnDataSource, spec: Obsm):
        super().__init__(source, spec, obsm_element(spec.name))
        self.width = self.files.num_genes

    def read(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """Rows of sorted, disjoint global ranges, concatenated (a new array)."""
        rows = self._fetch(starts, stops, None)
        return rows.dense.astype(self.spec.dtype)


def check_output(output, name: str = "output") -> None:
    """Refuses what is not an output format (`"csr"`, a class, None).

    Raises:
        TypeError: `output` has no `format(fetch, rows, batch_size)`.
    """
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
    """Readers of the extra matrices, by output key.

    Raises:
        TypeError: `extra` is not a dict of `Layer` and `Obsm`.
    """
    arguments.check_mapping("extra", extra)
    out = {}
    for key, spec in (extra or {}).items():
        if isinstance(spec, Layer):
            out[key] = LayerReader(source, spec)
        elif isinstance(spec, Obsm):
            out[key] = ObsmReader(source, spec)
        else:
            raise TypeError(
                f"extra[{key!r}] must be grain_cells.Layer or grain_cells.Obsm, "
                f"got {spec!r}"
            )
    return out

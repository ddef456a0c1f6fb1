"""More matrices per minibatch: layers, `raw/X` and `obsm` arrays beside X.

`fetch_operations(source, ..., extra={...})` reads, for the same cells as the
minibatch's X, each named extra matrix in the format chosen for it:

    extra={
        "counts": grain_cells.Layer("counts"),                 # CSR
        "raw": grain_cells.Layer("raw", grain_cells.DenseOutput()),
        "pca": grain_cells.Obsm("X_pca"),                      # [batch, k]
    }

A `Layer`'s arrays come back under `"<key>/<array>"` (`counts/data`,
`counts/indices`, `counts/indptr`; `raw/X`), an `Obsm` array under its key.
A layer is read over the genes of the minibatch's X (the source's join and
gene selection); `raw/X` over the genes of `raw/var` (aligned with the
source's join). Each extra matrix is read with one batched call per file and
fetch, like X; padding rows are empty (CSR), zero (dense) or pad tokens.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np

from grain_cells import errors
from grain_cells.io import _h5ad as h5ad
from grain_cells.outputs import _formats as formats
from grain_cells.outputs._formats import CsrOutput, Fetch, Output
from grain_cells.source._source import AnnDataSource


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

    def fingerprint(self) -> dict:
        """What a checkpoint records of this matrix: its name and output."""
        return {
            "class": type(self).__name__,
            "name": self.name,
            "output": formats.fingerprint_of(self.output),
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

    def fingerprint(self) -> dict:
        """What a checkpoint records of this array: its key and dtype."""
        return {
            "class": type(self).__name__,
            "name": self.name,
            "dtype": formats.dtype_name(self.dtype),
        }


class LayerReader:
    """Reads one extra layer of a source's cells (picklable)."""

    def __init__(self, source: AnnDataSource, spec: Layer):
        raw = spec.name in ("raw", "raw/X")
        reorders = source.join != "exact" or source.num_genes != source.num_genes_stored
        self.spec = spec
        self.source = AnnDataSource(
            source.paths,
            block_size=source.block_size,
            layer=None if spec.name == "X" else spec.name,
            join=source.join,
            genes=None if raw or not reorders else source.var_names,
        )

    def fetch(self, starts, stops, buffer, key: int) -> Fetch:
        """The layer's rows for the same ranges as X."""
        rows = self.source.fetch_ranges(starts, stops, buffer)
        return Fetch(
            rows.dense, rows.row_ids, self.source.num_genes, key, _csr=rows.csr
        )

    def __repr__(self) -> str:
        return f"{self.spec!r}"


class ObsmReader:
    """Reads rows of one `obsm` array of every file (picklable).

    Raises:
        errors.MissingColumnError: A file has no such `obsm` array.
        errors.AnnDataFormatError: The array is not a 2-D dense array with one
            row per cell, or its width differs between files.
    """

    def __init__(self, source: AnnDataSource, spec: Obsm):
        self.spec = spec
        self.paths = source.paths
        self.offsets = source.cell_offsets
        widths = []
        for i, path in enumerate(self.paths):
            with h5ad.open_file(path) as f:
                group = f.get("obsm")
                if group is None or spec.name not in group:
                    have = [] if group is None else sorted(group.keys())
                    raise errors.MissingColumnError(
                        f"{path}: obsm has no array {spec.name!r}; it has {have}"
                    )
                ds = group[spec.name]
                n_obs = int(self.offsets[i + 1] - self.offsets[i])
                if (
                    not hasattr(ds, "shape")
                    or len(ds.shape) != 2
                    or ds.shape[0] != n_obs
                ):
                    shape = getattr(ds, "shape", "a group (dataframe)")
                    raise errors.AnnDataFormatError(
                        f"{path}: obsm/{spec.name} is {shape}; expected a dense "
                        f"array of {n_obs} rows (one per cell) and k columns"
                    )
                widths.append(int(ds.shape[1]))
        if len(set(widths)) > 1:
            raise errors.AnnDataFormatError(
                f"obsm/{spec.name} has {widths} columns in files {list(self.paths)}; "
                "every file must have the same width"
            )
        self.width = widths[0]
        self._init_process_state()

    def _init_process_state(self):
        self._lock = threading.Lock()
        self._files = {}
        self._pid = os.getpid()

    def __getstate__(self):
        state = self.__dict__.copy()
        for key in ("_lock", "_files", "_pid"):
            del state[key]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_process_state()

    def _dataset(self, i: int):
        if self._pid != os.getpid():
            self._init_process_state()
        with self._lock:
            f = self._files.get(i)
            if f is None:
                f = self._files[i] = h5ad.open_file(self.paths[i])
        return f["obsm"][self.spec.name]

    def read(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """Rows of sorted, disjoint global ranges, concatenated."""
        out = np.empty((int((stops - starts).sum()), self.width), self.spec.dtype)
        files = np.searchsorted(self.offsets, starts, side="right") - 1
        r = 0
        for a, b, i in zip(
            starts.tolist(), stops.tolist(), files.tolist(), strict=True
        ):
            local = int(self.offsets[i])
            out[r : r + b - a] = self._dataset(i)[a - local : b - local]
            r += b - a
        return out

    def close(self) -> None:
        """Closes this process's file handles."""
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()

    def __repr__(self) -> str:
        return f"{self.spec!r}"


def readers(source: AnnDataSource, extra: dict | None) -> dict:
    """Readers of the extra matrices, by output key."""
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

"""`SourceInfo`: what an `AnnDataSource` describes without reading cells.

Its files (paths, matrix metadata, identities), output genes, obs columns and
categories, cells and blocks: read-only properties over the source's
`FileSet` (`grain_cells.io._file_set`) and `BlockTable`
(`grain_cells.source._table`). `AnnDataSource` is its only subclass; the
properties live here so that `source.py` holds the protocol, views and reads.
"""

from __future__ import annotations

import numpy as np

from grain_cells import errors
from grain_cells.io import _h5ad as h5ad
from grain_cells.io._file_set import FileSet, OpenFiles
from grain_cells.source._table import BlockTable
from grain_cells.storage._identity import FileIdentity


class SourceInfo:
    """Read-only description of a source's files, genes, obs, cells and blocks.

    Attributes set by the subclass: `_files` (`FileSet`), `_table`
    (`BlockTable`), `_handles` (this process's `OpenFiles`), `_obs_missing`
    and `_check_indices`.
    """

    _files: FileSet
    _table: BlockTable
    _handles: OpenFiles
    _obs_missing: str
    _check_indices: bool

    @property
    def files(self) -> FileSet:
        """The files: paths, identities, matrix metadata, storage options."""
        return self._files

    @property
    def read_threads(self) -> int:
        """Threads per process that issue reads on large batches (0: inline)."""
        return self._handles.read_threads

    @property
    def check_indices(self) -> bool:
        """Whether every read checks that column indices lie in the matrix."""
        return self._check_indices

    @property
    def paths(self) -> tuple[str, ...]:
        """The files, in concatenation order."""
        return self._files.paths

    @property
    def block_size(self) -> int:
        """Cells per block (record)."""
        return self._table.block_size

    @property
    def num_cells(self) -> int:
        """Cells over all files (a view's row ids still range over these)."""
        return self._table.num_cells

    @property
    def num_selected_cells(self) -> int:
        """Cells the blocks hold: `num_cells`, or fewer for a view."""
        return self._table.num_selected_cells

    @property
    def num_genes(self) -> int:
        """Columns of the output (aligned genes, after the `genes` selection)."""
        return len(self._files.genes.var_names)

    @property
    def num_genes_stored(self) -> int:
        """Aligned genes before the `genes` selection.

        With `join="exact"`, the columns every file stores.
        """
        return self._files.genes.num_aligned

    @property
    def var_names(self) -> np.ndarray:
        """Gene ids of the output columns, in output order."""
        return self._files.genes.var_names

    @property
    def join(self) -> str:
        """How genes are aligned over files: `"exact"`, `"inner"`, `"outer"`."""
        return self._files.genes.join

    @property
    def obs_missing(self) -> str:
        """What files lacking an obs column give: `"error"` or `"fill"`."""
        return self._obs_missing

    def file_column_map(self, i: int) -> np.ndarray | None:
        """Output column of each column file `i` stores (-1: not output).

        None when the file's columns are the output columns (no remapping).
        """
        column_map = self._files.genes.maps[i]
        return None if column_map is None else column_map.out.copy()

    @property
    def is_sparse(self) -> bool:
        """Whether the matrix is stored as CSR (else dense)."""
        return self._files.sparse

    @property
    def dtype(self) -> np.dtype:
        """Dtype of values read: the files' common type (native, float16 as float32)."""
        return self._files.dtype

    @property
    def cell_offsets(self) -> np.ndarray:
        """Global row id of each file's first cell, plus the total at the end."""
        return self._table.cell_offsets.copy()

    @property
    def block_offsets(self) -> np.ndarray:
        """Index of each file's first block, plus the block count at the end."""
        return self._table.block_offsets.copy()

    @property
    def obs_columns(self) -> tuple[str, ...]:
        """The obs columns returned with each cell."""
        return self._files.obs_names

    @property
    def categories(self) -> dict[str, np.ndarray | None]:
        """Per obs column, the labels that codes index (None for numeric)."""
        return {c: spec.categories for c, spec in self._files.obs.items()}

    def obs_values(self, column: str) -> np.ndarray:
        """One obs column for every cell of the source, in row-id order.

        Categorical columns come back as codes into `categories[column]`
        (harmonised across files). Loads the column of every file into this
        process.

        Raises:
            errors.MissingColumnError: `column` is not one of `obs_columns`.
        """
        if column not in self.obs_columns:
            raise errors.MissingColumnError(
                f"obs column {column!r} was not requested; this source has "
                f"obs_columns={list(self.obs_columns)}"
            )
        parts = [self._handles.file(i).obs[column] for i in range(len(self.paths))]
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    def chunk_starts(self) -> np.ndarray:
        """Global rows where an HDF5 chunk of the matrix begins, per file.

        For CSR, a row belongs to the chunk of `data` that holds its first
        value; for dense, chunks are runs of rows. Each file's first row is
        included; a contiguous matrix contributes only that. Opens every file
        in this process (and, for CSR, reads each `indptr` once).
        """
        offsets = self._table.cell_offsets
        parts = [
            self._handles.file(i).reader.chunk_starts() + offsets[i]
            for i in range(len(self._files.paths))
        ]
        return np.unique(np.concatenate(parts))

    def file_info(self, i: int) -> h5ad.MatrixInfo:
        """What file `i`'s matrix holds."""
        return self._files.infos[i]

    @property
    def block_table(self) -> BlockTable:
        """Which blocks this source has and the rows each holds (immutable)."""
        return self._table

    @property
    def blocks_id(self) -> str:
        """A view's block table, summarised and hashed; "" for the full grid."""
        return self._table.blocks_id

    def file_identity(self, i: int) -> FileIdentity:
        """File `i`'s identity, taken when the source was built."""
        return self._files.identities[i]

    def verify_files(self, when: str = "on request") -> None:
        """Checks that every file is still the one the source was built on.

        One `stat` per file (see `grain_cells.storage._identity` for what that detects).

        Raises:
            errors.SourceChangedError: A file was written, replaced or removed.
        """
        self._files.verify(when)


__all__ = ["SourceInfo"]

"""What an `AnnDataSource` describes without reading cells.

The read-only facts of a source (its files, block table, genes, obs columns
and options), kept apart from the class that binds them to Grain's protocol
and reads (`grain_cells.source._source`). It holds three immutable values,
given to its constructor and read through `files`, `block_table` and
`options`.
"""

from __future__ import annotations

import numpy as np

from grain_cells.io import FileIdentity, FileSet, MatrixInfo
from grain_cells.source._options import SourceOptions
from grain_cells.source._table import BlockTable


class SourceDescription:
    """Properties of a source that read no cells (base of `AnnDataSource`).

    Holds `files` (`FileSet`), `table` (`BlockTable`) and `options`
    (`SourceOptions`).
    """

    def __init__(self, files: FileSet, table: BlockTable, options: SourceOptions):
        self._files = files
        self._table = table
        self._options = options

    @property
    def files(self) -> FileSet:
        """The files as checked at build (immutable): paths, matrices, genes, obs."""
        return self._files

    @property
    def block_table(self) -> BlockTable:
        """Which blocks this source has and the rows each holds (immutable)."""
        return self._table

    @property
    def options(self) -> SourceOptions:
        """How the source reads its files: layer, obs_missing, reads (immutable)."""
        return self._options

    @property
    def read_threads(self) -> int | str:
        """Threads per process that issue reads on large batches (0: inline)."""
        return self._options.read_threads

    @property
    def fetch_blocks(self) -> int | None:
        """Blocks per fetch of loaders given no `fetch_factor` (None: factor 16)."""
        return self._options.fetch_blocks

    @property
    def check_indices(self) -> bool:
        """Whether every read checks that column indices lie in the matrix."""
        return self._options.check_indices

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
    def blocks_id(self) -> str:
        """A view's block table, summarised and hashed; "" for the full grid."""
        return self._table.blocks_id

    @property
    def cell_offsets(self) -> np.ndarray:
        """Global row id of each file's first cell, plus the total at the end."""
        return self._table.cell_offsets.copy()

    @property
    def block_offsets(self) -> np.ndarray:
        """Index of each file's first block, plus the block count at the end."""
        return self._table.block_offsets.copy()

    @property
    def num_genes(self) -> int:
        """Columns of the output (aligned genes, after the `genes` selection)."""
        return self._files.num_genes

    @property
    def num_genes_stored(self) -> int:
        """Aligned genes before the `genes` selection (with `"exact"`: stored)."""
        return self._files.genes.num_aligned

    @property
    def var_names(self) -> np.ndarray:
        """Gene ids of the output columns, in output order (keys: `genes_from`)."""
        return self._files.genes.var_names

    @property
    def join(self) -> str:
        """How genes are aligned over files: `"exact"`, `"inner"`, `"outer"`."""
        return self._files.genes.join

    @property
    def genes_from(self) -> str | None:
        """The var column that keys genes over files, or None: var names."""
        return self._files.genes.genes_from

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
    def obs_columns(self) -> tuple[str, ...]:
        """The obs columns returned with each cell."""
        return self._files.obs_names

    @property
    def obs_missing(self) -> str:
        """What files lacking an obs column give: `"error"` or `"fill"`."""
        return self._options.obs_missing

    @property
    def categories(self) -> dict[str, np.ndarray | None]:
        """Per obs column, the labels that codes index (None for numeric)."""
        return {c: spec.categories for c, spec in self._files.obs.items()}

    def file_info(self, i: int) -> MatrixInfo:
        """What file `i`'s matrix holds."""
        return self._files.infos[i]

    def file_identity(self, i: int) -> FileIdentity:
        """File `i`'s identity, taken when the source was built."""
        return self._files.identities[i]

    def verify_files(self, when: str = "on request") -> None:
        """Checks with one `stat` per file that every file is still the one built on.

        See `grain_cells.io._identity` for what that detects.

        Raises:
            errors.SourceChangedError: A file was written, replaced or removed.
        """
        self._files.verify(when)

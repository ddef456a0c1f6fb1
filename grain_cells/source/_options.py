"""The values a source holds besides its files and table, and what they describe.

`SourceDescription` answers what a source's `FileSet`, `BlockTable` and
`SourceOptions` say without reading cells. Design notes:
docs/reference/design.md#source-options.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Sequence

import numpy as np

from grain_cells._util import arguments
from grain_cells.io import FileIdentity, FileSet, MatrixInfo
from grain_cells.source._table import BlockTable


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """How a source reads its files beyond its `FileSet` (see `AnnDataSource`).

    `fetch_blocks`: blocks per fetch of loaders given no `fetch_factor` (None: 16).
    """

    layer: str | None
    obs_missing: str
    check_indices: bool
    read_threads: int | str
    fetch_blocks: int | None = None
    max_open_files: int | str = "auto"


def _get(path: str) -> property:
    """A read-only property: `self.<path>` (dotted)."""
    return property(operator.attrgetter(path))


class SourceDescription:
    """What a source describes without reading cells (base of `AnnDataSource`).

    Holds three immutable values: `files`, `block_table` and `options`.
    """

    def __init__(self, files: FileSet, table: BlockTable, options: SourceOptions):
        self._files, self._table, self._options = files, table, options

    files = _get("_files")
    """The files as checked at build (immutable): paths, matrices, genes, obs."""
    block_table = _get("_table")
    """Which blocks this source has and the rows each holds (immutable)."""
    options = _get("_options")
    """How the source reads its files: layer, obs_missing, reads (immutable)."""
    read_threads = _get("_options.read_threads")
    """Threads per process that issue reads on large batches (0: inline)."""
    fetch_blocks = _get("_options.fetch_blocks")
    """Blocks per fetch of loaders given no `fetch_factor` (None: factor 16)."""
    check_indices = _get("_options.check_indices")
    """Whether every read checks that column indices lie in the matrix."""
    obs_missing = _get("_options.obs_missing")
    """What files lacking an obs column give: `"error"` or `"fill"`."""
    paths = _get("_files.paths")
    """The files, in concatenation order."""
    block_size = _get("_table.block_size")
    """Cells per block (record)."""
    num_cells = _get("_table.num_cells")
    """Cells over all files (a view's row ids still range over these)."""
    num_selected_cells = _get("_table.num_selected_cells")
    """Cells the blocks hold: `num_cells`, or fewer for a view."""
    blocks_id = _get("_table.blocks_id")
    """A view's block table, summarised and hashed; "" for the full grid."""
    num_genes = _get("_files.num_genes")
    """Columns of the output (aligned genes, after the `genes` selection)."""
    num_genes_stored = _get("_files.genes.num_aligned")
    """Aligned genes before the `genes` selection (with `"exact"`: stored)."""
    var_names = _get("_files.genes.var_names")
    """Gene ids of the output columns, in output order (keys: `genes_from`)."""
    join = _get("_files.genes.join")
    """How genes are aligned over files: `"exact"`, `"inner"`, `"outer"`."""
    genes_from = _get("_files.genes.genes_from")
    """The var column that keys genes over files, or None: var names."""
    is_sparse = _get("_files.sparse")
    """Whether the matrix is stored as CSR (else dense)."""
    dtype = _get("_files.dtype")
    """Dtype of values read: the files' common type (native, float16 as float32)."""
    obs_columns = _get("_files.obs_names")
    """The obs columns returned with each cell."""

    @property
    def cell_offsets(self) -> np.ndarray:
        """Global row id of each file's first cell, plus the total at the end."""
        return self._table.cell_offsets.copy()

    @property
    def block_offsets(self) -> np.ndarray:
        """Index of each file's first block, plus the block count at the end."""
        return self._table.block_offsets.copy()

    def file_column_map(self, i: int) -> np.ndarray | None:
        """Output column of each column file `i` stores (-1: none; None: as stored)."""
        column_map = self._files.genes.maps[i]
        return None if column_map is None else column_map.out.copy()

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

        Raises:
            errors.SourceChangedError: A file was written, replaced or removed.
        """
        self._files.verify(when)


def check_paths(paths):
    """`paths`: a path or a non-empty sequence of paths (str or PathLike)."""
    if isinstance(paths, (str, os.PathLike)):
        return paths
    if not isinstance(paths, Sequence):
        try:
            paths = list(paths)  # an array or another iterable of paths
        except TypeError:
            raise arguments.ArgumentTypeError(
                "paths must be a path (str or os.PathLike) or a list of paths, "
                f"got paths={paths!r} ({type(paths).__name__})"
            ) from None
    if len(paths) == 0:
        raise ValueError(
            "paths is empty: expected one or more .h5ad files or zarr stores, "
            f"got paths={paths!r}"
        )
    bad = [p for p in paths if not isinstance(p, (str, os.PathLike))]
    if bad:
        raise arguments.ArgumentTypeError(
            f"paths must hold paths (str or os.PathLike), got {bad[0]!r} "
            f"({type(bad[0]).__name__}) in paths"
        )
    return paths

"""`AnnDataSource`: `.h5ad` files and zarr stores as a Grain random-access source.

A source holds three immutable values: its `FileSet` (the files as checked at
build), its `BlockTable` (which rows each block holds) and its `SourceOptions`;
each process opens its own handles (`OpenFiles`) on first use. A view is a new
source of the same files and options and another table. Design notes:
docs/reference/design.md#source-reads.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Sequence

import numpy as np

from grain_cells import errors
from grain_cells._util import absl_flags, arguments
from grain_cells.io import (
    JOINS,
    OBS_MISSING,
    Cells,
    FetchedRows,
    FileSet,
    OpenFile,
    OpenFiles,
    RowBuffer,
    check_max_open,
    joined_column,
    matrix_element,
    own_map,
    resolve_paths,
)
from grain_cells.io import advise as _advise
from grain_cells.io import fetch_ranges as _fetch_ranges
from grain_cells.io import read_ranges as _read_ranges
from grain_cells.io import read_rows as _read_rows
from grain_cells.source import _chunk_grid, _selection
from grain_cells.source._options import SourceDescription, SourceOptions, check_paths
from grain_cells.source._table import Block, BlockTable

_log = logging.getLogger("grain_cells")


class AnnDataSource(SourceDescription):
    """Cells of one or many `.h5ad` files or zarr stores, concatenated, as blocks.

    Grain's `RandomAccessDataSource` over *blocks* of `block_size` contiguous
    cells of one file (`source[k]` is a `Block` descriptor). Thread-safe,
    picklable without open handles, with a stable `repr`. Views (`select`,
    the splits, `with_blocks`) are sources too; row ids stay global.

    Example:
        >>> source = AnnDataSource(["plate1.h5ad", "more.zarr"],
        ...                        obs_columns=["cell_line"], join="outer")
        >>> cells = source.read([5, 3, 1000])  # any rows, in this order
        >>> cells.X, cells.obs["cell_line"]    # CSR matrix, integer codes
        >>> source.categories["cell_line"]     # the codes' labels
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        block_size: int | None = None,
        layer: str | None = None,
        obs_columns: Sequence[str] = (),
        genes: Sequence[str] | np.ndarray | None = None,
        join: str = "exact",
        genes_from: str | None = None,
        obs_missing: str = "error",
        check_indices: bool = True,
        read_threads: int | str = "auto",
        storage_options: dict | None = None,
        max_open_files: int | str = "auto",
    ):
        """Opens every file once to check it and read its metadata.

        Args:
            paths: One path or a sequence of paths (`.h5ad` files, zarr
                stores, or URLs of either), concatenated in this order.
            block_size: Cells per record (block); blocks never straddle
                files. None: 16, or blocks along a compressed matrix's chunks.
            layer: The matrix: None for `X`, `"raw"` for `raw/X`, any other
                name for `layers/<name>`.
            obs_columns: obs columns returned with every cell; categorical,
                string and boolean ones as codes into `categories[name]`.
            genes: Genes to read, within those `join` aligns: names (in this
                order), a boolean mask or integer positions.
            join: `"exact"` (the same var names in the same order), `"inner"`
                or `"outer"`: how genes of the files are aligned.
            genes_from: A var column keying genes in every file instead of
                var names (CELLxGENE Census: `"feature_id"`); unique per file.
            obs_missing: `"error"` or `"fill"`: what a file that lacks one of
                `obs_columns` gives.
            check_indices: Check at every read that column indices are inside
                the matrix (a few percent of a read).
            read_threads: Threads per process that read large batches; 0
                reads inline; `"auto"`: from the cores and worker count.
            storage_options: For URLs: obstore configuration and
                `content_check_s`, `verify_reads`, `user_project`
                (docs/guides/buckets.md). Pickled with the source.
            max_open_files: Files each process keeps open (the least recently
                used one closes); `"auto"`: 128, or less under a low limit.

        Raises:
            ValueError: `paths` is empty or an argument is out of range.
            FileNotFoundError: A path does not exist.
            errors.AnnDataFormatError: A file is not AnnData or is malformed,
                or an obs column is categorical in one file, numeric in another.
            errors.UnsupportedLayoutError: A matrix is CSC or otherwise
                unusable, or the `genes_from` column is not of ids.
            errors.MissingColumnError: An obs column, gene, layer or the
                `genes_from` column is missing.
            errors.GeneMismatchError: The files' genes do not align under
                `join` (other names; none shared; a name or `genes_from`
                value repeated or missing).
        """
        if block_size is not None:
            block_size = arguments.check_int("block_size", block_size, minimum=1)
        if not isinstance(read_threads, str):
            read_threads = arguments.check_int("read_threads", read_threads, minimum=0)
        elif read_threads != "auto":
            raise ValueError(
                "read_threads must be a non-negative int or 'auto', got "
                f"read_threads={read_threads!r}"
            )
        max_open_files = check_max_open(max_open_files)
        genes = arguments.check_genes(genes)
        paths = check_paths(arguments.paths_of(paths))  # a backed AnnData: its file
        layer = arguments.check_name("layer", layer, optional=True)
        genes_from = arguments.check_name("genes_from", genes_from, optional=True)
        check_indices = arguments.check_bool("check_indices", check_indices)
        storage_options = arguments.check_mapping("storage_options", storage_options)
        arguments.check_choice("join", join, JOINS)
        arguments.check_choice("obs_missing", obs_missing, OBS_MISSING)
        obs_names = arguments.check_names("obs_columns", obs_columns)
        if len(set(obs_names)) != len(obs_names):
            raise ValueError(f"obs_columns has duplicates: {list(obs_columns)}")
        files = FileSet.inspect(
            resolve_paths(paths),
            element=matrix_element(layer),
            obs_names=obs_names,
            genes=genes,
            join=join,
            obs_missing=obs_missing,
            storage_options=storage_options,
            genes_from=genes_from,
        )
        options = SourceOptions(
            layer, obs_missing, check_indices, read_threads, None, max_open_files
        )
        if block_size is None:
            table, options = _chunk_grid.default_blocks(files, options)
        else:
            table = BlockTable.grid(files.n_obs, block_size)
        self._bind(files, table, options)
        absl_flags.allow_unparsed()  # Grain reads a flag when its workers start

    def _bind(self, files: FileSet, table: BlockTable, options: SourceOptions):
        """Holds these values; this process's handles open on first use."""
        SourceDescription.__init__(self, files, table, options)
        self._handles = OpenFiles(files, options.read_threads, options.max_open_files)
        self._block = table.block  # per record: no property in between
        self._at = (self._handles, table.cell_offsets)  # the io reads' first two
        self._checks = {"check_indices": options.check_indices}

    def __reduce__(self):  # pickles as its values: no handle, buffer or thread
        return _unpickle, (self.files, self.block_table, self.options)

    def view(self, table: BlockTable) -> AnnDataSource:
        """A source over the same files whose records are `table`'s blocks.

        Behind `select`, `with_blocks` and the splits; warns (logging) when the
        table is fragmented. ValueError: `table` is of other files or blocks.
        """
        if table.block_size != self.block_size or not np.array_equal(
            table.cell_offsets, self.block_table.cell_offsets
        ):
            raise ValueError(
                f"the block table is over {table.num_cells} cells in blocks of "
                f"{table.block_size}; this source has {self.num_cells} cells in "
                f"blocks of {self.block_size} (build the table from "
                "source.block_table)"
            )
        if table.fragmented and not self.block_table.fragmented:  # once, not per split
            _log.warning("%s: %s", table.blocks_id, table.fragment_note())
        return _unpickle(self.files, table, self.options)

    def select(self, cells=None, *, where=None) -> AnnDataSource:
        """A view over the cells that match: blocks over runs of them.

        Example:
            >>> immune = source.select(where={"cell_type": ["B", "T"]})
            >>> fresh = source.select(where={"n_genes": lambda v: v > 200})

        Args:
            cells: A boolean mask over `num_cells`, or global row ids, or None.
            where: obs column name (one of `obs_columns`) to the labels to
                keep (values of a numeric column), or to an elementwise
                predicate (called once on the labels of a categorical column).

        Raises:
            ValueError: The selection is empty or malformed.
            errors.MissingColumnError: A `where` column is not an obs column.
        """
        return self.view(_selection.selected_blocks(self, cells, where))

    def with_blocks(self, starts, stops) -> AnnDataSource:
        """A view whose record `k` is global rows `[starts[k], stops[k])`.

        Args:
            starts: Global first rows, strictly increasing.
            stops: Exclusive ends; each range holds 1 to `block_size` rows of
                one file, and ranges do not overlap.

        Raises:
            ValueError: No range, or ranges out of order, overlapping, empty,
                longer than `block_size` or straddling two files.
        """
        return self.view(self.block_table.with_blocks(starts, stops))

    def close(self) -> None:
        """Closes this process's file handles; the source reopens on next use."""
        self._handles.close()

    def _file(self, i: int) -> OpenFile:
        """File `i`'s handles in this process, opened on first use."""
        return self._handles.file(i)

    def __len__(self) -> int:
        return len(self.block_table)

    def __getitem__(self, record_key: int) -> Block:
        """Returns the descriptor of block `record_key` (no I/O)."""
        return self._block(record_key, self.source_id)

    @functools.cached_property
    def source_id(self) -> int:
        """A 56-bit hash of the `repr` (equal for sources built alike on a file)."""
        digest = hashlib.blake2b(repr(self).encode(), digest_size=7).digest()
        return int.from_bytes(digest, "little")

    def __repr__(self) -> str:
        files = ", ".join(
            f"{p!r} ({n} cells)"
            for p, n in zip(self.files.paths, self.files.n_obs.tolist(), strict=True)
        )
        table = self.block_table  # a view adds its block table's identity
        blocks = f", blocks={table.blocks_id}" if table.blocks_id else ""
        if table.blocks_id and table.fragmented:
            blocks += " (fragmented)"
        return (
            f"AnnDataSource(files=[{files}], layer={self.options.layer!r}, "
            f"block_size={self.block_size}, obs_columns={list(self.obs_columns)}, "
            f"obs_missing={self.options.obs_missing!r}, "
            f"{self.files.genes.describe()}{blocks})"
        )

    def obs_values(self, column: str) -> np.ndarray:
        """One obs column (one of `obs_columns`) for every cell, in row-id order.

        Read-only; categorical columns come back as codes into
        `categories[column]`. Mapped from the obs cache where there is one.

        Raises:
            errors.MissingColumnError: `column` is not one of `obs_columns`.
        """
        if column not in self.files.obs_names:
            raise errors.MissingColumnError(
                f"obs column {column!r} was not requested; this source has "
                f"obs_columns={list(self.files.obs_names)}"
            )
        if len(self.files.paths) == 1:
            with self._handles.pinned([0]) as (f,):
                return own_map(f.obs[column])
        return own_map(joined_column(self.files, column))

    def chunk_starts(self) -> np.ndarray:
        """Global rows where a chunk of the matrix begins (and each file's first).

        A CSR row belongs to the chunk of `data` that holds its first value.
        """
        at = self.block_table.cell_offsets
        scan = _chunk_grid.file_chunk_starts
        starts = [
            scan(self.files, self._handles, i) + at[i] for i in range(len(at) - 1)
        ]
        return np.unique(np.concatenate(starts))

    def block_ranges(self, keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised `source[k]`: `(files, starts, stops)` of many blocks."""
        return self.block_table.ranges(keys)

    @property
    def hints_wanted(self) -> bool:
        """Whether `advise` would hint anything now (no: reads find the cache warm)."""
        return not self._handles.cache_warm

    def advise(self, keys) -> None:
        """Hints that these blocks will be read soon; never raises."""
        try:
            files, starts, stops = self.block_table.ranges(np.unique(keys))
            _advise(*self._at, files, starts, stops)
        except Exception:  # a hint must never fail the pipeline
            return

    def fetch_ranges(
        self, starts: np.ndarray, stops: np.ndarray, buffer: RowBuffer | None = None
    ) -> FetchedRows:
        """Reads global row ranges, in file order (`row_ids` says which is where).

        Rows are views of this thread's buffer, which its next read overwrites.
        Ranges must not overlap; one outside or straddling files: `IndexError`.
        """
        return _fetch_ranges(*self._at, starts, stops, buffer, **self._checks)

    def read_ranges(self, starts, stops) -> Cells:
        """Reads global row ranges `[starts[i], stops[i])`, in the order given.

        Ranges must not overlap or straddle files; returns fresh arrays.
        """
        return _read_ranges(*self._at, starts, stops, **self._checks)

    def read(self, rows) -> Cells:
        """Reads rows by global id (fresh arrays), in the order given.

        Raises:
            IndexError: A row is outside `[0, num_cells)`.
        """
        return _read_rows(*self._at, rows, **self._checks)

    def read_blocks(self, keys) -> Cells:
        """Reads whole blocks (records), in the order given."""
        blocks = [self.block_table.block(int(k)) for k in np.asarray(keys).reshape(-1)]
        return self.read_ranges([b.start for b in blocks], [b.stop for b in blocks])


def _unpickle(files: FileSet, table: BlockTable, options: SourceOptions):
    """A source of these values (files already checked)."""
    source = AnnDataSource.__new__(AnnDataSource)
    source._bind(files, table, options)
    return source

"""`AnnDataSource`: one or many `.h5ad` files as a Grain random-access source.

**What a record is.** Grain's `DataLoader` reads one record at a time and
stripes records over its worker processes, so a record that held one cell
would scatter a block's cells over workers and lose the contiguous reads that
make block sampling fast. Each record of an `AnnDataSource` is therefore a
*block*: `block_size` contiguous cells of one file (blocks never straddle
files; the last block of a file may be short). `len(source)` is the number of
blocks and `source[k]` returns a `Block`, a small descriptor of which cells
block `k` holds.

Reading is deferred: the batched-fetch transform (`grain_cells.pipeline._fetch`) groups
the blocks of a fetch and reads them all in one batched pass, straight into a
reused buffer. Grain pays about 25 µs per record even with no reader threads,
so a record must stand for many cells, and a batched read beats per-block
reads by several times. To read data directly, use `read(rows)`,
`read_ranges(starts, stops)` or `read_blocks(keys)`.

The class binds three parts to Grain's protocol: `grain_cells.io._file_set`
(the files, and each process's handles; the source pickles without any),
`grain_cells.source._table` (which rows each block holds; a view is a new
table) and `grain_cells.io._range_reads` (the batched reads, offered as methods
by `grain_cells.source._reads`; the read-only properties are in
`grain_cells.source._info`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence

import numpy as np

from grain_cells._util import arguments
from grain_cells.io import _h5ad as h5ad
from grain_cells.io._file_set import FileSet, OpenFile, OpenFiles
from grain_cells.io._genes import JOINS
from grain_cells.io._obs import OBS_MISSING
from grain_cells.io._range_reads import FetchedRows
from grain_cells.source import _selection as selection
from grain_cells.source import _table as block_table
from grain_cells.source._reads import SourceReads
from grain_cells.source._table import Block, BlockTable
from grain_cells.storage.remote import _store as object_store

_log = logging.getLogger("grain_cells")


class AnnDataSource(SourceReads):
    """Cells of one or many `.h5ad` files, concatenated, as blocks.

    Implements Grain's `RandomAccessDataSource` protocol over *blocks* of
    `block_size` contiguous cells (see the module docstring for why). It is
    thread-safe, picklable without open handles, and its `repr` is stable
    (Grain compares it when restoring a checkpoint).

    Example:
        >>> source = AnnDataSource(["plate1.h5ad", "plate2.h5ad"],
        ...                        obs_columns=["cell_line"], block_size=16)
        >>> len(source)                      # blocks
        >>> cells = source.read([5, 3, 1000])  # any rows, in this order
        >>> cells.X                            # scipy.sparse.csr_matrix
        >>> cells.obs["cell_line"]             # integer codes
        >>> source.categories["cell_line"]     # their labels

    **Several files.** `join` and `genes` decide the output genes when files
    list different var names (`"exact"`, the default, requires the same var
    names in the same order); categorical obs codes index one category list
    shared by all files; `obs_missing` decides what files lacking a column
    give. The rules are in `grain_cells.io._file_set`.

    **Views over a subset of cells.** `source.select(cells, where=...)`
    returns a source over the matching cells only, its records blocks over
    runs of selected cells (never across a file or a gap);
    `grain_cells.split_by_fraction` and `split_by_obs` return such views,
    and `with_blocks(starts, stops)` builds one from any block table. A view
    keeps its block table (16 bytes per block) and its `repr` names a hash of
    it; row ids stay global. See `grain_cells.source._selection` and
    `grain_cells.blocks._splits`.

        >>> b_cells = source.select(where={"cell_type": ["B"]})

    Memory per process: the chosen obs columns of the files read so far
    (one value per cell and column, in the smallest integer type that holds
    the codes), the column maps of files whose genes differ from the output
    (4 bytes per stored gene, shared by files with equal var names), plus the
    read buffers (about 2x the largest batch read).
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        block_size: int = 16,
        layer: str | None = None,
        obs_columns: Sequence[str] = (),
        genes: Sequence[str] | np.ndarray | None = None,
        join: str = "exact",
        obs_missing: str = "error",
        check_indices: bool = True,
        read_threads: int = 4,
        storage_options: dict | None = None,
    ):
        """Opens every file once to check it and read its metadata.

        Args:
            paths: One path or a sequence of paths, concatenated along cells in
                this order.
            block_size: Cells per record (block). Blocks never straddle files.
            layer: The matrix to read: None for `X`, `"raw"` for `raw/X`, any
                other name for `layers/<name>`.
            obs_columns: obs columns returned with every cell. Categorical,
                string and boolean columns come back as integer codes into
                `categories[name]` (shared by all files); numeric columns as
                numbers.
            genes: Optional gene selection applied at read time, within the
                genes `join` aligns: names (output in this order), a boolean
                mask or integer positions over the aligned genes.
            join: `"exact"`, `"inner"` or `"outer"`: how genes of files with
                different var names are aligned (see the class docstring).
            obs_missing: `"error"` or `"fill"`: what a file that lacks one of
                `obs_columns` gives (see the class docstring).
            check_indices: Check at every read that column indices are inside
                the matrix (one pass over the indices, a few percent of a read).
            read_threads: Threads per process that issue positional reads
                concurrently on large batches (cold cache). 0 reads inline.
            storage_options: For URLs (`s3://`, `gs://`, `https://`): obstore
                configuration (credentials, `endpoint_url`, `anon`, ...); see
                `grain_cells.storage.remote._store`. Pickled with the source.

        Raises:
            ValueError: `paths` is empty or an argument is out of range.
            FileNotFoundError: A path does not exist.
            errors.AnnDataFormatError: A file is not AnnData or is malformed,
                or an obs column is categorical in one file, numeric in another.
            errors.UnsupportedLayoutError: A matrix is CSC or otherwise unusable.
            errors.MissingColumnError: An obs column, gene or layer is missing.
            errors.GeneMismatchError: With `join="exact"`, files have different
                var names; with `"inner"`, no gene is in every file; with
                `"inner"` or `"outer"`, a file repeats a var name.
        """
        block_size = arguments.check_int("block_size", block_size, minimum=1)
        read_threads = arguments.check_int("read_threads", read_threads, minimum=0)
        genes = arguments.check_genes(genes)
        paths = arguments.paths_of(paths)  # a backed AnnData: its file
        if join not in JOINS:
            raise ValueError(f"join must be one of {list(JOINS)}, got join={join!r}")
        if obs_missing not in OBS_MISSING:
            raise ValueError(
                f"obs_missing must be one of {list(OBS_MISSING)}, got "
                f"obs_missing={obs_missing!r}"
            )
        resolved = h5ad.resolve_paths(paths)
        element = h5ad.matrix_element(layer)
        if isinstance(obs_columns, str):
            obs_columns = [obs_columns]
        obs_names = tuple(obs_columns)
        if len(set(obs_names)) != len(obs_names):
            raise ValueError(f"obs_columns has duplicates: {list(obs_columns)}")
        self._layer = layer
        self._obs_missing = obs_missing
        self._check_indices = bool(check_indices)
        self._files = FileSet.inspect(
            resolved,
            element=element,
            obs_names=obs_names,
            genes=genes,
            join=join,
            obs_missing=obs_missing,
            storage_options=storage_options,
        )
        self._table = BlockTable.grid(self._files.n_obs, block_size)
        self._handles = OpenFiles(self._files, read_threads)
        for i, path in enumerate(self._files.paths):  # objects' metadata once
            if object_store.is_url(path):
                self._handles.file(i)

    def view(self, table: BlockTable) -> AnnDataSource:
        """A source over the same files whose records are `table`'s blocks.

        The constructor behind `select`, `with_blocks` and the splits; the
        view has its own file handles. Logs a warning when the table is
        fragmented (blocks hold under half of `block_size` on average).

        Raises:
            ValueError: `table` is not over this source's files and block size.
        """
        if table.block_size != self.block_size or not np.array_equal(
            table.cell_offsets, self._table.cell_offsets
        ):
            raise ValueError(
                f"the block table is over {table.num_cells} cells in blocks of "
                f"{table.block_size}; this source has {self.num_cells} cells in "
                f"blocks of {self.block_size} (build the table from "
                "source.block_table)"
            )
        view = object.__new__(AnnDataSource)
        view.__dict__.update(self.__dict__)
        view._table = table
        view._handles = OpenFiles(self._files, self._handles.read_threads)
        if table.fragmented:
            lengths = table.stops - table.starts
            _log.warning(
                "%s: %s",
                table.blocks_id,
                block_table.fragment_note(lengths, table.block_size),
            )
        return view

    def close(self) -> None:
        """Closes this process's file handles; the source reopens on next use."""
        self._handles.close()

    def _file(self, i: int) -> OpenFile:
        """File `i`'s handles in this process (for tests of the readers)."""
        return self._handles.file(i)

    # -- Grain's RandomAccessDataSource protocol ---------------------------

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, record_key: int) -> Block:
        """Returns the descriptor of block `record_key` (no I/O)."""
        return self._table.block(record_key)._replace(source_id=self.source_id)

    @property
    def source_id(self) -> int:
        """A 56-bit id of this source or view: a hash of its `repr`.

        Equal for sources built alike on the same files, different for
        another view (split, selection) or other files.
        """
        sid = self.__dict__.get("_source_id")
        if sid is None:
            digest = hashlib.blake2b(repr(self).encode(), digest_size=7).digest()
            sid = self.__dict__["_source_id"] = int.from_bytes(digest, "little")
        return sid

    def __repr__(self) -> str:
        files = ", ".join(
            f"{p!r} ({i.n_obs} cells)"
            for p, i in zip(self._files.paths, self._files.infos, strict=True)
        )
        # Defaults print as before alignment existed, so saved reprs still match.
        obs_missing = (
            ""
            if self._obs_missing == "error"
            else f", obs_missing={self._obs_missing!r}"
        )
        # A view adds its block table's identity; the full source prints as
        # before views existed.
        table = self._table
        blocks = f", blocks={table.blocks_id}" if table.blocks_id else ""
        if table.blocks_id and table.fragmented:
            blocks += " (fragmented)"
        return (
            f"AnnDataSource(files=[{files}], layer={self._layer!r}, "
            f"block_size={self.block_size}, obs_columns={list(self.obs_columns)}, "
            f"{self._files.genes.describe()}{obs_missing}{blocks})"
        )

    # -- views over a subset of cells --------------------------------------

    def select(self, cells=None, *, where=None) -> AnnDataSource:
        """A view of this source over the cells that match; see `selection`.

        Records of the view are blocks over *runs* of selected cells: up to
        `block_size` consecutive selected cells of one file, so a block never
        straddles a file or a gap in the selection (a run shorter than
        `block_size`, or a run's tail, makes a short block). Row ids stay
        global (`num_cells`, `read`, `obs_values` and minibatch `row_ids`
        refer to all cells of the files). On a view, only cells already in it
        can be selected.

        Example:
            >>> immune = source.select(where={"cell_type": ["B", "T"]})
            >>> fresh = source.select(where={"n_genes": lambda v: v > 200})
            >>> some = source.select(row_ids)          # or a boolean mask

        Args:
            cells: A boolean mask over `num_cells`, or global row ids, or None.
            where: obs column name to the labels to keep, or to an elementwise
                predicate (see `grain_cells.source._selection.where_mask`). Columns
                must be among `obs_columns`.

        Returns:
            A new `AnnDataSource` (its own file handles) whose records are the
            selected blocks. Its `repr` names a hash of its block table.

        Raises:
            ValueError: The selection is empty or malformed.
            errors.MissingColumnError: A `where` column is not an obs column.
        """
        return self.view(selection.selected_blocks(self, cells, where))

    def with_blocks(self, starts, stops) -> AnnDataSource:
        """A view of this source whose records are the given row ranges.

        The low-level constructor behind `select` and the splits: record `k`
        of the view is global rows `[starts[k], stops[k])`. The view keeps a
        block table of 16 bytes per block (two int64 arrays), pickled to
        every worker with the source.

        Args:
            starts: Global first rows, strictly increasing.
            stops: Exclusive ends; each range holds 1 to `block_size` rows of
                one file, and ranges do not overlap.

        Returns:
            A new `AnnDataSource` with its own file handles.

        Raises:
            ValueError: No range, or ranges out of order, overlapping, empty,
                longer than `block_size` or straddling two files.
        """
        return self.view(self._table.with_blocks(starts, stops))


__all__ = ["AnnDataSource", "Block", "FetchedRows"]

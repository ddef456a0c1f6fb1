"""`AnnDataSource`: `.h5ad` files and zarr stores as a Grain random-access source.

A source binds three values to Grain's protocol: its `FileSet` (`files`:
the files as checked at build, `grain_cells.io._file_set`), its `BlockTable`
(`block_table`: which rows each block holds, `grain_cells.source._table`)
and its `SourceOptions` (`grain_cells.source._options`). Each process opens
its own handles (`OpenFiles`); reads are `grain_cells.io._range_reads`. A
view is a new source of the same files and options and another table.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Sequence

import numpy as np

from grain_cells._util import absl_flags
from grain_cells.io import Cells, FetchedRows, FileSet, OpenFile, RowBuffer
from grain_cells.source import _fragments, _options, _selection
from grain_cells.source._description import SourceDescription
from grain_cells.source._options import SourceOptions
from grain_cells.source._reads import FileReads
from grain_cells.source._table import Block, BlockTable
from grain_cells.storage.remote import is_url

_log = logging.getLogger("grain_cells")


class AnnDataSource(SourceDescription):
    """Cells of one or many `.h5ad` files or zarr stores, concatenated, as blocks.

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
        >>> AnnDataSource(["atlas.h5ad", "more.zarr"], join="outer")
        >>> AnnDataSource(census_parts, genes_from="feature_id", join="inner")

    **zarr stores** (what anndata's `write_zarr` writes: zarr v2 or v3,
    sharded or not, a directory, a `.zarr.zip` or a URL ending in `.zarr`)
    open wherever `.h5ad` files do, alone or in one list with them: every
    matrix, obs and var encoding anndata writes to zarr reads as from
    `.h5ad` (CSC refused by name). A store's identity is a digest of its
    keys, sizes and modification times (see `grain_cells.io._identity`),
    so a store rewritten under a source is detected when a process opens it
    and by `verify_files()`.

    **Views over a subset of cells.** `select(cells, where=...)`, the splits
    (`grain_cells.blocks`), `with_blocks(starts, stops)` and `view(table)`
    return a source over some cells only: the same files and options, another
    block table (runs of blocks, `grain_cells.source._table`), a `repr`
    naming a hash of it; row ids stay global. See `grain_cells.source._selection`.

    Memory per process: the handles (about a megabyte each) and chosen obs
    columns of the open files, at most `max_open_files` (one value per cell
    and column, in the smallest integer type that holds the codes; mapped
    from a cache file every process shares for files of 65,536 cells or
    more, `grain_cells.io._obs_cache`), the
    column maps of files whose genes differ from the output (4 bytes per
    stored gene, shared by files with equal var names), plus the read
    buffers (about 2x the largest batch read).
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
                stores, or URLs of either), concatenated along cells in this
                order.
            block_size: Cells per record (block). Blocks never straddle files.
                None: 16, or on a compressed matrix blocks along its chunk
                grid and loaders reading 64 blocks per fetch when given no
                `fetch_factor` (`grain_cells.source._chunk_grid`).
            layer: The matrix to read: None for `X`, `"raw"` for `raw/X`, any
                other name for `layers/<name>`.
            obs_columns: obs columns returned with every cell. Categorical,
                string and boolean columns come back as integer codes into
                `categories[name]` (shared by all files); numeric columns as
                numbers.
            genes: Optional gene selection applied at read time, within the
                genes `join` aligns: names (output in this order), a boolean
                mask or integer positions over the aligned genes.
            join: `"exact"` (the same var names in the same order), `"inner"`
                or `"outer"`: how genes of files with different var names are
                aligned (see `grain_cells.io._file_set`; categorical obs codes
                index one category list shared by all files).
            genes_from: None to key genes by var names, or a var column
                whose values key them in every file: `join` and `genes` then
                work on those keys, and `var_names` are keys. For atlases whose
                var names repeat or differ between files (CELLxGENE Census:
                `genes_from="feature_id"`, the Ensembl ids). Its values must be
                unique in each file (strings, categoricals or integers).
            obs_missing: `"error"` or `"fill"`: what a file that lacks one of
                `obs_columns` gives (see `grain_cells.io._file_set`).
            check_indices: Check at every read that column indices are inside
                the matrix (one pass over the indices, a few percent of a read).
            read_threads: Threads per process that read and decode large
                batches concurrently; 0 reads inline; `"auto"`: sized from
                the cores and worker count (`grain_cells._util.cores`).
            storage_options: For URLs (`s3://`, `gs://`, `https://`): obstore
                configuration (credentials, `endpoint_url`, `anon`, ...); see
                `grain_cells.storage.remote._store`. Pickled with the source.
                `content_check_s` (seconds, default 60; 0: at every read): how
                often, per process and object, iteration re-reads the
                sampled content digest of an object whose ETag cannot tell a
                rewrite (`grain_cells.storage.remote._versions`).
                `verify_reads=True`: every block read checked against
                digests of the whole object, read at each process's open
                (for `.h5ad` on HTTP servers that keep ETags across
                rewrites). `user_project`: the project billed by a GCS
                requester-pays bucket.
            max_open_files: Files each process keeps open at once (two
                descriptors and HDF5's caches each); opening another closes
                the least recently used one, which reopens (checked again)
                when next read. `"auto"`: 128, or an eighth of the
                process's descriptor limit if less
                (`grain_cells.io._file_lru`).

        Raises:
            ValueError: `paths` is empty or an argument is out of range.
            FileNotFoundError: A path does not exist.
            errors.AnnDataFormatError: A file is not AnnData or is malformed,
                or an obs column is categorical in one file, numeric in another.
            errors.UnsupportedLayoutError: A matrix is CSC or otherwise
                unusable, or the `genes_from` column holds floats or booleans.
            errors.MissingColumnError: An obs column, gene, layer or the
                `genes_from` column is missing.
            errors.GeneMismatchError: With `join="exact"`, files have different
                var names; with `"inner"`, no gene is in every file; with
                `"inner"` or `"outer"`, a file repeats a var name; a
                `genes_from` column repeats a value or misses one.
        """
        files, table, options = _options.build(
            paths,
            block_size=block_size,
            layer=layer,
            obs_columns=obs_columns,
            genes=genes,
            join=join,
            genes_from=genes_from,
            obs_missing=obs_missing,
            check_indices=check_indices,
            read_threads=read_threads,
            storage_options=storage_options,
            max_open_files=max_open_files,
        )
        self._bind(files, table, options)
        # Grain reads an absl flag when a grain.DataLoader starts workers.
        absl_flags.allow_unparsed()
        for i, path in enumerate(files.paths):  # objects' metadata once
            if is_url(path):
                self._reads.file(i)

    def _bind(self, files: FileSet, table: BlockTable, options: SourceOptions):
        """Holds these values; this process's handles open on first use."""
        SourceDescription.__init__(self, files, table, options)
        self._reads = FileReads(files, options)

    @classmethod
    def _of(
        cls, files: FileSet, table: BlockTable, options: SourceOptions
    ) -> AnnDataSource:
        """A source of these values (files already checked by `build`)."""
        source = cls.__new__(cls)
        source._bind(files, table, options)
        return source

    def __reduce__(self):  # pickles as its values: no handle, buffer or thread
        return AnnDataSource._of, (self.files, self.block_table, self.options)

    def view(self, table: BlockTable) -> AnnDataSource:
        """A source over the same files whose records are `table`'s blocks.

        The constructor behind `select`, `with_blocks` and the splits; the
        view has its own file handles. Logs a warning when the table is
        fragmented (blocks under half of `block_size`) and this source is not.

        Raises:
            ValueError: `table` is not over this source's files and block size.
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
            note = _fragments.fragment_note(table.mean_block_cells, table.block_size)
            _log.warning("%s: %s", table.blocks_id, note)
        return AnnDataSource._of(self.files, table, self.options)

    def select(self, cells=None, *, where=None) -> AnnDataSource:
        """A view of this source over the cells that match.

        Its records are blocks over *runs* of selected cells (never across a
        file or a gap; a run's tail makes a short block). Row ids stay global.
        On a view, only cells already in it can be selected.

        Example:
            >>> immune = source.select(where={"cell_type": ["B", "T"]})
            >>> fresh = source.select(where={"n_genes": lambda v: v > 200})
            >>> some = source.select(row_ids)          # or a boolean mask

        Args:
            cells: A boolean mask over `num_cells`, or global row ids, or None.
            where: obs column name (one of `obs_columns`) to the labels to
                keep, or to an elementwise predicate
                (`grain_cells.source._selection.where_mask`).

        Raises:
            ValueError: The selection is empty or malformed.
            errors.MissingColumnError: A `where` column is not an obs column.
        """
        return self.view(_selection.selected_blocks(self, cells, where))

    def with_blocks(self, starts, stops) -> AnnDataSource:
        """A view whose record `k` is global rows `[starts[k], stops[k])`.

        `view(block_table.with_blocks(starts, stops))`: the view's table
        holds its runs of consecutive blocks (24 bytes per run, at most 16 per
        block), pickled to every worker with the source.

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
        self._reads.close()

    def _file(self, i: int) -> OpenFile:
        """File `i`'s handles in this process (for tests of the readers)."""
        return self._reads.file(i)

    # -- Grain's RandomAccessDataSource protocol ---------------------------

    def __len__(self) -> int:
        return len(self.block_table)

    def __getitem__(self, record_key: int) -> Block:
        """Returns the descriptor of block `record_key` (no I/O)."""
        return self.block_table.block(record_key, self.source_id)

    @functools.cached_property
    def source_id(self) -> int:
        """A 56-bit id of this source or view: a hash of its `repr`.

        Equal for sources built alike on the same files, different for
        another view (split, selection) or other files.
        """
        digest = hashlib.blake2b(repr(self).encode(), digest_size=7).digest()
        return int.from_bytes(digest, "little")

    def __repr__(self) -> str:
        files = ", ".join(
            f"{p!r} ({i.n_obs} cells)"
            for p, i in zip(self.files.paths, self.files.infos, strict=True)
        )
        # A view adds its block table's identity, the full source does not.
        table = self.block_table
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

        Categorical columns come back as codes into `categories[column]`; see
        `FileReads.obs_values`.

        Raises:
            errors.MissingColumnError: `column` is not one of `obs_columns`.
        """
        return self._reads.obs_values(column)

    def chunk_starts(self) -> np.ndarray:
        """Global rows where an HDF5 chunk of the matrix begins, per file.

        See `FileReads.chunk_starts`.
        """
        return self._reads.chunk_starts()

    # -- reads (documented on `FileReads`) -------------------------------------

    def block_ranges(self, keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised `source[k]`: `(files, starts, stops)` of many blocks."""
        return self.block_table.ranges(keys)

    @property
    def hints_wanted(self) -> bool:
        """Whether `advise` would hint anything now (`FileReads.hints_wanted`)."""
        return self._reads.hints_wanted

    def advise(self, keys) -> None:
        """Hints that these blocks will be read soon; never raises.

        Local files: `posix_fadvise(WILLNEED)`; objects in a bucket: their
        range GETs start in the background (`grain_cells.storage.remote`).
        """
        try:
            ranges = self.block_table.ranges(np.unique(keys))
        except Exception:  # a hint must never fail the pipeline
            return
        self._reads.advise(*ranges)

    def fetch_ranges(
        self, starts: np.ndarray, stops: np.ndarray, buffer: RowBuffer | None = None
    ) -> FetchedRows:
        """Reads global row ranges, in file order, into this thread's buffer.

        The lowest-level read (`FileReads.fetch_ranges`): the rows are views
        that the calling thread's next read overwrites.
        """
        return self._reads.fetch_ranges(starts, stops, buffer)

    def read_ranges(self, starts, stops) -> Cells:
        """Reads global row ranges `[starts[i], stops[i])`, in the order given.

        Returns fresh arrays (`FileReads.read_ranges`).
        """
        return self._reads.read_ranges(starts, stops)

    def read(self, rows) -> Cells:
        """Reads rows by global id, in the order given (repeats allowed).

        Returns fresh arrays (`FileReads.read_rows`).

        Raises:
            IndexError: A row is outside `[0, num_cells)`.
        """
        return self._reads.read_rows(rows)

    def read_blocks(self, keys) -> Cells:
        """Reads whole blocks (records), in the order given."""
        blocks = [self.block_table.block(int(k)) for k in np.asarray(keys).reshape(-1)]
        return self.read_ranges([b.start for b in blocks], [b.stop for b in blocks])


__all__ = ["AnnDataSource", "Block", "FetchedRows", "SourceOptions"]

"""`FileReads`: one process's batched reads of a source's files.

An `AnnDataSource` holds one `FileReads` over its `FileSet`: the process's
handles (`OpenFiles`: each file opened on first use, at most
`max_open_files` at once, per-thread buffers, the read threads) and the
reads of global row ranges, rows, obs columns and chunk starts through
`grain_cells.io._range_reads`. It pickles as its file set and options,
without any handle; after a fork the child opens its own. A view of a
source holds a new `FileReads` over the same files (its own handles).

Design notes: docs/reference/design.md#source-reads.
"""

from __future__ import annotations

import numpy as np

from grain_cells import errors
from grain_cells.io import (
    Cells,
    FetchedRows,
    FileSet,
    OpenFile,
    OpenFiles,
    RowBuffer,
    advise,
    fetch_ranges,
    joined_column,
    own_map,
    read_ranges,
    read_rows,
)
from grain_cells.source._options import SourceOptions, file_chunk_starts


class FileReads:
    """Reads of a `FileSet`'s rows in this process; thread-safe, picklable.

    Attributes:
        files: The files.
        options: How they are read (`check_indices`, `read_threads`,
            `max_open_files`).
        cell_offsets: Global row of each file's first cell, plus the total.
    """

    def __init__(self, files: FileSet, options: SourceOptions):
        """Opens nothing yet: each file opens on first use."""
        self.files = files
        self.options = options
        self.cell_offsets = np.concatenate([[0], np.cumsum(files.n_obs)])
        self._handles = OpenFiles(files, options.read_threads, options.max_open_files)

    def __reduce__(self):
        return FileReads, (self.files, self.options)

    def file(self, i: int) -> OpenFile:
        """File `i`'s handles in this process, opened on first use."""
        return self._handles.file(i)

    def close(self) -> None:
        """Closes this process's handles; files reopen on next use."""
        self._handles.close()

    def fetch_ranges(
        self, starts, stops, buffer: RowBuffer | None = None
    ) -> FetchedRows:
        """Reads global row ranges into this thread's reused buffer.

        The lowest-level read: ranges are grouped by file and sorted, read with
        one batched call per file and dataset, and returned in *file order*
        (not the order given) as views into a buffer that the calling thread's
        next read overwrites. `row_ids` says which row is where. Rows are in
        output columns (`var_names`): each file's genes aligned and selected.
        `buffer` defaults to the calling thread's. A range outside the source
        or straddling two files raises `IndexError`; ranges must not overlap.
        """
        return fetch_ranges(
            self._handles,
            self.cell_offsets,
            starts,
            stops,
            buffer,
            check_indices=self.options.check_indices,
        )

    def read_ranges(self, starts, stops) -> Cells:
        """Reads global row ranges `[starts[i], stops[i])`, in the order given.

        Ranges must not overlap or straddle files; the rows come range after
        range as fresh arrays owned by the caller.
        """
        return read_ranges(
            self._handles,
            self.cell_offsets,
            starts,
            stops,
            check_indices=self.options.check_indices,
        )

    def read_rows(self, rows) -> Cells:
        """Reads rows by global id, in the order given (repeats allowed).

        Rows are coalesced into runs of consecutive ids, read with one batched
        call per file and dataset, then gathered into the order asked, as
        fresh arrays owned by the caller. A row outside `[0, num_cells)`
        raises `IndexError`.
        """
        return read_rows(
            self._handles,
            self.cell_offsets,
            rows,
            check_indices=self.options.check_indices,
        )

    @property
    def hints_wanted(self) -> bool:
        """Whether `advise` would hint anything now.

        False while this process's reads find the page cache warm
        (`OpenFiles.cache_warm`): callers may skip working out what to hint.
        """
        return not self._handles.cache_warm

    def advise(self, files, starts, stops) -> None:
        """Asks the OS to start reading these ranges into the page cache.

        Returns quickly: the reads run in the background, so a later batched
        read of the ranges finds them cached. Advisory only: it never raises
        (a bad file is reported by the read itself) and does nothing for
        compressed data, which h5py reads. `files`: the file of each global
        range `[starts[i], stops[i])`.
        """
        try:
            advise(self._handles, self.cell_offsets, files, starts, stops)
        except Exception:  # a hint must never fail the pipeline
            return

    def obs_values(self, column: str) -> np.ndarray:
        """One obs column for every cell of the files, in row-id order.

        Categorical columns come back as codes into the column's categories
        (harmonised across files). Read-only. For one file, no copy: with
        the obs cache, a map of the cache entry of the caller's own (the
        pages are unmapped when the caller drops it); else a view of the
        file's column. Several files' columns are joined into one array,
        mapped from one cache entry for the collection (`joined_column`:
        after the first time, no file is opened).

        Raises:
            errors.MissingColumnError: `column` is not one of the obs columns.
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
        """Global rows where an HDF5 chunk of the matrix begins, per file.

        For CSR, a row belongs to the chunk of `data` that holds its first
        value; for dense, chunks are runs of rows. Each file's first row is
        included; a contiguous matrix contributes only that. Opens every file
        in this process (and, for CSR, scans each `indptr` once) unless the
        user's cache holds a file's starts (`_chunk_cache`).
        """
        parts = [
            file_chunk_starts(self.files, self._handles, i) + self.cell_offsets[i]
            for i in range(len(self.files.paths))
        ]
        return np.unique(np.concatenate(parts))


__all__ = ["FileReads"]

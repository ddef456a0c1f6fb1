"""The public reads of a source: rows, row ranges and blocks, batched.

`SourceReads` is `AnnDataSource`'s base (after `SourceInfo`, its read-only
properties): every method here reads through `grain_cells.io._range_reads` with
the source's file handles (`_handles`), block table (`_table`) and
`_check_indices`; nothing here changes the source.
"""

from __future__ import annotations

import numpy as np

from grain_cells.io import _range_reads as range_reads
from grain_cells.io._cells import Cells
from grain_cells.io._matrix import RowBuffer
from grain_cells.io._range_reads import FetchedRows
from grain_cells.source._info import SourceInfo


class SourceReads(SourceInfo):
    """Batched reads of a source's cells (see `AnnDataSource`).

    Attributes set by the subclass: those of `SourceInfo`, and
    `_check_indices`.
    """

    _check_indices: bool

    def block_ranges(self, keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised `source[k]`: `(files, starts, stops)` of many blocks."""
        return self._table.ranges(keys)

    def will_need(self, keys) -> None:
        """Asks the OS to start reading these blocks into the page cache.

        Returns quickly: the reads run in the background, so a later batched
        read of the blocks finds them cached. Advisory only: it never raises
        (a bad file is reported by the read itself) and does nothing for
        compressed data, which h5py reads.

        Args:
            keys: Block record keys.
        """
        try:
            files, starts, stops = self._table.ranges(np.unique(keys))
            range_reads.advise(
                self._handles, self._table.cell_offsets, files, starts, stops
            )
        except Exception:  # a hint must never fail the pipeline
            return

    def fetch_ranges(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        buffer: RowBuffer | None = None,
    ) -> FetchedRows:
        """Reads global row ranges into this thread's reused buffer.

        The lowest-level read: ranges are grouped by file and sorted, read with
        one batched call per file and dataset, and returned in *file order*
        (not the order given) as views into a buffer that the calling thread's
        next read overwrites. `row_ids` says which row is where. Rows are in
        output columns (`var_names`): each file's genes aligned and selected.

        Args:
            starts: Global first rows; ranges must not overlap or straddle files.
            stops: Matching exclusive ends.
            buffer: Buffer to read into; defaults to the calling thread's.

        Raises:
            IndexError: A range is outside the source or straddles two files.
        """
        return range_reads.fetch_ranges(
            self._handles,
            self._table.cell_offsets,
            starts,
            stops,
            buffer,
            check_indices=self._check_indices,
        )

    def read_ranges(self, starts, stops) -> Cells:
        """Reads global row ranges `[starts[i], stops[i])`, in the order given.

        Args:
            starts: First rows (global ids).
            stops: Exclusive ends. Ranges must not overlap or straddle files.

        Returns:
            The rows, range after range, as fresh arrays owned by the caller.
        """
        return range_reads.read_ranges(
            self._handles,
            self._table.cell_offsets,
            starts,
            stops,
            check_indices=self._check_indices,
        )

    def read(self, rows) -> Cells:
        """Reads rows by global id, in the order given (repeats allowed).

        Rows are coalesced into runs of consecutive ids, read with one batched
        call per file and dataset, then gathered into the order asked.

        Args:
            rows: Global row ids (ints).

        Returns:
            The rows as fresh arrays owned by the caller.

        Raises:
            IndexError: A row is outside `[0, num_cells)`.
        """
        return range_reads.read_rows(
            self._handles,
            self._table.cell_offsets,
            rows,
            check_indices=self._check_indices,
        )

    def read_blocks(self, keys) -> Cells:
        """Reads whole blocks (records), in the order given."""
        blocks = [self._table.block(int(k)) for k in np.asarray(keys).reshape(-1)]
        return self.read_ranges([b.start for b in blocks], [b.stop for b in blocks])

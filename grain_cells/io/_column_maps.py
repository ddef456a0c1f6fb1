"""Column maps: one file's stored columns in the output gene space, applied to rows.

A `ColumnMap` (made by `grain_cells.io._genes.align_genes`) gives the output
column of every column a file stores, -1 where that gene is not output.
`remap_csr` and `gather_dense` apply the maps to rows right after they are
read (`grain_cells.io._range_reads`), so every later step (gathers, output
formats) sees output columns only. A file whose stored columns are exactly
the output columns has no map (`None`): its rows are used as read, at no
cost. With any other map a read costs one gather over the column indices
(and, when some stored genes are not output, one compaction pass) per fetch;
dense rows cost one column gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from grain_cells.io._matrix import RowBuffer


@dataclasses.dataclass(frozen=True)
class ColumnMap:
    """Where one file's stored columns go in the output.

    Attributes:
        out: int32 output column of each stored column, -1 where the gene is
            not output.
        drops: Whether some stored column is not output (`out` has a -1).
        increasing: Whether the output columns of the kept stored columns
            increase with the stored order, so rows stay sorted by column.
    """

    out: np.ndarray
    drops: bool
    increasing: bool

    @classmethod
    def from_out(cls, out: np.ndarray) -> ColumnMap:
        """Builds the map and its flags from output columns (-1: dropped)."""
        out = np.asarray(out, np.int32)
        kept = out[out >= 0]
        return cls(
            out,
            bool(kept.size != out.size),
            bool(np.all(kept[1:] > kept[:-1])),
        )

    def sources(self, n_out: int) -> np.ndarray:
        """Stored column of each output column, -1 where the file lacks it."""
        src = np.full(n_out, -1, np.int64)
        kept = np.flatnonzero(self.out >= 0)
        src[self.out[kept]] = kept
        return src


def remap_csr(
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    parts: Sequence[tuple[int, int, ColumnMap | None]],
    buf: RowBuffer,
    checked: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Moves CSR rows read from several files into output columns.

    Vectorised: one gather per file over its column indices, then, when some
    stored genes are not output, one compaction over all values.

    Args:
        data: Stored values of all rows.
        indices: Their stored columns.
        indptr: Row pointers into `data`.
        parts: Per file, in buffer order: `(first value, end value, map)`;
            the spans cover `data`.
        buf: Buffer for the results (keys `aligned_*`).
        checked: Whether `indices` were checked to lie inside their files'
            matrices (else an out-of-range index raises `IndexError`).

    Returns:
        `(data, indices, indptr)` in output columns: the inputs themselves
        when no file has a map, else views into `buf` (indices int32).
        Within a row, values keep their stored order.
    """
    if all(m is None for _, _, m in parts):
        return data, indices, indptr
    nnz = indices.shape[0]
    mapped = buf.get("aligned_indices", (nnz,), np.int32)
    drops = False
    for first, end, column_map in parts:
        if column_map is None:
            mapped[first:end] = indices[first:end]
            continue
        np.take(
            column_map.out,
            indices[first:end],
            out=mapped[first:end],
            mode="clip" if checked else "raise",
        )
        drops |= column_map.drops
    if not drops:
        return data, mapped, indptr
    # Kept values per row (reduceat beats a cumsum over every value); the
    # trailing False lets the last row's span end inside the array.
    keep = buf.get("aligned_keep", (nnz + 1,), bool)
    keep[nnz] = False
    np.greater_equal(mapped, 0, out=keep[:nnz])
    starts = indptr[:-1]
    new_indptr = buf.get("aligned_indptr", indptr.shape, np.int64)
    new_indptr[0] = 0
    if starts.size:
        counts = np.add.reduceat(keep, starts, dtype=np.int64)
        counts[starts == indptr[1:]] = 0  # reduceat gives empty rows one value
        np.cumsum(counts, out=new_indptr[1:])
    n_kept = int(new_indptr[-1])
    keep = keep[:nnz]
    new_data = buf.get("aligned_data", (n_kept,), data.dtype)
    np.compress(keep, data, out=new_data)
    new_indices = buf.get("aligned_kept_indices", (n_kept,), np.int32)
    np.compress(keep, mapped, out=new_indices)
    return new_data, new_indices, new_indptr


def gather_dense(
    part: np.ndarray, column_map: ColumnMap | None, out: np.ndarray
) -> None:
    """Writes dense rows of one file into `out` in output columns.

    Args:
        part: `(rows, stored genes)` as read.
        column_map: The file's map, or None when its columns are the output's.
        out: `(rows, output genes)` destination; genes the file lacks get 0.
    """
    if column_map is None:
        out[...] = part
        return
    src = column_map.sources(out.shape[1])
    present = src >= 0
    if present.all():
        if part.dtype == out.dtype:
            np.take(part, src, axis=1, out=out, mode="clip")
        else:
            out[...] = part[:, src]
        return
    out[:, ~present] = 0
    out[:, present] = part[:, src[present]]

"""Rows in output columns: column maps applied after a read, gathers, `Cells`.

`remap_csr`/`gather_dense` apply a file's `ColumnMap` right after a read, so
every later step (`take_csr`, output formats) sees output columns only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from grain_cells.io._matrix import CsrRows, RowBuffer

if TYPE_CHECKING:  # workers never build a csr_matrix: no scipy at their start
    import scipy.sparse as sp


@dataclasses.dataclass
class Cells:
    """Rows of a source in the order they were asked for.

    `X`: CSR if sparse, else ndarray; `obs`: one value per row (codes for
    categorical columns, see `AnnDataSource.categories`); `row_ids`: global rows.
    """

    X: sp.csr_matrix | np.ndarray
    obs: dict[str, np.ndarray]
    row_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.row_ids.shape[0])


@dataclasses.dataclass(frozen=True)
class ColumnMap:
    """A file's stored columns in output columns (`out`: int32, -1 dropped)."""

    out: np.ndarray
    drops: bool
    increasing: bool

    @classmethod
    def from_out(cls, out: np.ndarray) -> ColumnMap:
        out = np.asarray(out, np.int32)
        kept = out[out >= 0]
        return cls(out, bool(kept.size != out.size), bool(np.all(kept[1:] > kept[:-1])))


def remap_csr(
    data: np.ndarray,
    indices: np.ndarray,
    indptr: np.ndarray,
    parts: Sequence[tuple[int, int, ColumnMap | None]],
    buf: RowBuffer,
    checked: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR rows of several files in output columns (views into `buf`).

    `parts`: per file, its span of values and its map; no map at all returns
    the inputs. `checked`: indices are known in range (else `IndexError`).
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


def gather_dense(part: np.ndarray, column_map: ColumnMap | None, out) -> None:
    """Writes one file's dense rows into `out` in output columns (absent: 0)."""
    if column_map is None:
        out[...] = part
        return
    src = np.full(out.shape[1], -1, np.int64)  # stored column of each output one
    kept = np.flatnonzero(column_map.out >= 0)
    src[column_map.out[kept]] = kept
    present = src >= 0
    if present.all():
        if part.dtype == out.dtype:
            np.take(part, src, axis=1, out=out, mode="clip")
        else:
            out[...] = part[:, src]
        return
    out[:, ~present] = 0
    out[:, present] = part[:, src[present]]


def take_csr(
    rows_buf: CsrRows, rows: np.ndarray, *, dtype=None, n_rows=None, empty=np.empty
):
    """Rows `rows` (repeats allowed) of a buffer as fresh `(data, indices, indptr)`.

    `dtype`: of `data` (None: the buffer's); `n_rows`: rows of the result,
    empty ones padding the end; `empty`: allocates (`np.empty`'s signature).
    """
    rows = np.asarray(rows, np.int64)
    n = rows.size
    lengths, lo, hi, s_data, s_idx = _spans(rows_buf)
    n_rows = n if n_rows is None else int(n_rows)
    indptr = empty((n_rows + 1,), np.int64)
    indptr[0] = 0
    lengths[rows].cumsum(out=indptr[1 : n + 1])
    total = int(indptr[n])
    indptr[n + 1 :] = total
    data = empty((total,), rows_buf.data.dtype if dtype is None else dtype)
    indices = empty((total,), np.int32)
    if n == 0:
        return data, indices, indptr
    follows = rows[1:] == rows[:-1] + 1
    if (
        lo is not None  # (the buffer's arrays: 4-byte, contiguous, int32 indices)
        and data.dtype == rows_buf.data.dtype
        and data.flags.c_contiguous
        and indices.flags.c_contiguous
        and not np.count_nonzero(follows)
    ):
        # Shuffled rows, as raw bytes: one slice each at the listed offsets.
        d_data, d_idx = memoryview(data).cast("B"), memoryview(indices).cast("B")
        c = 0
        for r in rows.tolist():
            a, b = lo[r], hi[r]
            d = c + b - a
            d_data[c:d] = s_data[a:b]
            d_idx[c:d] = s_idx[a:b]
            c = d
        return data, indices, indptr
    pairs = ((data, rows_buf.data), (indices, rows_buf.indices))
    views = [_as_bytes(d, s) for d, s in pairs]
    src = rows_buf.indptr
    begin, end = src[rows], src[rows + 1]
    if follows.any():
        # Runs of rows that follow each other in the buffer copy as one slice.
        breaks = np.flatnonzero(~follows) + 1
        heads = np.concatenate([[0], breaks])
        tails = np.concatenate([breaks, [n]])
        runs = (begin[heads], end[tails - 1], indptr[heads], indptr[tails])
    else:  # shuffled rows: one slice each
        runs = (begin, end, indptr[:n], indptr[1 : n + 1])
    if all(v is not None for v in views) and data.itemsize == indices.itemsize:
        # Both arrays as raw bytes in one loop, without a NumPy view per slice.
        k = data.itemsize
        (d_data, s_data), (d_idx, s_idx) = ([memoryview(x) for x in v] for v in views)
        for a, b, c, d in zip(*((r * k).tolist() for r in runs), strict=True):
            d_data[c:d] = s_data[a:b]
            d_idx[c:d] = s_idx[a:b]
    else:
        for dst, src_ in pairs:
            _copy_runs(dst, src_, *runs)
    return data, indices, indptr


def _spans(rows_buf: CsrRows) -> tuple:
    """`(lengths, lo, hi, data, indices)` of `rows_buf`, made on its first
    gather (a fetch's minibatches share them): its row lengths, and where both
    arrays are 4-byte, each row's first and end byte (lists) and the arrays as
    bytes (else Nones).
    """  # noqa: D205
    if rows_buf.spans is None:
        ptr, data, indices = rows_buf.indptr, rows_buf.data, rows_buf.indices
        spans = (ptr[1:] - ptr[:-1], None, None, None, None)
        views = [_as_bytes(a, a) for a in (data, indices)]
        if data.itemsize == 4 and indices.dtype == np.int32 and all(views):
            at = ptr * 4
            bytes_ = (memoryview(v[0]) for v in views)
            spans = (spans[0], at[:-1].tolist(), at[1:].tolist(), *bytes_)
        rows_buf.spans = spans
    return rows_buf.spans


def _as_bytes(dst: np.ndarray, src: np.ndarray):
    """`(dst, src)` as uint8 arrays when a byte copy is a faithful one, else None."""
    if dst.dtype != src.dtype or not (
        dst.flags.c_contiguous and src.flags.c_contiguous
    ):
        return None
    return dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)


def _copy_runs(dst, src, s_from, s_to, d_from, d_to) -> None:
    """`dst[d_from[i]:d_to[i]] = src[s_from[i]:s_to[i]]` for every run i."""
    both = _as_bytes(dst, src)
    if both is not None:
        k = dst.itemsize
        d_view, s_view = (memoryview(x) for x in both)
        runs = zip(
            *((r * k).tolist() for r in (s_from, s_to, d_from, d_to)), strict=True
        )
        for a, b, c, d in runs:
            d_view[c:d] = s_view[a:b]
        return
    for a, b, c, d in zip(
        s_from.tolist(), s_to.tolist(), d_from.tolist(), d_to.tolist(), strict=True
    ):
        dst[c:d] = src[a:b]  # casts (e.g. int64 indices to int32)

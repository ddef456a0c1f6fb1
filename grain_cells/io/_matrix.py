"""Row ranges of one file's matrix (CSR or dense) read into reused buffers.

A CSR read is two phases: every range's `indptr` (one batched read), then the
`data` and `indices` spans (one each). `indptr` must not decrease and columns
must lie inside the matrix; a violation names the file and row.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import merge_touching
from grain_cells.formats import value_dtype, wait_all
from grain_cells.io._direct_csr import split_indptr
from grain_cells.io._h5ad import CSR, OBSM, MatrixInfo
from grain_cells.io._nodes import format_of, is_array

# Decoded `indptr` chunks kept per process, all files together (compressed
# `indptr`: a fetch reads a few entries per block).
INDPTR_CACHE_BYTES = 64 << 20
# `indptr` entries per read of `scan_chunk_starts` (8 MiB of int64).
SCAN_ROWS = 1 << 20


@dataclasses.dataclass
class CsrRows:
    """Rows of a CSR matrix as views into a `RowBuffer`; `indptr` int64 from 0."""

    data: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray
    n_vars: int
    # `take_csr`'s per-row offsets, made once for every gather of these rows.
    spans: tuple | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )


@dataclasses.dataclass
class CsrPlan:
    """Merged ranges with checked `indptr`: `data` spans and int64 row pointers."""

    starts: np.ndarray
    lengths: np.ndarray
    firsts: np.ndarray
    lasts: np.ndarray
    indptr: np.ndarray

    @property
    def nnz(self) -> int:
        return int(self.indptr[-1])

    @property
    def n_rows(self) -> int:
        return self.indptr.shape[0] - 1


class RowBuffer:
    """Growable arrays reused across reads (one per thread: not thread-safe)."""

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """Returns a C-contiguous view of `shape`, reallocating only to grow."""
        dtype = np.dtype(dtype)
        n = int(math.prod(shape)) * dtype.itemsize
        arr = self._arrays.get(name)
        if arr is None or arr.size < n:
            arr = np.empty(max(n, 2 * (arr.size if arr is not None else 0)), np.uint8)
            self._arrays[name] = arr
        return arr[:n].view(dtype).reshape(shape)


class _Reader:
    """Row ranges of one file's matrix, through a range reader per array (`arrays`).

    `group`: the element the readers were made from (None: from byte layouts).
    """

    def __init__(self, info: MatrixInfo, arrays: dict, fd, group=None):
        self.info, self.arrays, self._fd, self._group = info, arrays, fd, group


class CsrReader(_Reader):
    """Reads row ranges of one file's CSR matrix."""

    def __init__(self, info: MatrixInfo, arrays: dict, fd, group=None):
        super().__init__(info, arrays, fd, group)
        self._data, self._indices = arrays["data"], arrays["indices"]
        self._indptr = arrays["indptr"]

    @classmethod
    def open(cls, group, info: MatrixInfo, fd) -> CsrReader:
        """Range readers over `group`'s arrays (`fd`: a `ByteReader` or None)."""
        # All-fill chunks may be unwritten (checked: `check_filled_indices`), in
        # `indptr` only leading empty rows' all-zero ones.
        fill = {"data": "zero", "indices": "zero", "indptr": "leading"}
        read, c = format_of(group).range_reader, {"indptr": INDPTR_CACHE_BYTES}
        arrays = {
            k: read(group[k], info.path, fd, cache_bytes=c.get(k, 0), fill_missing=f)
            for k, f in fill.items()
        }
        arrays["indptr"].pin()
        return cls(info, arrays, fd, group)

    @property
    def direct(self) -> bool:
        """Whether data and indices are read without the format's library."""
        return self._data.direct and self._indices.direct

    @property
    def dtypes(self) -> tuple[np.dtype, np.dtype]:
        """Dtypes of the stored values and of the column indices."""
        return self._data.dtype, self._indices.dtype

    def plan(
        self, starts: np.ndarray, stops: np.ndarray, buf: RowBuffer, key: str = "ptr"
    ) -> CsrPlan:
        """Phase one: reads and checks ranges' `indptr` (scratch: `buf[key]`)."""
        starts, stops = merge_touching(starts, stops)
        lengths = stops - starts
        n_rows = int(lengths.sum())
        # Every range's indptr slice has one entry more than it has rows.
        ptr = buf.get(key, (n_rows + starts.size,), self._indptr.dtype)
        self._indptr.read(starts, stops + 1, ptr)
        ptr = ptr.astype(np.int64, copy=False)
        indptr = np.empty(n_rows + 1, np.int64)
        ends = split_indptr(ptr, lengths, self.info.nnz, indptr)
        if ends is None:
            self._raise_indptr(ptr, lengths, starts)
        return CsrPlan(starts, lengths, *ends, indptr)

    def read_values(
        self, plan: CsrPlan, data, indices, pool=None, check_indices: bool = True
    ) -> None:
        """Phase two: reads the planned values (file dtypes), checks columns."""
        if plan.nnz and self._indices.remote:  # both datasets' GETs at once
            self._indices.advise(plan.firsts, plan.lasts)
        try:
            # Compressed: both datasets' chunks decode in one wave of tasks.
            pending: list = []
            try:
                self._data.read(plan.firsts, plan.lasts, data, pool, pending)
                self._indices.read(plan.firsts, plan.lasts, indices, pool, pending)
            finally:
                wait_all(pending)
        except errors.CorruptChunkError as e:  # name the cells the chunk holds
            try:
                lo = self._row_of_value(e.rows[0])
                hi = self._row_of_value(e.rows[1] - 1)
            except errors.AnnDataFormatError:
                raise e from None
            raise errors.CorruptChunkError(
                f"{e} Those are values of cells (rows) [{lo}, {hi + 1}) of "
                f"{self.info.element}.",
                path=e.path,
                dataset=e.dataset,
                byte_offset=e.byte_offset,
                rows=(lo, hi + 1),
            ) from None
        check_filled_indices(self._indices, plan, indices, self.info)
        if check_indices and plan.nnz:
            self._check_indices(plan, indices)

    def chunk_starts(self) -> np.ndarray:
        """Local rows where a chunk of `data` begins (`[0]` if contiguous)."""
        length = self._data.chunk_length
        n = self.info.n_obs
        if length is None or n == 0:
            return np.zeros(1, np.int64)
        if self._group is None:  # reopened from byte layouts: nothing cached
            return scan_chunk_starts(self._indptr, n, length)
        reader = format_of(self._group).range_reader(
            self._group["indptr"], self.info.path, self._fd, fill_missing="leading"
        )
        return scan_chunk_starts(reader, n, length)

    def _row_of_value(self, k: int) -> int:
        """The row whose values include value `k` (binary search on indptr)."""
        lo, hi = 0, self.info.n_obs  # indptr[lo] <= k < indptr[hi]
        one = np.empty(1, self._indptr.dtype)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            self._indptr.read(np.array([mid]), np.array([mid + 1]), one)
            lo, hi = (mid, hi) if int(one[0]) <= k else (lo, mid)
        return lo

    def _check_indices(self, plan: CsrPlan, indices: np.ndarray) -> None:
        info = self.info
        # One pass: negative indices viewed as unsigned exceed any n_vars.
        unsigned = indices.view(np.dtype(f"u{indices.dtype.itemsize}"))
        if int(unsigned.max()) < info.n_vars:
            return
        bad = np.flatnonzero((indices < 0) | (indices >= info.n_vars))[0]
        pos = int(np.searchsorted(plan.indptr, bad, side="right")) - 1
        raise errors.CorruptDataError(
            f"{info.path}: {info.element}/indices holds column "
            f"{int(indices[bad])} in row {_stored_row(plan, pos)}; columns must "
            f"lie in [0, {info.n_vars})"
        )

    def advise(self, starts: np.ndarray, stops: np.ndarray, buf: RowBuffer) -> None:
        """Hints the OS to read these rows' `data` and `indices` spans."""
        starts, stops = merge_touching(starts, stops)
        if starts.size == 0:
            return
        points = np.unique(np.concatenate([starts, stops]))
        values = buf.get("advise_ptr", (points.size,), self._indptr.dtype)
        self._indptr.read(points, points + 1, values)
        values = values.astype(np.int64)
        first = values[np.searchsorted(points, starts)]
        last = values[np.searchsorted(points, stops)]
        self._data.advise(first, last)
        self._indices.advise(first, last)

    def _raise_indptr(self, ptr, lengths, starts) -> None:
        """Raises CorruptDataError naming the first row whose `indptr` is wrong."""
        nnz, heads = self.info.nnz, np.cumsum(lengths + 1) - (lengths + 1)
        step = np.diff(ptr, append=ptr[-1])
        step[heads[1:] - 1] = 0  # the step from one range into the next
        pos = int(np.flatnonzero((step < 0) | (ptr < 0) | (ptr > nnz))[0])
        rng = int(np.searchsorted(heads, pos, side="right")) - 1
        row = int(starts[rng] + (pos - heads[rng]))
        raise errors.CorruptDataError(
            f"{self.info.path}: {self.info.element}/indptr is corrupt at row {row}: "
            f"indptr[{row}]={int(ptr[pos])}, indptr[{row + 1}]="
            f"{int(ptr[min(pos + 1, ptr.size - 1)])}; entries must not decrease "
            f"and must lie in [0, {nnz}]"
        )


def _stored_row(plan: CsrPlan, pos: int) -> int:
    """The file's row of the plan's `pos`-th row read."""
    ends = np.cumsum(plan.lengths)
    at = int(np.searchsorted(ends, pos, side="right"))
    return int(plan.starts[at] + pos - (ends[at] - plan.lengths[at]))


class DenseReader(_Reader):
    """Reads row ranges of one file's dense 2-D matrix (array `KEY` of `arrays`)."""

    KEY = "x"
    FILL = True  # an unwritten all-zero chunk reads as zeros (as anndata does)

    def __init__(self, info: MatrixInfo, arrays: dict, fd, group=None):
        super().__init__(info, arrays, fd, group)
        self._x = arrays[self.KEY]

    @classmethod
    def open(cls, dataset, info: MatrixInfo, fd):
        """A range reader over `dataset`."""
        x = format_of(dataset).range_reader(
            dataset, info.path, fd, fill_missing=cls.FILL
        )
        return cls(info, {cls.KEY: x}, fd, dataset)

    @property
    def direct(self) -> bool:
        """Whether rows are read without the format's library."""
        return self._x.direct

    def chunk_starts(self) -> np.ndarray:
        """Local rows where a chunk of rows begins (`[0]` when contiguous)."""
        length = self._x.chunk_length
        if length is None:
            return np.zeros(1, np.int64)
        return np.arange(0, max(self.info.n_obs, 1), length, dtype=np.int64)

    def advise(self, starts: np.ndarray, stops: np.ndarray, buf: RowBuffer) -> None:
        self._x.advise(starts, stops)

    def read(
        self, starts: np.ndarray, stops: np.ndarray, buf: RowBuffer, pool=None
    ) -> np.ndarray:
        """Reads rows `[starts[i], stops[i])` into a `(rows, n_vars)` view."""
        starts, stops = np.asarray(starts, np.int64), np.asarray(stops, np.int64)
        shape = (int((stops - starts).sum()), *self._x.row_shape)
        out = buf.get(self.KEY, shape, self._x.dtype)
        self._x.read(starts, stops, out, pool)
        return out


def scan_chunk_starts(reader, n_rows: int, values_per_chunk: int) -> np.ndarray:
    """Local rows where a chunk of values begins (a row: its first value's chunk).

    `reader` reads `indptr` (best uncached: the scan reads every chunk once).
    """
    n = int(n_rows)
    ptr_chunk = reader.chunk_length or SCAN_ROWS
    piece = max(1, SCAN_ROWS // ptr_chunk) * ptr_chunk
    last = np.empty(1, reader.dtype)
    reader.read(np.array([n]), np.array([n + 1]), last)
    n_chunks = max(1, -(-int(last[0]) // values_per_chunk))
    targets = np.arange(n_chunks, dtype=np.int64) * values_per_chunk
    starts = np.full(n_chunks, n, np.int64)  # "no row reaches it" until found
    buf = np.empty(min(piece, n), reader.dtype)
    done = 0
    for a in range(0, n, piece):
        if done == n_chunks:
            break
        b = min(a + piece, n)
        ptr = buf[: b - a]
        reader.read(np.array([a]), np.array([b]), ptr)
        ptr = ptr.astype(np.int64, copy=False)
        # Targets up to this piece's last pointer are passed inside it.
        upto = int(np.searchsorted(targets, ptr[-1], side="right"))
        if upto > done:
            found = np.searchsorted(ptr, targets[done:upto], side="left")
            starts[done:upto] = a + found
            done = upto
    starts = np.unique(starts)
    # A last chunk that holds only the tail of the last row starts none.
    return starts[starts < n]


def check_filled_indices(reader, plan, indices: np.ndarray, info) -> None:
    """Raises if a row holds a never-written chunk's column 0 twice (design.md)."""
    filled = getattr(reader, "filled_ranges", None)
    ranges = filled() if filled is not None and plan.nnz else []
    if not ranges:
        return
    spans = plan.lasts - plan.firsts
    offsets = np.cumsum(spans) - spans  # where each range's values begin
    from_fill = np.zeros(plan.nnz, bool)
    for a, b, _ in ranges:
        lo = np.maximum(plan.firsts, a) - plan.firsts + offsets
        hi = np.minimum(plan.lasts, b) - plan.firsts + offsets
        for x, y in zip(lo.tolist(), hi.tolist(), strict=True):
            if y > x:
                from_fill[x:y] = True
    ptr = plan.indptr

    def per_row(mask):
        total = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
        return total[ptr[1:]] - total[ptr[:-1]]

    zeros = per_row(indices == 0)
    bad = np.flatnonzero((per_row(from_fill) > 0) & (zeros > 1))
    if bad.size == 0:
        return
    r = int(bad[0])
    row = _stored_row(plan, r)
    p = int(ptr[r] + np.flatnonzero(from_fill[ptr[r] : ptr[r + 1]])[0])
    i = int(np.searchsorted(offsets, p, side="right")) - 1
    value = int(plan.firsts[i] + p - offsets[i])
    a, b, key = next(x for x in ranges if x[0] <= value < x[1])
    raise errors.CorruptChunkError(
        f"{info.path}: {info.element}/indices chunk key {key!r} was never "
        f"written, so it reads as the fill value (column 0) for values "
        f"[{a}, {b}); but then row {row} stores column 0 {int(zeros[r])} "
        "times, which anndata never writes. The chunk was lost (an "
        "interrupted write or copy): the store is damaged; rewrite or "
        "re-copy it.",
        path=info.path,
        dataset=f"/{info.element}/indices",
        rows=(row, row + 1),
        chunk_key=key,
    )


class FieldReader(DenseReader):
    """Reads row ranges of one field of a compound (anndata < 0.7) `obsm`."""

    KEY = "records"
    FILL = False

    def read(
        self, starts: np.ndarray, stops: np.ndarray, buf: RowBuffer, pool=None
    ) -> np.ndarray:
        """Reads whole records, then copies the field out in its value dtype."""
        records = super().read(starts, stops, buf, pool)
        n = records.shape[0]
        out = buf.get("dense", (n, self.info.n_vars), value_dtype(self.info.dtype))
        out[...] = records[self.info.element[len(OBSM) :]].reshape(n, self.info.n_vars)
        return out


def element_reader(f, info: MatrixInfo, fd) -> CsrReader | DenseReader | FieldReader:
    """The reader of row ranges of the element `info` describes, in `f`."""
    if info.element.startswith(OBSM) and is_array(f["obsm"]):
        return FieldReader.open(f["obsm"], info, fd)
    cls = CsrReader if info.encoding == CSR else DenseReader
    return cls.open(f[info.element], info, fd)

"""`preshuffle`'s writer: each part in windows of cells.

Input rows are read in sorted batches, scattered into output order and written by a
background thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import time

import numpy as np

from grain_cells._util.ranges import runs
from grain_cells.preshuffle import _frames
from grain_cells.preshuffle._parts import INDPTR_CHUNK, H5adPart, ZarrPart
from grain_cells.preshuffle._plan import Matrix, Plan

PIECE = 1 << 22  # cells of a part whose row pointers are computed at once
_WINDOW_SHARE = 0.7  # of the budget: the arrays of the windows in flight
_SLOTS = 2  # windows in flight: one assembled while the other is written
_READ_SHARE = 0.1  # of the budget: one read (its buffer may double on growth)
_SCATTER_VALUES = 1 << 20  # values per numpy scatter piece (24 MB of positions)
_LOOP_VALUES_PER_ROW = 64  # rows this long are copied by slices, one per row
# Bytes per cell of a CSR window besides its values: its row pointers (8),
# the gathered row lengths (4) and the sorted reads' tables (`_reads`: 32).
_CSR_CELL_BYTES = 44


def slot_array(slot: dict, name: str, size: int, dtype) -> np.ndarray:
    """A window's array `name` of at least `size` elements, kept in `slot` for reuse."""
    arr = slot.get(name)
    if arr is None or arr.size < size or arr.dtype != dtype:
        arr = slot[name] = np.empty(size, dtype)
    return arr


class WritePipeline:
    """Runs write jobs in order in one background thread, `slots` windows at a time.

    A failed write is raised in the caller when it waits for that job's slot, or
    on exit; later jobs are skipped.
    """

    def __init__(self, slots: int):
        self._slots = collections.deque(({}, None) for _ in range(slots))
        self._failed = False
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grain_cells_preshuffle_write"
        )

    def free_slot(self) -> dict:
        """Waits for the oldest slot's write (jobs end in order); raises its error."""
        slot, job = self._slots.popleft()
        if job is not None:
            job.result()
        return slot

    def submit(self, slot: dict, write, done) -> None:
        """Queues `write()` (then `done()`) for the background thread."""
        self._slots.append((slot, self._thread.submit(self._run, write, done)))

    def __enter__(self) -> WritePipeline:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._thread.shutdown(wait=True)
        if exc_type is None:  # raises a failed write not yet raised
            for _, job in self._slots:
                if job is not None:
                    job.result()

    def _run(self, write, done) -> None:
        if not self._failed:
            try:
                write()
                done()
            except BaseException:  # raised in the caller's thread by `result()`
                self._failed = True
                raise


def cuts(through: np.ndarray, cap: int) -> list[int]:
    """Boundaries `[0, ..., len(through)]` of groups of at most `cap` bytes.

    `through`: cumulative bytes through each item; a larger item is a group alone.
    """
    n = int(through.size)
    bounds = [0]
    while bounds[-1] < n:
        a = bounds[-1]
        base = int(through[a - 1]) if a else 0
        b = int(np.searchsorted(through, base + cap, side="right"))
        bounds.append(max(b, a + 1))
    return bounds


def csr_cuts(
    lengths: np.ndarray, rows: np.ndarray, value_bytes: int, cell_bytes: int, cap: int
) -> tuple[list[int], list[int]]:
    """`(bounds, nnz_at)`: `cuts` of a CSR part's cells, and the values before each.

    A cell's bytes are its values times `value_bytes` plus `cell_bytes`.
    """
    n = int(rows.size)
    bounds, nnz_at = [0], [0]
    base = 0  # bytes through the cell before the last boundary
    last_through = last_nnz = 0  # through the cell before the current piece
    for p in range(0, n, PIECE):
        q = min(p + PIECE, n)
        nnz = np.cumsum(lengths[rows[p:q]], dtype=np.int64)
        nnz += last_nnz
        through = nnz * value_bytes
        through += np.arange(p + 1, q + 1, dtype=np.int64) * cell_bytes
        while True:
            j = int(np.searchsorted(through, base + cap, side="right"))
            if j == q - p:
                break
            b = max(p + j, bounds[-1] + 1)
            k = b - 1 - p  # the cell before the boundary, in this piece
            base, at = (
                (int(through[k]), int(nnz[k])) if k >= 0 else (last_through, last_nnz)
            )
            bounds.append(b)
            nnz_at.append(at)
        last_through, last_nnz = int(through[-1]), int(nnz[-1])
    if bounds[-1] < n:
        bounds.append(n)
        nnz_at.append(last_nnz)
    return bounds, nnz_at


def write_indptr(out, lengths: np.ndarray, rows: np.ndarray) -> None:
    """Writes a part's `n + 1` row pointers into `out`, `PIECE` cells at a time."""
    n = int(rows.size)
    before = 0
    for p in range(0, n, PIECE):
        q = min(p + PIECE, n)
        ptr = np.empty(q - p + 1, np.int64)
        ptr[0] = before
        np.cumsum(lengths[rows[p:q]], dtype=np.int64, out=ptr[1:])
        ptr[1:] += before
        before = int(ptr[-1])
        out[p:q] = ptr[:-1]
    out[n : n + 1] = np.array([before], np.int64)


class Writer:
    """Writes the parts of a plan; holds the permutation and obs in memory."""

    def __init__(self, plan: Plan, parts: list[int] | None = None):
        """Reads what every part needs; `parts`: those to write (None: all)."""
        self.plan = plan
        self._last = (parts or range(len(plan.part_paths)))[-1]
        n = plan.n_cells
        # `default_rng(seed).permutation(n)`'s order, in int32 where it fits.
        self.perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
        np.random.default_rng(plan.seed).shuffle(self.perm)
        if plan.group_by is not None:
            self.perm = _frames.grouped(self.perm, plan)
        self.offsets = plan.source.cell_offsets
        for matrix in plan.matrices:
            matrix.count_rows()
        self.frames = _frames.Frames(plan)

    def write_part(self, index: int, report) -> dict:
        """Writes part `index` under a temporary name, then renames it."""
        plan = self.plan
        start, stop = plan.part_bounds[index]
        rows = self.perm[start:stop]
        t0 = time.perf_counter()
        kind = H5adPart if plan.zarr_format is None else ZarrPart
        part = kind(plan, index, self._part_bytes(rows))
        with part:
            with part.frames_settings():
                self.frames.write(part.root, rows)
            if index == self._last:  # no part needs obs again: not its matrices
                self.frames = None
            nnz, windows, largest = None, 0, 0
            for matrix in plan.matrices:
                got, n_windows, most = self._write(part, matrix, rows, report)
                if matrix is plan.x:
                    nnz = got
                windows += n_windows
                largest = max(largest, most)
            seconds, cells = round(time.perf_counter() - t0, 3), int(rows.size)
            stats = {"cells": cells, "nnz": nnz, "windows": windows}
            stats.update(largest_window_bytes=largest, seconds=seconds)
            marker = {"fingerprint": plan.fingerprint, "part": index}
            marker.update(parts=len(plan.part_paths), cells=cells, nnz=nnz, stats=stats)
            part.commit(marker)
        return marker

    def _part_bytes(self, rows: np.ndarray) -> int:
        """An upper bound of a part's size on disk (see the design notes)."""
        plan = self.plan
        n = int(rows.size)
        matrix, n_chunks = 0, 0
        for m in plan.matrices:
            got, chunks, chunk_bytes = _matrix_bytes(plan, m, rows)
            matrix += got
            n_chunks += chunks
            if plan.compression is not None:  # chunks straddling windows, twice
                windows = got // max(self._slot_bytes(), 1)
                matrix += (windows + 1) * chunk_bytes
        frames = self.frames
        columns = len(frames.obs.columns)
        overhead = (256 << 10) + 1024 * n_chunks + (16 << 10) * (columns + 16)
        names = frames.names.disk_bytes(n)
        return int(1.01 * (matrix + 2 * frames.nbytes(n) + names) + overhead)

    def _write(self, part, m: Matrix, rows: np.ndarray, report):
        """Writes `m` at `rows`, a window assembled while the last one is written.

        Returns `(nnz or None, windows, largest window's bytes)`.
        """
        plan, n, cap = self.plan, rows.size, self._slot_bytes()
        if m.sparse:  # windows and row pointers piece by piece: no part-long tables
            bounds, nnz_at = csr_cuts(
                m.lengths, rows, m.value_bytes, _CSR_CELL_BYTES, cap
            )
            nnz = nnz_at[-1]
            data, indices, indptr = part.create_csr(m, n, nnz, m.chunk(plan, nnz))
            write_indptr(indptr, m.lengths, rows)
            start_of = dict(zip(bounds, nnz_at, strict=True))
            most = max((b - a for a, b in itertools.pairwise(nnz_at)), default=0)
            largest = most * m.value_bytes
        else:  # windows of equal rows
            nnz, row_bytes = None, max(m.n_vars * m.dtype.itemsize, 1)
            x = part.create_dense(m, n, m.chunk(plan, n))
            step = max(cap // row_bytes, 1)
            bounds, largest = [*range(0, n, step), n], min(step, n) * row_bytes
        most_cells = max((b - a for a, b in itertools.pairwise(bounds)), default=0)

        def assemble(slot: dict, a: int, b: int):
            """Gathers window `[a, b)` into `slot`'s arrays; returns its write."""
            if not m.sparse:
                out = slot_array(slot, "X", most_cells * m.n_vars, m.dtype)
                out = out[: (b - a) * m.n_vars].reshape(b - a, m.n_vars)
                for got, dest in self._reads(m, rows[a:b]):
                    out[dest] = got.dense[: dest.size]
                return lambda: x.__setitem__(slice(a, b), out)
            lo, hi = start_of[a], start_of[b]
            out_data = slot_array(slot, "data", most, m.dtype)[: hi - lo]
            out_indices = slot_array(slot, "indices", most, m.index_dtype)[: hi - lo]
            out_ptr = slot_array(slot, "indptr", most_cells + 1, np.int64)[: b - a + 1]
            out_ptr[0] = 0
            np.cumsum(m.lengths[rows[a:b]], dtype=np.int64, out=out_ptr[1:])
            for got, dest in self._reads(m, rows[a:b]):
                _scatter_csr(got.csr, dest, out_ptr, out_data, out_indices)
            if m.reorders_genes:  # rows kept an input's gene order
                _sort_rows(out_ptr, out_data, out_indices)

            def write():
                data[lo:hi] = out_data
                indices[lo:hi] = out_indices

            return write

        with WritePipeline(_SLOTS) as pipeline:
            for a, b in itertools.pairwise(bounds):
                slot = pipeline.free_slot()
                done = lambda n=b - a: report.update(n)  # noqa: E731
                pipeline.submit(slot, assemble(slot, a, b), done)
        return nnz, len(bounds) - 1, largest

    def _slot_bytes(self) -> int:
        return int(self.plan.budget * _WINDOW_SHARE / _SLOTS)

    def _reads(self, m: Matrix, window_rows: np.ndarray):
        """Yields `(fetched rows, window positions)`: sorted batches, one file each."""
        plan = self.plan
        # Per cell: order and rows (8 bytes each), sizes (4-8) and their
        # running sum (8): `_CSR_CELL_BYTES` counts them in the window.
        order = np.argsort(window_rows, kind="stable")
        rows = window_rows[order].astype(np.int64)
        if m.sparse:
            sizes = m.lengths[rows]
            sizes *= m.value_bytes
            sizes += 8
        else:
            sizes = np.full(rows.size, m.n_vars * m.dtype.itemsize + 1)
        cap = int(plan.budget * _READ_SHARE)
        file_bounds = np.searchsorted(rows, self.offsets[1:-1], side="left")
        edges = [0, *file_bounds.tolist(), rows.size]
        for fa, fb in itertools.pairwise(edges):
            if fb <= fa:
                continue
            bounds = cuts(np.cumsum(sizes[fa:fb], dtype=np.int64), cap)
            for a, b in itertools.pairwise(bounds):
                wanted = rows[fa + a : fa + b]
                got = m.fetch_ranges(*runs(wanted))
                if not np.array_equal(got.row_ids, wanted):  # shapes too
                    raise RuntimeError(
                        "AnnDataSource.fetch_ranges returned rows in an unexpected "
                        "order; preshuffle relies on it returning sorted ranges of "
                        "one file in order"
                    )
                yield got, order[fa + a : fa + b]


def _scatter_csr(src, dest: np.ndarray, out_ptr: np.ndarray, out_data, out_indices):
    """Copies each buffered row `k` to window row `dest[k]` (short rows by numpy)."""
    ptr = src.indptr
    rows = dest.size
    if rows == 0:
        return
    values = int(ptr[rows] - ptr[0])
    if values >= _LOOP_VALUES_PER_ROW * rows:  # long rows: a slice each
        at = ptr[: rows + 1].tolist()
        for s0, s1, o in zip(at, at[1:], out_ptr[dest].tolist(), strict=False):
            out_data[o : o + s1 - s0] = src.data[s0:s1]
            out_indices[o : o + s1 - s0] = src.indices[s0:s1]
        return
    starts = out_ptr[dest]  # each row's first position in the window
    bounds = cuts(ptr[1 : rows + 1] - ptr[0], _SCATTER_VALUES)
    for r0, r1 in itertools.pairwise(bounds):
        v0, v1 = int(ptr[r0]), int(ptr[r1])
        if v1 == v0:
            continue
        counts = np.diff(ptr[r0 : r1 + 1])
        pos = np.repeat(starts[r0:r1] - ptr[r0:r1], counts)
        pos += np.arange(v0, v1, dtype=np.int64)
        out_data[pos] = src.data[v0:v1]
        out_indices[pos] = src.indices[v0:v1]


def _matrix_bytes(plan: Plan, m: Matrix, rows: np.ndarray) -> tuple[int, int, int]:
    """`(bytes, chunks, bytes per chunk)` of one matrix of a part, uncompressed."""
    n = int(rows.size)
    if m.sparse:
        nnz = sum(  # in pieces: no gathered copy as long as the part
            int(m.lengths[rows[a : a + (1 << 22)]].sum(dtype=np.int64))
            for a in range(0, n, 1 << 22)
        )
        chunk = m.chunk(plan, nnz)
        n_chunks = -(-nnz // chunk)
        total = n_chunks * chunk * m.value_bytes
        indptr_chunk = min(INDPTR_CHUNK, n + 1)
        total += -(-(n + 1) // indptr_chunk) * indptr_chunk * 8
        n_chunks += -(-(n + 1) // indptr_chunk)
        return total, n_chunks, chunk * m.value_bytes
    rows_per_chunk = m.chunk(plan, n)
    n_chunks = -(-n // rows_per_chunk)
    chunk_bytes = rows_per_chunk * m.n_vars * m.dtype.itemsize
    return n_chunks * chunk_bytes, n_chunks, chunk_bytes


def _sort_rows(indptr: np.ndarray, data: np.ndarray, indices: np.ndarray) -> None:
    """Sorts each CSR row's values by column, in place (canonical CSR)."""
    row_of = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    order = np.lexsort((indices, row_of))
    data[:] = data[order]
    indices[:] = indices[order]

"""`preshuffle`'s windowed write: slots, writer thread, cuts, progress."""

from __future__ import annotations

import collections
import concurrent.futures
import sys

import numpy as np
import tqdm

from grain_cells.preshuffle._plan import Plan

PROGRESS_EVERY_S = 0.5


class Slot:
    """Arrays of one window, allocated once at the largest window's size."""

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str, size: int, dtype) -> np.ndarray:
        """The slot's array `name` with at least `size` elements of `dtype`."""
        arr = self._arrays.get(name)
        if arr is None or arr.size < size or arr.dtype != dtype:
            arr = self._arrays[name] = np.empty(size, dtype)
        return arr


class WritePipeline:
    """Runs write jobs in one background thread, `slots` windows at a time.

    A failed write is raised in the caller at its next call; later jobs are skipped.
    """

    def __init__(self, slots: int):
        self._slots = collections.deque((Slot(), None) for _ in range(slots))
        self._error: BaseException | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="grain_cells_preshuffle_write"
        )

    def free_slot(self) -> Slot:
        """Waits for a slot whose window was written, or a failed write."""
        slot, job = self._slots.popleft()  # jobs run in order: the first ends first
        if job is not None:
            concurrent.futures.wait([job])
        self._raise_if_failed()
        return slot

    def submit(self, slot: Slot, write, done) -> None:
        """Queues `write()` (then `done()`) for the background thread."""
        self._raise_if_failed()
        self._slots.append((slot, self._thread.submit(self._run, write, done)))

    def __enter__(self) -> WritePipeline:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._thread.shutdown(wait=True)
        if exc_type is None:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self, write, done) -> None:
        if self._error is None:
            try:
                write()
                done()
            except BaseException as e:  # re-raised in the caller's thread
                self._error = e


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


PIECE = 1 << 22  # cells of a part whose row pointers are computed at once


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


def progress_bar(plan: Plan, todo: list[int], enabled: bool) -> tqdm.tqdm:
    """A tqdm bar (stderr) of cells written times matrices; says what was complete."""
    total = len(plan.matrices) * sum(
        plan.part_bounds[i][1] - plan.part_bounds[i][0] for i in todo
    )
    skipped = len(plan.part_paths) - len(todo)
    if enabled and skipped:
        print(
            f"preshuffle: {skipped} of {len(plan.part_paths)} part(s) already "
            f"complete in {plan.output_dir}",
            file=sys.stderr,
        )
    return tqdm.tqdm(
        total=total,
        desc="preshuffle",
        unit="cells",
        unit_scale=True,
        mininterval=PROGRESS_EVERY_S,
        disable=not enabled or not total,
        file=sys.stderr,
    )

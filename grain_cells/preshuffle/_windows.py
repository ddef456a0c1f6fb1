"""The machinery of `preshuffle`'s windowed write: window slots, a background
writer, window boundaries and a progress line."""  # noqa: D205, D209

from __future__ import annotations

import collections
import queue
import sys
import threading

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

    `free_slot()` blocks until a window's arrays are free (written) or a
    write failed; a failed write is raised in the calling thread at its next
    call or on exit. After a failure the remaining jobs are skipped (their
    slots still come back).
    """

    def __init__(self, slots: int):
        self._changed = threading.Condition()  # guards _free and _error
        self._free: collections.deque[Slot] = collections.deque(
            Slot() for _ in range(slots)
        )
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._run, name="grain_cells_preshuffle_write", daemon=True
        )
        self._thread.start()

    def free_slot(self) -> Slot:
        """Waits for a slot whose window was written, or a failed write."""
        with self._changed:
            self._changed.wait_for(lambda: self._error is not None or self._free)
            self._raise_if_failed()
            return self._free.popleft()

    def submit(self, slot: Slot, write, done) -> None:
        """Queues `write()` (then `done()`) for the background thread."""
        self._raise_if_failed()
        self._jobs.put((slot, write, done))

    def __enter__(self) -> WritePipeline:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._jobs.put(None)
        self._thread.join()
        if exc_type is None:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot, write, done = job
            error = None
            if self._error is None:
                try:
                    write()
                    done()
                except BaseException as e:  # re-raised in the caller's thread
                    error = e
            with self._changed:
                if error is not None:
                    self._error = error
                self._free.append(slot)
                self._changed.notify_all()


def cuts(through: np.ndarray, cap: int) -> list[int]:
    """Splits items into consecutive groups of at most `cap` bytes each.

    Args:
        through: Cumulative bytes through each item (non-decreasing).
        cap: Bytes per group; a single larger item makes a group of its own.

    Returns:
        Group boundaries `[0, ..., len(through)]`.
    """
    n = int(through.size)
    bounds = [0]
    while bounds[-1] < n:
        a = bounds[-1]
        base = int(through[a - 1]) if a else 0
        b = int(np.searchsorted(through, base + cap, side="right"))
        bounds.append(max(b, a + 1))
    return bounds


class Progress:
    """A tqdm progress bar of cells written, on stderr (cells times matrices).

    Example:
        >>> report = Progress(plan, todo=[0, 1], enabled=True)
        >>> report.advance(1_000)
        >>> report.close()
    """

    def __init__(self, plan: Plan, todo: list[int], enabled: bool):
        """Starts the bar; says how many parts an earlier run completed."""
        # Every matrix of a part (X, layers, raw/X, obsm arrays) is a pass.
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
        self._bar = tqdm.tqdm(
            total=total,
            desc="preshuffle",
            unit="cells",
            unit_scale=True,
            mininterval=PROGRESS_EVERY_S,
            disable=not enabled or not total,
            file=sys.stderr,
        )

    def advance(self, cells: int) -> None:
        """Counts `cells` more cells written (thread-safe: the writer thread's)."""
        self._bar.update(cells)

    def close(self) -> None:
        """Prints the final state of the bar and ends its line (idempotent)."""
        self._bar.close()

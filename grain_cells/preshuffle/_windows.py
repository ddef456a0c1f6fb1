"""The machinery of `preshuffle`'s windowed write: window slots, a background
writer, window boundaries and a progress line."""  # noqa: D205, D209

from __future__ import annotations

import queue
import sys
import threading
import time

import numpy as np

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

    `free_slot()` blocks until a window's arrays are free (written); a failed
    write is raised in the calling thread at its next call or on exit.
    """

    def __init__(self, slots: int):
        self._free: queue.Queue = queue.Queue()
        for _ in range(slots):
            self._free.put(Slot())
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="grain_cells_preshuffle_write", daemon=True
        )
        self._thread.start()

    def free_slot(self) -> Slot:
        """Waits for a slot whose window was written."""
        while True:
            self._raise_if_failed()
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue

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
            if self._error is None:
                try:
                    write()
                    done()
                except BaseException as e:  # re-raised in the caller's thread
                    self._error = e
            self._free.put(slot)


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
    """A one-line progress report on stderr, updated at most twice a second."""

    def __init__(self, plan: Plan, todo: list[int], enabled: bool):
        self.enabled = enabled
        self.total = sum(plan.part_bounds[i][1] - plan.part_bounds[i][0] for i in todo)
        self.skipped = len(plan.part_paths) - len(todo)
        self.parts = len(plan.part_paths)
        self.done = 0
        self.start = time.perf_counter()
        self.last = 0.0
        self.printed = False
        if enabled and self.skipped:
            print(
                f"preshuffle: {self.skipped} of {self.parts} part(s) already "
                f"complete in {plan.output_dir}",
                file=sys.stderr,
            )

    def advance(self, cells: int) -> None:
        """Counts `cells` more cells written; reprints at most twice a second."""
        self.done += cells
        now = time.perf_counter()
        if self.enabled and now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self._print(now)

    def finish(self) -> None:
        """Prints the final line."""
        if self.enabled and self.total:
            self._print(time.perf_counter())
            print(file=sys.stderr, flush=True)

    def _print(self, now: float) -> None:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        print(
            f"\rpreshuffle: {self.done:,}/{self.total:,} cells "
            f"({100 * self.done / max(self.total, 1):.0f}%) in {elapsed:.1f} s, "
            f"{rate:,.0f} cells/s",
            end="",
            file=sys.stderr,
            flush=True,
        )
        self.printed = True

"""One process's open files and what it learnt of each, bounded, least recent out.

`FileLru` keeps at most `max_open` files open (unpinned ones closed first);
`Checked`, one too, keeps each file's record from its first full open.

Design notes: docs/reference/design.md#io-file-lru.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import resource
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from grain_cells._util import arguments

# `max_open_files="auto"` bounds a weight: a file read through its
# descriptor alone weighs 1, one held through its format `FORMAT_WEIGHT`;
# at most `DEFAULT_BUDGET`, so a process stays under 512 descriptors.
DEFAULT_BUDGET = 384
FORMAT_WEIGHT = 3
# A `Checked` record's Python objects beyond its arrays and layouts
# (1.45 KB with stacked obs, tracemalloc), counted in its bound.
RECORD_OVERHEAD_BYTES = 2048
# `Checked`'s bound per process: the records of 10,000 thin files.
RECORDS_MAX_BYTES = 96 << 20


def default_max_open() -> int:
    """Files held through their format that `"auto"` keeps open at most."""
    return max(1, default_budget() // FORMAT_WEIGHT)


def default_budget() -> int:
    """`DEFAULT_BUDGET`, or half the soft `RLIMIT_NOFILE` less 64 if less."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return DEFAULT_BUDGET
    return max(FORMAT_WEIGHT, min(DEFAULT_BUDGET, soft // 2 - 64))


def check_max_open(value: int | str) -> int | str:
    """A `max_open_files` argument: an int >= 1 or `"auto"` (ValueError, TypeError)."""
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(
                "max_open_files must be a positive int or 'auto', got "
                f"max_open_files={value!r}"
            )
        return value
    return arguments.check_int("max_open_files", value, minimum=1)


def resolve_max_open(value: int | str) -> tuple[int, int | None]:
    """`(max_open, max_weight)` of `FileLru`: an int bounds files, "auto" weight."""
    if value == "auto":
        budget = default_budget()
        return budget, budget
    return int(value), None


@dataclasses.dataclass(eq=False)
class _Entry:
    handle: Any
    weight: int = 1
    pins: int = 0
    retired: bool = False  # left the table while pinned: close at last unpin


class FileLru:
    """At most `max_open` files (`max_weight` weight) open, by `opener(key)`."""

    def __init__(
        self,
        opener: Callable[[int], Any],
        max_open: int,
        max_weight: int | None = None,
        weight: Callable[[Any], int] | None = None,
    ):
        if max_open < 1:
            raise ValueError(f"max_open must be at least 1, got {max_open}")
        self.max_open = max_open
        self.max_weight = math.inf if max_weight is None else max_weight
        self._weight_of = weight or (lambda _: 1)
        self._weight = 0
        self._opener = opener
        self._lock = threading.Lock()
        self._open: collections.OrderedDict[int, _Entry] = collections.OrderedDict()

    @property
    def open_count(self) -> int:
        """Files open now (pinned ones beyond the bound included)."""
        return len(self._open)

    @contextlib.contextmanager
    def pinned(self, keys: Sequence[int], check=None) -> Iterator[list]:
        """The handles of `keys`, open until the block ends (`check`: open ones)."""
        entries: list[_Entry] = []
        try:
            for key in keys:
                entry, new = self._acquire(int(key))
                entries.append(entry)
                if check is not None and not new:
                    check(int(key), entry.handle)
            yield [e.handle for e in entries]
        finally:
            self.release(entries)

    def pin_if_open(
        self, keys: Sequence[int], *, touch: bool = True
    ) -> list[_Entry | None]:
        """Each key's entry if open now (pinned; marked used if `touch`), else None."""
        with self._lock:
            out = (
                _touch_many(self._open, keys) if touch else [*map(self._open.get, keys)]
            )
            for entry in out:
                if entry is not None:
                    entry.pins += 1
        return out

    def reserve(self, n: int) -> None:
        """Closes unpinned files, oldest first, until `n` more fit the bound."""
        if n <= 0:
            return
        with self._lock:
            doomed = self._evict(n)
        _close(doomed)

    def _acquire(self, key: int) -> tuple[_Entry, bool]:
        with self._lock:
            entry = self._open.get(key)
            new = entry is None
            if new:
                handle = self._opener(key)
                entry = _Entry(handle, int(self._weight_of(handle)))
                self._open[key] = entry
                self._weight += entry.weight
            else:
                self._open.move_to_end(key)
            entry.pins += 1
            doomed = self._evict()
        _close(doomed)
        return entry, new

    def release(self, entries: list[_Entry | None]) -> None:
        """Unpins entries (of `pin_if_open`: None skipped)."""
        doomed = []
        with self._lock:
            for entry in entries:
                if entry is None:
                    continue
                entry.pins -= 1
                if entry.retired and entry.pins == 0:
                    doomed.append(entry)
            doomed += self._evict()
        _close(doomed)

    def _evict(self, room: int = 0) -> list[_Entry]:
        """Takes unpinned files out, oldest first, `room` below the bound (locked)."""
        doomed, count, weight = [], len(self._open), self._weight
        for key, entry in self._open.items():
            if count <= self.max_open - room and weight <= self.max_weight - room:
                break
            if entry.pins == 0:
                doomed.append(key)
                count -= 1
                weight -= entry.weight
        self._weight = weight
        return [self._open.pop(key) for key in doomed]

    def close_all(self) -> None:
        """Closes every file: now if unpinned, else when its last read ends."""
        with self._lock:
            entries = list(self._open.values())
            self._open.clear()
            self._weight = 0
            doomed = [e for e in entries if e.pins == 0]
            for e in entries:
                e.retired = e.pins > 0
        _close(doomed)


class Checked(FileLru):
    """Files' records (`OpenFile`s without handles) from first opens; thread-safe."""

    def __init__(self, max_bytes: int = RECORDS_MAX_BYTES, max_files: int = 16_384):
        super().__init__(None, max_files, max_bytes, lambda record: record.nbytes)
        self.max_bytes = max_bytes

    def get(self, key: int):
        """File `key`'s record (marked used), or None."""
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[int]) -> list:
        """`get` of each key, under one lock (a fetch's closed files)."""
        with self._lock:
            return [e and e.handle for e in _touch_many(self._open, keys)]

    def peek(self, key: int):
        """File `key`'s record without marking it used (hints), or None."""
        entry = self._open.get(key)
        return entry and entry.handle

    def put(self, key: int, record) -> None:
        """Keeps file `key`'s record, dropping the oldest past the bounds."""
        entry = _Entry(record, record.nbytes)
        if entry.weight > self.max_bytes:
            return
        with self._lock:
            old = self._open.pop(key, None)
            self._weight += entry.weight - (0 if old is None else old.weight)
            self._open[key] = entry
            self._evict()  # records hold no handle to close

    def __len__(self) -> int:
        return len(self._open)


def _close(entries: list[_Entry]) -> None:
    """Closes handles that no thread can reach any more (outside the lock)."""
    error = None
    for entry in entries:
        try:
            entry.handle.close()
        except Exception as e:  # close the others, then report the first
            error = error or e
    if error is not None:
        raise error


def _touch_many(table, keys: Sequence[int]) -> list:
    """Each key's value in the ordered `table` or None, hits marked newest."""
    out = [table.get(key) for key in keys]
    for key, value in zip(keys, out, strict=True):
        if value is not None:
            table.move_to_end(key)
    return out

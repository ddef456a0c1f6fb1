"""Read-ahead hints of a sampler that a plain `grain.DataLoader` drives.

Such a sampler built on a source hints its own next positions' blocks
(`AnnDataSource.advise`), reading the stride from its consecutive calls;
`grain_cells.DataLoader` reads ahead in its fetch stage instead. Design notes:
docs/reference/design.md#sampling-readahead.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Protocol

from grain_cells.source import AnnDataSource


class _Stream(Protocol):
    """What the hints ask of a sampler (a `BlockStream`)."""

    num_epochs: int | None
    epoch_length: int

    def __len__(self) -> int: ...

    def blocks_at(self, positions): ...


class PositionHints:
    """Hints `source` about a sampler's next positions, `readahead_cells` ahead.

    (At least two positions' worth.)
    """

    def __init__(self, source: AnnDataSource, readahead_cells: int):
        self.source = source
        self.window = max(2, -(-int(readahead_cells) // source.block_size))
        self._reset()

    @classmethod
    def for_source(cls, source, readahead_cells: int) -> PositionHints | None:
        """Hints for `source`, or None when it is not a source or cells is 0.

        Raises:
            ValueError: `readahead_cells` is negative.
        """
        if readahead_cells < 0:
            raise ValueError(f"readahead_cells must be >= 0, got {readahead_cells}")
        if not isinstance(source, AnnDataSource) or readahead_cells == 0:
            return None
        return cls(source, readahead_cells)

    def _reset(self) -> None:
        self._last: int | None = None  # the furthest position seen
        self._stride = 0  # gcd of the steps forward (0: none yet)
        self._hinted_until = -1
        self._lock = threading.Lock()  # one hinting thread at a time
        self._pid = os.getpid()  # a forked child starts its own window

    def __getstate__(self):
        # Each process (a worker) starts its own window.
        return {"source": self.source, "window": self.window}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def seen(self, index: int, stream: _Stream) -> None:
        """Called with each position the sampler hands out; hints ahead.

        From any thread: one hints at a time and the others return at once.
        """
        if self._pid != os.getpid():
            self._reset()  # forked: the parent's lock may have been held
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._seen(index, stream)
        finally:
            self._lock.release()

    def _seen(self, index: int, stream: _Stream) -> None:
        last = self._last
        if last is not None:
            # Any two positions of one worker are a multiple of the worker
            # count apart, late ones too: their gcd is the stride.
            self._stride = math.gcd(self._stride, abs(index - last))
        stride = self._stride or 1
        # Positions up to one epoch ahead: a longer span hints the same
        # blocks again (thousands of `index_shuffle` calls for a small file).
        window = min(self.window * stride, max(stream.epoch_length, stride))
        if last is None or index > last:
            self._last = index
        elif index + window < last:  # far behind: restored or restarted
            self._last = index
            self._hinted_until = -1
        if self._hinted_until > index + window // 2:
            return
        first = max(self._hinted_until, index + stride)
        end = index + window
        if stream.num_epochs is not None:
            end = min(end, len(stream))
        if first >= end:
            return
        positions = range(first, end, stride)
        self.source.advise(stream.blocks_at(positions))
        self._hinted_until = positions[-1] + stride

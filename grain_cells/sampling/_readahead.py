"""Read-ahead hints of a sampler that a plain `grain.DataLoader` drives.

Only the card's spelling needs this. Grain's `DataLoader` calls
`sampler[position]` in each worker for that worker's positions (worker `w`
of `N` gets `w, w + N, ...`) and tells the sampler nothing else of what
comes next. So a sampler built on an `AnnDataSource`
(`BlockSampler(source, ...)`) hints the blocks of its own next positions to
the source (`AnnDataSource.advise`: `posix_fadvise` on local files,
read-ahead range GETs in a bucket), reading the stride from its own
consecutive calls. `grain_cells.DataLoader` and `cell_dataset` never call
`sampler[position]`: their fetch stage knows each process's next fetches and
reads ahead itself (`grain_cells.pipeline._stage`), so these hints stay off
there.
"""

from __future__ import annotations

from typing import Protocol

from grain_cells.source import AnnDataSource


class _Stream(Protocol):
    """What the hints ask of a sampler (a `BlockStream`)."""

    num_epochs: int | None

    def __len__(self) -> int: ...

    def blocks_at(self, positions): ...


class PositionHints:
    """Hints a source about a sampler's next positions, one window ahead.

    Args:
        source: The source the sampler's blocks belong to.
        readahead_cells: Cells to hint ahead of the stream (at least two
            positions' worth).
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
        self._last: int | None = None
        self._stride = 1
        self._hinted_until = -1

    def __getstate__(self):
        # Each process (a worker) starts its own window.
        return {"source": self.source, "window": self.window}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def seen(self, index: int, stream: _Stream) -> None:
        """Called with each position the sampler hands out; hints ahead."""
        last, self._last = self._last, index
        if last is not None and index > last:
            self._stride = index - last
        elif last is not None:  # restored or restarted: start over
            self._hinted_until = -1
        stride = self._stride
        window = self.window * stride
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

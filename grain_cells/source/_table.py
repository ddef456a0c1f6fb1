"""`BlockTable`: which blocks (records) a source has and which rows each holds.

A block is up to `block_size` contiguous cells of one file; the table maps a
record key to its global rows `[start, stop)`. The *grid* table cuts each file
into blocks of `block_size` cells from its first row (the last block of a file
may be short) and stores nothing per block. A *view* table lists its blocks'
rows (two int64 arrays, 16 bytes per block): selections, splits and
chunk-aligned blocks are view tables, made by `with_blocks`, a pure function
of the table and the ranges (it returns a new table and changes nothing).

Tables are immutable values: they pickle to workers with the source and are
shared by views of one source.

Example:
    >>> table = BlockTable.grid(n_obs=[100, 30], block_size=16)
    >>> len(table), table.block(7)
    (9, Block(index=7, file=1, start=100, stop=116))
    >>> view = table.with_blocks([0, 40], [16, 48])
    >>> view.blocks_id
    '2 blocks of 24 cells sha256:...'
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from grain_cells import errors


class Block(NamedTuple):
    """One record of an `AnnDataSource`: cells `[start, stop)` of the source.

    Attributes:
        index: The block's record key.
        file: Index of the file that holds it.
        start: First global row id (over the concatenated files).
        stop: One past the last global row id.
        source_id: Which source (or view) it belongs to
            (`AnnDataSource.source_id`); 0 when unknown. The fetch transform
            refuses records of a source other than its own.
    """

    index: int
    file: int
    start: int
    stop: int
    source_id: int = 0

    def __getitem__(self, key):
        """A field by position, as a tuple's; a key such as `"X"` raises.

        Raises:
            errors.NotAMinibatchError: `key` is not an integer or a slice: a
                block reached code that expects a minibatch (a loader's
                operations lack `grain_cells.fetch_operations`).
        """
        if isinstance(key, (int, slice, np.integer)):
            return tuple.__getitem__(self, key)
        raise errors.NotAMinibatchError(
            f"indexed a grain_cells Block with {key!r}, expecting a minibatch: "
            "a grain.DataLoader over an AnnDataSource yields its records, "
            "Block descriptors of which cells each holds, unless its "
            "operations read them. Add grain_cells.fetch_operations(source, "
            "batch_size=...) to operations (after them, your own operations "
            "see minibatches), or use grain_cells.loader(source, "
            "batch_size=...)."
        )


@dataclasses.dataclass(frozen=True, eq=False)
class BlockTable:
    """The blocks of a source: a regular grid per file, or listed ranges.

    Attributes:
        cell_offsets: Global row of each file's first cell, plus the total.
        block_size: Most cells per block.
        block_offsets: Index of each file's first block, plus the block count.
        starts: A view's first row per block; None for the grid.
        stops: A view's exclusive end per block; None for the grid.
        blocks_id: A view's blocks summarised and hashed; "" for the grid.
    """

    cell_offsets: np.ndarray
    block_size: int
    block_offsets: np.ndarray
    starts: np.ndarray | None = None
    stops: np.ndarray | None = None
    blocks_id: str = ""

    @classmethod
    def grid(cls, n_obs: Sequence[int] | np.ndarray, block_size: int) -> BlockTable:
        """Blocks of `block_size` cells from each file's first row.

        Args:
            n_obs: Cells of each file, in concatenation order.
            block_size: Cells per block.
        """
        n_obs = np.asarray(n_obs, np.int64)
        n_blocks = -(-n_obs // block_size)
        return cls(
            cell_offsets=np.concatenate([[0], np.cumsum(n_obs)]),
            block_size=int(block_size),
            block_offsets=np.concatenate([[0], np.cumsum(n_blocks)]),
        )

    def __len__(self) -> int:
        return int(self.block_offsets[-1])

    @property
    def is_view(self) -> bool:
        """Whether the table lists its blocks (else the full grid)."""
        return self.starts is not None

    @property
    def num_cells(self) -> int:
        """Cells over all files (a view's row ids still range over these)."""
        return int(self.cell_offsets[-1])

    @property
    def num_selected_cells(self) -> int:
        """Cells the blocks hold: `num_cells`, or fewer for a view."""
        if self.starts is None:
            return self.num_cells
        return int((self.stops - self.starts).sum())

    @property
    def fragmented(self) -> bool:
        """Whether a view's blocks hold less than half of `block_size` on average."""
        return self.starts is not None and fragmented(
            self.stops - self.starts, self.block_size
        )

    def block(self, record_key: int, source_id: int = 0) -> Block:
        """The rows of block `record_key` (a record of source `source_id`).

        Raises:
            IndexError: No such block.
        """
        k = int(record_key)
        n = len(self)
        if not 0 <= k < n:
            raise IndexError(
                f"block {record_key} out of range: this source has {n} blocks of "
                f"up to {self.block_size} cells"
            )
        f = int(np.searchsorted(self.block_offsets, k, side="right")) - 1
        if self.starts is not None:
            return Block(k, f, int(self.starts[k]), int(self.stops[k]), source_id)
        start = int(self.cell_offsets[f]) + (k - int(self.block_offsets[f])) * (
            self.block_size
        )
        stop = min(start + self.block_size, int(self.cell_offsets[f + 1]))
        return Block(k, f, start, stop, source_id)

    def ranges(self, keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised `block`: `(files, starts, stops)` of many blocks.

        Raises:
            IndexError: A key is outside `[0, len(self))`.
        """
        keys = np.asarray(keys, np.int64).reshape(-1)
        if keys.size and (keys.min() < 0 or keys.max() >= len(self)):
            raise IndexError(
                f"block keys must lie in [0, {len(self)}); got {keys.min()}.."
                f"{keys.max()}"
            )
        files = np.searchsorted(self.block_offsets, keys, side="right") - 1
        if self.starts is not None:
            return files, self.starts[keys], self.stops[keys]
        starts = (
            self.cell_offsets[files]
            + (keys - self.block_offsets[files]) * self.block_size
        )
        stops = np.minimum(starts + self.block_size, self.cell_offsets[files + 1])
        return files, starts, stops

    def with_blocks(self, starts, stops) -> BlockTable:
        """A view table whose block `k` is global rows `[starts[k], stops[k])`.

        Only the files (`cell_offsets`) and `block_size` of this table matter:
        the ranges may be any blocks of these files.

        Args:
            starts: Global first rows, strictly increasing.
            stops: Exclusive ends; each range holds 1 to `block_size` rows of
                one file, and ranges do not overlap.

        Raises:
            TypeError: Starts or stops are not integers.
            ValueError: No range, or ranges out of order, overlapping, empty,
                longer than `block_size` or straddling two files.
        """
        starts = np.asarray(starts).reshape(-1)
        stops = np.asarray(stops).reshape(-1)
        if starts.dtype.kind not in "iu" or stops.dtype.kind not in "iu":
            raise TypeError(
                f"block starts and stops must be integers, got dtypes "
                f"{starts.dtype} and {stops.dtype}"
            )
        starts = starts.astype(np.int64)
        stops = stops.astype(np.int64)
        if starts.shape != stops.shape or starts.size == 0:
            raise ValueError(
                f"with_blocks needs as many stops as starts, at least one: got "
                f"{starts.size} starts and {stops.size} stops"
            )
        lengths = stops - starts
        bad = (lengths < 1) | (lengths > self.block_size)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"block {k} is rows [{starts[k]}, {stops[k]}): a block holds 1 to "
                f"block_size={self.block_size} rows"
            )
        if starts[0] < 0 or stops[-1] > self.num_cells:
            raise ValueError(
                f"blocks span rows [{starts.min()}, {stops.max()}); the source has "
                f"{self.num_cells} cells"
            )
        if (starts[1:] < stops[:-1]).any():
            k = int(np.flatnonzero(starts[1:] < stops[:-1])[0]) + 1
            raise ValueError(
                f"block {k} (rows [{starts[k]}, {stops[k]})) starts before block "
                f"{k - 1} ends ({stops[k - 1]}): blocks must be sorted and disjoint"
            )
        first_file = np.searchsorted(self.cell_offsets, starts, side="right")
        last_file = np.searchsorted(self.cell_offsets, stops - 1, side="right")
        if (first_file != last_file).any():
            k = int(np.flatnonzero(first_file != last_file)[0])
            raise ValueError(
                f"block {k} (rows [{starts[k]}, {stops[k]})) straddles two files; "
                f"file boundaries are at {self.cell_offsets[1:-1].tolist()}"
            )
        digest = hashlib.sha256(starts.astype("<i8").tobytes())
        digest.update(stops.astype("<i8").tobytes())
        return BlockTable(
            cell_offsets=self.cell_offsets,
            block_size=self.block_size,
            block_offsets=np.searchsorted(starts, self.cell_offsets, "left"),
            starts=starts,
            stops=stops,
            blocks_id=(
                f"{starts.size} blocks of {int(lengths.sum())} cells "
                f"sha256:{digest.hexdigest()[:16]}"
            ),
        )

    def cell_mask(self) -> np.ndarray:
        """One bool per global row: whether one of the blocks holds it."""
        n = self.num_cells
        if self.starts is None:
            return np.ones(n, bool)
        edges = np.zeros(n + 1, np.int8)
        edges[self.starts] = 1
        edges[self.stops] -= 1  # a stop may be the next block's start: 1 - 1 = 0
        return np.cumsum(edges[:-1], dtype=np.int8).view(bool)


def fragmented(lengths: np.ndarray, block_size: int) -> bool:
    """Whether blocks hold on average less than half of `block_size` cells."""
    return block_size > 1 and 2 * float(np.mean(lengths)) < block_size


def fragment_note(lengths: np.ndarray, block_size: int) -> str:
    """Says what fragmented blocks cost, and what to do about it.

    True for the usual case, an obs label interleaved with others within
    each donor or batch: a plain shuffled copy would scatter the selected
    cells further, a copy grouped by the label makes them one run.
    """
    mean = float(np.mean(lengths))
    return (
        f"the selection is fragmented: its blocks hold {mean:.1f} cells on "
        f"average, of block_size={block_size}, so each read is "
        f"{block_size / mean:.1f}x shorter than the block size allows and "
        "fetches hold fewer cells. When you select by an obs column whose "
        "labels are interleaved in the files (cell types within donors), write "
        "a copy grouped by it once, grain_cells.preshuffle(paths, out_dir, "
        "group_by=[column, ...]) (add the columns you split on, e.g. "
        "['cell_type', 'donor']): each label's cells are then one contiguous "
        "run (a plain shuffled copy scatters them further). Splits of this "
        "view are fragmented too and do not warn again."
    )


__all__ = ["Block", "BlockTable", "fragment_note", "fragmented"]

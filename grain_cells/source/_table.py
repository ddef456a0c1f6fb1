"""`BlockTable`: which blocks (records) a source has and which rows each holds.

The *grid* cuts each file into blocks of `block_size` cells and stores nothing
per block; a *view* (`with_blocks`, `with_runs`) is stored as runs of
consecutive blocks. Equal blocks give an equal `blocks_id` however they were given.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from grain_cells import errors


class Block(NamedTuple):
    """One record of an `AnnDataSource`: global rows `[start, stop)` of `file`.

    `index` is its record key; `source_id` its source's (0: unknown), checked by
    the fetch transform.
    """

    index: int
    file: int
    start: int
    stop: int
    source_id: int = 0

    def __getitem__(self, key):
        """A field by position; any other key raises `errors.NotAMinibatchError`."""
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


_HASH_BLOCKS = 1 << 20  # blocks expanded at a time for `blocks_id`


@dataclasses.dataclass(frozen=True, eq=False)
class BlockTable:
    """The blocks of a source: a regular grid per file, or a view's runs of blocks.

    Offsets end with the total; `run_*` are None for the grid, `run_blocks` (first
    block per run, plus the count) also when every run is one block.
    """

    cell_offsets: np.ndarray
    block_size: int
    block_offsets: np.ndarray
    run_starts: np.ndarray | None = None
    run_stops: np.ndarray | None = None
    run_blocks: np.ndarray | None = None
    blocks_id: str = ""

    @classmethod
    def grid(cls, n_obs: Sequence[int] | np.ndarray, block_size: int) -> BlockTable:
        """Blocks of `block_size` cells from each file's first row (`n_obs`: cells)."""
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
        return self.run_starts is not None

    @property
    def num_cells(self) -> int:
        """Cells over all files (a view's row ids still range over these)."""
        return int(self.cell_offsets[-1])

    @functools.cached_property
    def num_selected_cells(self) -> int:
        """Cells the blocks hold: `num_cells`, or fewer for a view."""
        if self.run_starts is None:
            return self.num_cells
        return int((self.run_stops - self.run_starts).sum())

    @property
    def mean_block_cells(self) -> float:
        """Cells per block, on average."""
        return self.num_selected_cells / max(1, len(self))

    @property
    def fragmented(self) -> bool:
        """Whether a view's blocks hold less than half of `block_size` on average."""
        size = self.block_size
        return self.is_view and size > 1 and 2 * self.mean_block_cells < size

    def fragment_note(self) -> str:
        """What this table's fragmented blocks cost, and what to do."""
        mean, block_size = self.mean_block_cells, self.block_size
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

    def _locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(starts, stops)` of a view's blocks `keys` (checked)."""
        if self.run_blocks is None:  # one block per run
            return self.run_starts[keys], self.run_stops[keys]
        run = np.searchsorted(self.run_blocks, keys, side="right") - 1
        starts = self.run_starts[run] + (keys - self.run_blocks[run]) * self.block_size
        return starts, np.minimum(starts + self.block_size, self.run_stops[run])

    def block(self, record_key: int, source_id: int = 0) -> Block:
        """The rows of block `record_key` (of source `source_id`); IndexError: none."""
        k = int(record_key)
        n = len(self)
        if not 0 <= k < n:
            raise IndexError(
                f"block {record_key} out of range: this source has {n} blocks of "
                f"up to {self.block_size} cells"
            )
        f = int(np.searchsorted(self.block_offsets, k, side="right")) - 1
        if self.run_starts is not None:
            (start,), (stop,) = self._locate(np.array([k]))
            return Block(k, f, int(start), int(stop), source_id)
        start = int(self.cell_offsets[f]) + (k - int(self.block_offsets[f])) * (
            self.block_size
        )
        stop = min(start + self.block_size, int(self.cell_offsets[f + 1]))
        return Block(k, f, start, stop, source_id)

    def ranges(self, keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised `block`: `(files, starts, stops)`; IndexError off the table."""
        keys = np.asarray(keys, np.int64).reshape(-1)
        if keys.size and (keys.min() < 0 or keys.max() >= len(self)):
            raise IndexError(
                f"block keys must lie in [0, {len(self)}); got {keys.min()}.."
                f"{keys.max()}"
            )
        files = np.searchsorted(self.block_offsets, keys, side="right") - 1
        if self.run_starts is not None:
            return (files, *self._locate(keys))
        starts = (
            self.cell_offsets[files]
            + (keys - self.block_offsets[files]) * self.block_size
        )
        stops = np.minimum(starts + self.block_size, self.cell_offsets[files + 1])
        return files, starts, stops

    def with_blocks(self, starts, stops) -> BlockTable:
        """A view table of these files whose block `k` is rows `[starts[k], stops[k])`.

        Raises `TypeError` (not integers) or `ValueError` as `_checked` says.
        """
        starts, stops = self._checked(starts, stops, "block", self.block_size)
        # A block continues its predecessor's run when that one is full and
        # ends where it starts, in the same file.
        file_of = np.searchsorted(self.cell_offsets, starts, side="right")
        cont = (
            (starts[1:] == stops[:-1])
            & (stops[:-1] - starts[:-1] == self.block_size)
            & (file_of[1:] == file_of[:-1])
        )
        del file_of
        heads = np.flatnonzero(~cont) + 1
        n = starts.size
        if 3 * (heads.size + 1) >= 2 * n:  # runs would not be smaller
            return self._view(starts, stops, None)
        first = np.concatenate([[0], heads])
        last = np.concatenate([heads - 1, [n - 1]])
        return self._view(starts[first], stops[last], np.append(first, n))

    def with_runs(self, run_starts, run_stops) -> BlockTable:
        """`with_blocks` of the runs cut into `block_size` cells (same `blocks_id`)."""
        starts, stops = self._checked(run_starts, run_stops, "run", None)
        per_run = -(-(stops - starts) // self.block_size)
        first = np.concatenate([[0], np.cumsum(per_run)])
        if (per_run == 1).all():
            return self._view(starts, stops, None)
        if 3 * starts.size >= 2 * int(first[-1]):  # list the blocks instead
            blocks = self._view(starts, stops, first).ranges(np.arange(first[-1]))
            return self._view(blocks[1], blocks[2], None)
        return self._view(starts, stops, first)

    def _checked(self, starts, stops, what: str, longest: int | None):
        """Ranges as int64 arrays, or the error that names the first bad one."""
        starts = np.asarray(starts).reshape(-1)
        stops = np.asarray(stops).reshape(-1)
        if starts.dtype.kind not in "iu" or stops.dtype.kind not in "iu":
            raise TypeError(
                f"{what} starts and stops must be integers, got dtypes "
                f"{starts.dtype} and {stops.dtype}"
            )
        starts = starts.astype(np.int64)
        stops = stops.astype(np.int64)
        if starts.shape != stops.shape or starts.size == 0:
            raise ValueError(
                f"with_{what}s needs as many stops as starts, at least one: got "
                f"{starts.size} starts and {stops.size} stops"
            )
        lengths = stops - starts
        bad = lengths < 1 if longest is None else (lengths < 1) | (lengths > longest)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            holds = "1 or more" if longest is None else f"1 to block_size={longest}"
            raise ValueError(
                f"{what} {k} is rows [{starts[k]}, {stops[k]}): a {what} holds "
                f"{holds} rows"
            )
        del lengths, bad
        if starts[0] < 0 or stops[-1] > self.num_cells:
            raise ValueError(
                f"{what}s span rows [{starts.min()}, {stops.max()}); the source "
                f"has {self.num_cells} cells"
            )
        if (starts[1:] < stops[:-1]).any():
            k = int(np.flatnonzero(starts[1:] < stops[:-1])[0]) + 1
            raise ValueError(
                f"{what} {k} (rows [{starts[k]}, {stops[k]})) starts before {what} "
                f"{k - 1} ends ({stops[k - 1]}): {what}s must be sorted and disjoint"
            )
        first_file = np.searchsorted(self.cell_offsets, starts, side="right")
        last_file = np.searchsorted(self.cell_offsets, stops - 1, side="right")
        if (first_file != last_file).any():
            k = int(np.flatnonzero(first_file != last_file)[0])
            raise ValueError(
                f"{what} {k} (rows [{starts[k]}, {stops[k]})) straddles two files; "
                f"file boundaries are at {self.cell_offsets[1:-1].tolist()}"
            )
        return starts, stops

    def _view(self, run_starts, run_stops, run_blocks) -> BlockTable:
        """The view table of checked runs (`run_blocks` None: one block each)."""
        before = np.searchsorted(run_starts, self.cell_offsets, "left")
        n = run_starts.size if run_blocks is None else int(run_blocks[-1])
        table = BlockTable(
            cell_offsets=self.cell_offsets,
            block_size=self.block_size,
            block_offsets=before if run_blocks is None else run_blocks[before],
            run_starts=run_starts,
            run_stops=run_stops,
            run_blocks=run_blocks,
        )
        # The id hashes every block's start, then every stop, as listed
        # blocks did: expanded a chunk at a time.
        digest = hashlib.sha256()
        for which in (1, 2):
            for a in range(0, n, _HASH_BLOCKS):
                keys = np.arange(a, min(n, a + _HASH_BLOCKS))
                digest.update(table.ranges(keys)[which].astype("<i8").tobytes())
        cells = int((run_stops - run_starts).sum())
        blocks_id = f"{n} blocks of {cells} cells sha256:{digest.hexdigest()[:16]}"
        object.__setattr__(table, "blocks_id", blocks_id)
        return table

    def cell_mask(self) -> np.ndarray:
        """One bool per global row: whether one of the blocks holds it."""
        n = self.num_cells
        if self.run_starts is None:
            return np.ones(n, bool)
        edges = np.zeros(n + 1, np.int8)
        edges[self.run_starts] = 1
        edges[self.run_stops] -= 1  # a stop may be the next run's start: 1 - 1 = 0
        return np.cumsum(edges[:-1], dtype=np.int8).view(bool)

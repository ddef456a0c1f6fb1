"""Blocks along a compressed matrix's chunk grid, and the defaults built on it.

In a compressed file the unit of decoding is an HDF5 chunk, not a cell. A
random block of 16 cells decodes one or two whole chunks (of `data` and of
`indices`) to use a fraction of each, so the grid of 16-cell blocks that
suits uncompressed files wastes most of the decoding on compressed ones.

Design notes: docs/reference/design.md#source-chunk-grid.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from grain_cells.source import _selection
from grain_cells.source._table import BlockTable

# Blocks per fetch of the compressed defaults (the uncompressed defaults'
# 16 x 16 / 16 at batch 64).
DEFAULT_BLOCKS_PER_FETCH = 64
# Most decoded bytes (values and indices) of one fetch's blocks under the
# compressed defaults, per process: 4 chunks per block at anndata's largest
# chunks (1 MiB of values + 1 MiB of indices: 2 chunks per block).
FETCH_BUDGET_BYTES = 256 << 20
# Most cells of such a fetch: a worker formats a whole fetch into its ring of
# at most 128 shared-memory slots before the trainer can take any, and each
# minibatch past the ring waits 2 s for a slot (`transport._ring`).
MAX_FETCH_CELLS = 120 * 64
# Most cells of a default block: a multiple of 64 (a minibatch) so that a
# fetch of whole blocks and whole minibatches stays within MAX_FETCH_CELLS.
MAX_BLOCK_CELLS = 1024
_CHUNKS_PER_BLOCK = (4, 2, 1)  # tried in this order
_MARGIN = 1.25  # block_size over the cells of n average chunks


@dataclasses.dataclass(frozen=True)
class ChunkDefaults:
    """The blocks a source uses when no `block_size` is given.

    Attributes:
        chunks_per_block: Chunks per block (`n`).
        block_size: Most cells per block.
        cells_per_chunk: Average cells per chunk over the files.
        chunk_bytes: Decoded bytes of one chunk of values and its indices.
    """

    chunks_per_block: int
    block_size: int
    cells_per_chunk: float
    chunk_bytes: int

    @property
    def fetch_blocks(self) -> int:
        """Blocks per default fetch: 64, fewer if 64 would pass MAX_FETCH_CELLS.

        Fewer only where even one chunk per block is too large (chunks of
        more than 120 cells): a fetch is formatted into a worker's ring of
        shared-memory slots before the trainer takes any minibatch of it,
        and thousands of minibatches per fetch would stall there.
        """
        cells = min(self.chunks_per_block * self.cells_per_chunk, self.block_size)
        fits = int(MAX_FETCH_CELLS // max(cells, 1.0))
        return max(1, min(DEFAULT_BLOCKS_PER_FETCH, fits))

    @property
    def fetch_bytes(self) -> int:
        """Decoded bytes of a fetch of `DEFAULT_BLOCKS_PER_FETCH` blocks."""
        return DEFAULT_BLOCKS_PER_FETCH * self.chunks_per_block * self.chunk_bytes


def compressed_defaults(
    n_cells: int, chunk_starts: np.ndarray, chunk_bytes: int
) -> ChunkDefaults:
    """The defaults of the design notes for a matrix of this chunking.

    `chunk_starts`: global rows where a chunk begins (each file's first row
    included); `chunk_bytes`: decoded bytes of one chunk of values plus one
    of indices (the largest over the files).
    """
    per_chunk = n_cells / max(1, np.asarray(chunk_starts).size)
    n = next(
        (
            n
            for n in _CHUNKS_PER_BLOCK
            if DEFAULT_BLOCKS_PER_FETCH * n * chunk_bytes <= FETCH_BUDGET_BYTES
            and DEFAULT_BLOCKS_PER_FETCH * n * per_chunk <= MAX_FETCH_CELLS
        ),
        1,
    )
    block_size = max(16, 16 * math.ceil(_MARGIN * n * per_chunk / 16))
    block_size = min(block_size, MAX_BLOCK_CELLS)
    return ChunkDefaults(n, block_size, per_chunk, int(chunk_bytes))


def default_fetch_factor(
    batch_size: int, block_size: int, blocks: int = DEFAULT_BLOCKS_PER_FETCH
) -> int:
    """The least fetch factor whose fetch holds at least `blocks` blocks.

    A fetch holds `batch_size * fetch_factor / block_size` blocks, which must
    be a whole number.
    """
    step = block_size // math.gcd(block_size, batch_size)  # keeps it whole
    per_step = batch_size * step // block_size  # blocks per `step`
    return step * max(1, -(-blocks // per_step))


def chunk_aligned_blocks(
    table: BlockTable, chunk_starts: np.ndarray, chunks_per_block: int = 1
) -> BlockTable:
    """Blocks of `chunks_per_block` chunks each: a pure function of its inputs.

    Keeps the table's cells; cuts at every `chunks_per_block`-th chunk start
    of each file, at gaps in the selection, at file boundaries and every
    `table.block_size` cells.

    `chunk_starts`: sorted global rows (`source.chunk_starts()`);
    `chunks_per_block` at least 1.
    """
    cuts = np.union1d(
        table.cell_offsets, _every_nth_chunk(chunk_starts, table, chunks_per_block)
    )
    if table.run_starts is None and table.num_cells > 0:
        # Every cell: the runs are the stretches between cuts (what
        # `blocks_over_runs` finds in an all-True mask, without the mask's
        # passes over every cell: 0.35 CPU-s at 100M cells).
        starts, stops = _selection.blocks_over_ranges(
            cuts[:-1], cuts[1:], table.block_size
        )
    else:
        starts, stops = _selection.blocks_over_runs(
            table.cell_mask(), cuts, table.block_size
        )
    return table.with_blocks(starts, stops)


def _every_nth_chunk(starts: np.ndarray, table: BlockTable, n: int) -> np.ndarray:
    """Every `n`-th chunk start of each file, counted from the file's first."""
    if n == 1:
        return starts
    offsets = np.asarray(table.cell_offsets, np.int64)
    files = np.searchsorted(offsets, starts, side="right") - 1
    first = np.searchsorted(starts, offsets[:-1], side="left")
    rank = np.arange(starts.size) - first[files]
    return starts[rank % n == 0]


__all__ = [
    "DEFAULT_BLOCKS_PER_FETCH",
    "FETCH_BUDGET_BYTES",
    "MAX_BLOCK_CELLS",
    "MAX_FETCH_CELLS",
    "ChunkDefaults",
    "chunk_aligned_blocks",
    "compressed_defaults",
    "default_fetch_factor",
]

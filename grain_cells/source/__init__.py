"""`AnnDataSource`: one or many AnnData files as a Grain random-access source.

**What a record is.** Grain's `DataLoader` reads one record at a time and
stripes records over its worker processes, so a record that held one cell
would scatter a block's cells over workers and lose the contiguous reads that
make block sampling fast. Each record of an `AnnDataSource` is therefore a
*block*: `block_size` contiguous cells of one file (blocks never straddle
files; the last block of a file may be short). `len(source)` is the number of
blocks and `source[k]` returns a `Block`, a small descriptor of which cells
block `k` holds.

Reading is deferred: the batched-fetch transform (`grain_cells.pipeline._fetch`) groups
the blocks of a fetch and reads them all in one batched pass, straight into a
reused buffer. Grain pays about 25 µs per record even with no reader threads,
so a record must stand for many cells, and a batched read beats per-block
reads by several times. To read data directly, use `read(rows)`,
`read_ranges(starts, stops)` or `read_blocks(keys)`.
"""

from grain_cells.source._chunk_grid import chunk_aligned_blocks, default_fetch_factor
from grain_cells.source._selection import (
    blocks_of_mask,
    describe_condition,
    selected_blocks,
    where_mask,
)
from grain_cells.source._source import AnnDataSource
from grain_cells.source._table import Block, BlockTable

__all__ = [
    "AnnDataSource",
    "Block",
    "BlockTable",
    "blocks_of_mask",
    "chunk_aligned_blocks",
    "default_fetch_factor",
    "describe_condition",
    "selected_blocks",
    "where_mask",
]

"""`AnnDataSource`: one or many AnnData files as a Grain random-access source.

Each record is a *block*: `block_size` contiguous cells of one file (`source[k]`
is a `Block` descriptor); read data with `read(rows)`, `read_ranges(starts,
stops)` or `read_blocks(keys)`. Why a record is a block: docs/reference/design.md
("A record is a block").
"""

from grain_cells.source._chunk_grid import chunk_aligned_blocks, default_fetch_factor
from grain_cells.source._selection import (
    blocks_of_mask,
    describe_condition,
    obs_column,
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
    "obs_column",
    "selected_blocks",
    "where_mask",
]

"""`AnnDataSource`: one or many AnnData files as a Grain random-access source."""

from grain_cells.source._source import AnnDataSource
from grain_cells.source._table import Block, BlockTable

__all__ = ["AnnDataSource", "Block", "BlockTable"]

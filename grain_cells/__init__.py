"""grain_cells: train JAX/Flax models on `.h5ad` single-cell atlases with Grain.

Public API::

    source = grain_cells.AnnDataSource(paths, block_size=16, obs_columns=[...])
    cells = source.read(rows)          # batched read, rows in the order asked
"""

from grain_cells.cells import Cells
from grain_cells.errors import (
    AnnDataFormatError,
    CorruptDataError,
    GeneMismatchError,
    MissingColumnError,
    SourceChangedError,
    UnsupportedLayoutError,
)
from grain_cells.h5ad import MatrixInfo
from grain_cells.source import AnnDataSource, Block

__all__ = [
    "AnnDataFormatError",
    "AnnDataSource",
    "Block",
    "Cells",
    "CorruptDataError",
    "GeneMismatchError",
    "MatrixInfo",
    "MissingColumnError",
    "SourceChangedError",
    "UnsupportedLayoutError",
]

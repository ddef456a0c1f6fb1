"""grain_cells: train JAX/Flax models on `.h5ad` single-cell atlases with Grain.

Public API::

    source = grain_cells.AnnDataSource(paths, block_size=16, obs_columns=[...])
    cells = source.read(rows)          # batched read, rows in the order asked
    loader = grain_cells.DataLoader(   # a grain.DataLoader
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0),
        operations=grain_cells.fetch_operations(source, batch_size=64),
        worker_count=2)
    view = source.select(where={"cell_type": ["B", "T"]})   # a source too
    splits = grain_cells.split_by_fraction(source, {"train": 0.9, "val": 0.1})
    sampler = grain_cells.WeightedBlockSampler(        # class-balanced draws
        source, grain_cells.balanced_block_weights(source, "cell_type"))
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
from grain_cells.fetch import FetchConfig, SplitFetch, fetch_operations
from grain_cells.h5ad import MatrixInfo
from grain_cells.loader import (
    READ_OPTIONS,
    CheckedIterator,
    CheckpointMismatchError,
    DataLoader,
)
from grain_cells.main_guard import MainGuardError
from grain_cells.outputs import CsrOutput, DenseOutput, PaddedSparseOutput
from grain_cells.pipeline import cell_dataset
from grain_cells.preshuffling import preshuffle
from grain_cells.sampler import BlockSampler, WeightedBlockSampler
from grain_cells.selection import split_by_fraction, split_by_obs
from grain_cells.source import AnnDataSource, Block
from grain_cells.weighting import (
    balanced_block_weights,
    block_weights,
    expected_shares,
)

__all__ = [
    "READ_OPTIONS",
    "AnnDataFormatError",
    "AnnDataSource",
    "Block",
    "BlockSampler",
    "Cells",
    "CheckedIterator",
    "CheckpointMismatchError",
    "CorruptDataError",
    "CsrOutput",
    "DataLoader",
    "DenseOutput",
    "FetchConfig",
    "GeneMismatchError",
    "MainGuardError",
    "MatrixInfo",
    "MissingColumnError",
    "PaddedSparseOutput",
    "SourceChangedError",
    "SplitFetch",
    "UnsupportedLayoutError",
    "WeightedBlockSampler",
    "balanced_block_weights",
    "block_weights",
    "cell_dataset",
    "densify",
    "expected_shares",
    "fetch_operations",
    "preshuffle",
    "split_by_fraction",
    "split_by_obs",
]


def __getattr__(name: str):
    # JAX is imported only when the helper is used (workers never need it).
    if name == "densify":
        from grain_cells.jax_utils import densify

        return densify
    raise AttributeError(f"module 'grain_cells' has no attribute {name!r}")

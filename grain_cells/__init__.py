"""grain_cells: train JAX/Flax models on AnnData single-cell atlases with Grain.

Public API::

    loader = grain_cells.loader(       # files to minibatches in one call
        paths, batch_size=64, obs_columns=["cell_type"], worker_count=2)
    for batch in loader: ...           # each iter() a new epoch, new order

    source = grain_cells.AnnDataSource(paths, obs_columns=["cell_type"])
    view = source.select(where={"cell_type": ["B", "T"]})   # a source too
    loader = grain_cells.DataLoader(   # grain.DataLoader's arguments
        data_source=view,
        sampler=grain_cells.BlockSampler(len(view), seed=0),
        operations=grain_cells.fetch_operations(view, batch_size=64))

Sub-packages imported by name: `errors`, `tokens` (token outputs),
`checkpoint` (orbax handlers), `feed` (`device_iterator`), `synthetic` (test
data). `pipeline`, `sampling`, `blocks`, `outputs`, `source` and
`preshuffle` are re-exported here; `io`, `hdf5`, `storage`, `transport` are
internal. Every spelling gives the same minibatches for any worker count.
"""

from importlib import metadata as _metadata

from grain_cells import errors as errors
from grain_cells import hdf5 as _hdf5  # noqa: F401  (registers its Format)
from grain_cells import tokens as tokens
from grain_cells import zarr as _zarr  # noqa: F401  (registers its Format)
from grain_cells.blocks import (
    balanced_block_weights,
    block_weights,
    chunk_aligned,
    expected_shares,
    split_by_fraction,
    split_by_obs,
)
from grain_cells.outputs import CsrOutput, DenseOutput, Output, PaddedSparseOutput
from grain_cells.pipeline import (
    DataLoader,
    Layer,
    Obsm,
    cell_dataset,
    fetch_operations,
    loader,
)
from grain_cells.preshuffle import preshuffle
from grain_cells.sampling import (
    BlockSampler,
    ConditionBlockSampler,
    WeightedBlockSampler,
    condition_blocks,
)
from grain_cells.source import AnnDataSource
from grain_cells.zarr import annbatch_stores

try:
    __version__ = _metadata.version("grain_cells")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "AnnDataSource",
    "BlockSampler",
    "ConditionBlockSampler",
    "CsrOutput",
    "DataLoader",
    "DenseOutput",
    "Layer",
    "Obsm",
    "Output",
    "PaddedSparseOutput",
    "WeightedBlockSampler",
    "annbatch_stores",
    "balanced_block_weights",
    "block_weights",
    "cell_dataset",
    "chunk_aligned",
    "condition_blocks",
    "densify",
    "expected_shares",
    "fetch_operations",
    "loader",
    "preshuffle",
    "split_by_fraction",
    "split_by_obs",
]


def __getattr__(name: str):
    # JAX is imported only when the helper is used (workers never need it);
    # orbax (the `checkpoint` extra) only when `grain_cells.checkpoint` is.
    if name == "densify":
        from grain_cells.outputs import densify

        return densify
    if name == "checkpoint":
        import grain_cells.checkpoint

        return grain_cells.checkpoint
    raise AttributeError(f"module 'grain_cells' has no attribute {name!r}")

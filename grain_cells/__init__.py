"""grain_cells: train JAX/Flax models on AnnData single-cell atlases with Grain.

Public API::

    loader = grain_cells.loader(       # files to minibatches in one call
        paths, batch_size=64, obs_columns=["cell_type"],
        split=("train", {"train": 0.9, "val": 0.1}), worker_count=2, seed=0)
    for epoch in range(3):             # each iter() a new epoch, new order
        for batch in loader: ...       # len(loader) minibatches per epoch
    labels = loader.obs_frame(batch)   # obs codes -> labels (a DataFrame)

    source = grain_cells.AnnDataSource(paths, block_size=16, obs_columns=[...])
    cells = source.read(rows)          # batched read, rows in the order asked
    loader = grain_cells.DataLoader(   # grain.DataLoader's arguments;
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0),
        operations=grain_cells.fetch_operations(source, batch_size=64),
        worker_count=2)                # what grain_cells.loader builds
    view = source.select(where={"cell_type": ["B", "T"]})   # a source too
    splits = grain_cells.split_by_fraction(source, {"train": 0.9, "val": 0.1})
    sampler = grain_cells.WeightedBlockSampler(        # class-balanced draws
        source, grain_cells.balanced_block_weights(source, "cell_type"))
    aligned = grain_cells.chunk_aligned(source)   # blocks follow X's chunks
    stores = grain_cells.annbatch_stores(folder)  # annbatch's collection

Sub-packages a user imports by name: `grain_cells.errors` (every error
raised for bad input), `grain_cells.tokens` (token outputs for transformers),
`grain_cells.checkpoint` (orbax handlers that restore on another process
count), `grain_cells.feed` (`device_iterator`: minibatches to the
accelerator one copy ahead, equal steps on every process),
`grain_cells.synthetic` (Tahoe-shaped test data). The rest
(`pipeline`, `sampling`, `blocks`, `outputs`, `source`, `preshuffle`) are
re-exported here; `io`, `hdf5`, `storage`, `transport` are internal.

Every spelling gives the same minibatches for any worker count, resumable
and restorable under another worker or shard count. Epochs, `len()` and
`close()`: "Epochs and iterators" in docs/guides/loading.md.
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

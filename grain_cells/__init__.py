"""grain_cells: train JAX/Flax models on `.h5ad` single-cell atlases with Grain.

Public API::

    source = grain_cells.AnnDataSource(paths, block_size=16, obs_columns=[...])
    cells = source.read(rows)          # batched read, rows in the order asked
    loader = grain_cells.DataLoader(   # grain.DataLoader's arguments;
        data_source=source,
        sampler=grain_cells.BlockSampler(len(source), seed=0),
        operations=grain_cells.fetch_operations(source, batch_size=64),
        worker_count=2)                # same minibatches for any count
    view = source.select(where={"cell_type": ["B", "T"]})   # a source too
    splits = grain_cells.split_by_fraction(source, {"train": 0.9, "val": 0.1})
    sampler = grain_cells.WeightedBlockSampler(        # class-balanced draws
        source, grain_cells.balanced_block_weights(source, "cell_type"))
    aligned = grain_cells.chunk_aligned(source)   # blocks follow X's chunks
    # orbax: Grain's files; IteratorRestore also on another JAX process count
    args = ocp.args.Composite(data=grain_cells.IteratorSave(iterator))
"""

from grain_cells.cells import Cells
from grain_cells.chunk_blocks import chunk_aligned, mean_cells_per_chunk
from grain_cells.conditions import ConditionBlockSampler, condition_blocks
from grain_cells.corpus_stats import CorpusStats, corpus_stats
from grain_cells.errors import (
    AnnDataFormatError,
    CorruptChunkError,
    CorruptDataError,
    GeneMismatchError,
    MissingColumnError,
    ObjectStoreError,
    SourceChangedError,
    UnsupportedLayoutError,
)
from grain_cells.fetch import FetchConfig, SplitFetch
from grain_cells.h5ad import MatrixInfo
from grain_cells.loader import (
    READ_OPTIONS,
    CheckedIterator,
    CheckpointMismatchError,
    DataLoader,
)
from grain_cells.main_guard import MainGuardError
from grain_cells.matrices import Layer, Obsm
from grain_cells.operations import fetch_operations
from grain_cells.outputs import (
    CsrOutput,
    DenseOutput,
    Fetch,
    Output,
    PaddedSparseOutput,
)
from grain_cells.pipeline import CellDataset, cell_dataset
from grain_cells.preshuffling import preshuffle
from grain_cells.sampler import BlockSampler, WeightedBlockSampler
from grain_cells.source import AnnDataSource, Block
from grain_cells.splits import split_by_fraction, split_by_obs
from grain_cells.tokens import RankValueTokens
from grain_cells.value_bins import ValueBinTokens
from grain_cells.vocabulary import GeneVocabulary
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
    "CellDataset",
    "Cells",
    "CheckedIterator",
    "CheckpointMismatchError",
    "ConditionBlockSampler",
    "CorpusStats",
    "CorruptChunkError",
    "CorruptDataError",
    "CsrOutput",
    "DataLoader",
    "DenseOutput",
    "Fetch",
    "FetchConfig",
    "GeneMismatchError",
    "GeneVocabulary",
    "IteratorHandler",
    "IteratorRestore",
    "IteratorSave",
    "Layer",
    "MainGuardError",
    "MatrixInfo",
    "MissingColumnError",
    "ObjectStoreError",
    "Obsm",
    "Output",
    "PaddedSparseOutput",
    "RankValueTokens",
    "SourceChangedError",
    "SplitFetch",
    "UnsupportedLayoutError",
    "ValueBinTokens",
    "WeightedBlockSampler",
    "balanced_block_weights",
    "block_weights",
    "cell_dataset",
    "chunk_aligned",
    "condition_blocks",
    "corpus_stats",
    "densify",
    "expected_shares",
    "fetch_operations",
    "mean_cells_per_chunk",
    "preshuffle",
    "split_by_fraction",
    "split_by_obs",
]


_CHECKPOINT = ("IteratorHandler", "IteratorRestore", "IteratorSave")


def __getattr__(name: str):
    # JAX is imported only when the helper is used (workers never need it).
    if name == "densify":
        from grain_cells.jax_utils import densify

        return densify
    # orbax (the `checkpoint` extra) only when its handler is used.
    if name in _CHECKPOINT:
        from grain_cells import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'grain_cells' has no attribute {name!r}")

"""Chunk-aware blocks: block boundaries that follow X's HDF5 chunk grid.

Design notes: docs/reference/design.md#blocks-chunk-aligned.
"""

from __future__ import annotations

import numpy as np

from grain_cells._util import arguments
from grain_cells.source import AnnDataSource, chunk_aligned_blocks


def chunk_aligned(source: AnnDataSource, chunks_per_block: int = 1) -> AnnDataSource:
    """A view of `source` whose blocks follow the matrix's chunk grid.

    Works on views too: only the cells the source already holds are kept,
    and blocks are cut at every `chunks_per_block`-th chunk start of each
    file, at gaps in the selection, at file boundaries and every
    `block_size` cells.

    A block of `n` chunks decodes about `n + 1` (its last cell runs into the
    next chunk). Give the source a `block_size` of at least `n` times
    `mean_cells_per_chunk` (plus a margin), else blocks split every
    `block_size` cells.

    Args:
        source: An `AnnDataSource` (or a view of one).
        chunks_per_block: Chunks of the matrix per block (at least 1).

    Returns:
        A new `AnnDataSource` view (its own file handles); its `repr` names
        a hash of its block table, so checkpoints bind to the alignment.
    """
    arguments.check_source(source, AnnDataSource)
    n = arguments.check_int("chunks_per_block", chunks_per_block, minimum=1)
    table = source.block_table
    return source.view(chunk_aligned_blocks(table, source.chunk_starts(), n))


def mean_cells_per_chunk(source: AnnDataSource) -> float:
    """Average cells per chunk of the matrix over all files (for sizing)."""
    starts = np.union1d(source.block_table.cell_offsets[:-1], source.chunk_starts())
    return source.num_cells / max(1, starts.size)

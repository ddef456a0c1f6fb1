"""Views and weights over a source's blocks: splits, class balance, chunk grid."""

from grain_cells.blocks._splits import (
    chunk_aligned,
    mean_cells_per_chunk,
    split_by_fraction,
    split_by_obs,
)
from grain_cells.blocks._weighting import (
    balanced_block_weights,
    block_weights,
    expected_shares,
)

__all__ = [
    "balanced_block_weights",
    "block_weights",
    "chunk_aligned",
    "expected_shares",
    "mean_cells_per_chunk",
    "split_by_fraction",
    "split_by_obs",
]

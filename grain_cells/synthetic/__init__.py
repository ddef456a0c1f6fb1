"""Synthetic, Tahoe-100M-shaped single-cell data written as `.h5ad`."""

from grain_cells.synthetic._tahoe import (
    ATLAS_CHUNKS,
    cached_tahoe_like,
    write_tahoe_like,
)

__all__ = ["ATLAS_CHUNKS", "cached_tahoe_like", "write_tahoe_like"]

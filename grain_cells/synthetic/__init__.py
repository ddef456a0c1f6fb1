"""Synthetic, Tahoe-100M-shaped single-cell data written as `.h5ad` or zarr."""

from grain_cells.synthetic._tahoe import (
    ATLAS_CHUNKS,
    cached_tahoe_like,
    write_tahoe_like,
)
from grain_cells.synthetic._thin import write_thin_atlas, write_thin_collection
from grain_cells.synthetic._zarr import (
    ZARR_LAYOUTS,
    cached_tahoe_like_annbatch,
    cached_tahoe_like_zarr,
    write_tahoe_like_zarr,
)

__all__ = [
    "ATLAS_CHUNKS",
    "ZARR_LAYOUTS",
    "cached_tahoe_like",
    "cached_tahoe_like_annbatch",
    "cached_tahoe_like_zarr",
    "write_tahoe_like",
    "write_thin_atlas",
    "write_thin_collection",
    "write_tahoe_like_zarr",
]

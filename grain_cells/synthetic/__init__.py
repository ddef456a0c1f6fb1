"""Synthetic single-cell data: Tahoe-shaped `.h5ad` or zarr, thin atlases.

`write_thin_atlas` and `write_thin_collection` write thin atlas-shaped
`.h5ad` files (~4 values per cell) for scale tests.
"""

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
    "write_tahoe_like_zarr",
    "write_thin_atlas",
    "write_thin_collection",
]

"""Zarr stores as a `grain_cells.formats.Format`, read by row range (private).

`_format` registers it on import; zarr itself is imported when a store opens.
"""

from grain_cells.zarr import _format as _format  # registers the format
from grain_cells.zarr._annbatch import annbatch_stores

__all__ = ["annbatch_stores"]

"""The seam between AnnData's schema (`io`) and the formats storing it.

`hdf5` and `zarr` each `register` a `Format` (docs/reference/design.md, "Formats").
"""

from grain_cells.formats._positional import (
    LAYOUT_OVERHEAD_BYTES,
    ByteLayout,
    ChunkCache,
    PositionalReader,
    dest_bytes,
    pieces,
    truncated,
)
from grain_cells.formats._protocol import (
    ChunkDecodeError,
    Format,
    RangeReader,
    checked_ranges,
    for_path,
    missing_path,
    naming_errors,
    of,
    register,
    registered,
    run_parts,
    unregister,
    value_dtype,
    wait_all,
)

__all__ = [
    "LAYOUT_OVERHEAD_BYTES",
    "ByteLayout",
    "ChunkCache",
    "ChunkDecodeError",
    "Format",
    "PositionalReader",
    "RangeReader",
    "checked_ranges",
    "dest_bytes",
    "for_path",
    "missing_path",
    "naming_errors",
    "of",
    "pieces",
    "register",
    "registered",
    "run_parts",
    "truncated",
    "unregister",
    "value_dtype",
    "wait_all",
]

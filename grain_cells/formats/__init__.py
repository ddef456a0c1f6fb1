"""The seam between AnnData's schema (`grain_cells.io`) and the formats storing it.

A `Format` opens a path or URL into AnnData's tree, reads row ranges of an
array (`RangeReader`), says what locates an array's bytes and stats a file;
`grain_cells.hdf5` and `grain_cells.zarr` implement and `register` one
(docs/reference/design.md, "Formats").
"""

from grain_cells.formats._positional import (
    LAYOUT_OVERHEAD_BYTES,
    ByteLayout,
    ChunkCache,
    PositionalReader,
)
from grain_cells.formats._protocol import (
    ChunkDecodeError,
    Format,
    RangeReader,
    checked_ranges,
    for_path,
    missing_path,
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
    "for_path",
    "missing_path",
    "of",
    "register",
    "registered",
    "run_parts",
    "unregister",
    "value_dtype",
    "wait_all",
]

"""The seam between AnnData's schema and the formats that store it.

`Format` is what a storage format gives the schema layer
(`grain_cells.io`): it opens a path or URL into AnnData's tree of groups
and arrays, reads row ranges of an array (`RangeReader`), says what locates
an array's bytes (the layout digest of `grain_cells.io._identity`) and
stats a file. `grain_cells.hdf5` (`.h5ad`) and `grain_cells.zarr` (zarr
stores) implement it and `register` themselves; `grain_cells.io` asks the
registry (`for_path`, `of`) and names no format. Adding a format is one
module: a `Format` subclass and a `register` call (docs/reference/design.md,
"Formats").
"""

from grain_cells.formats._positional import (
    LAYOUT_OVERHEAD_BYTES,
    ByteLayout,
    PositionalReader,
    run_parts,
)
from grain_cells.formats._protocol import (
    ChunkDecodeError,
    Format,
    RangeReader,
    checked_ranges,
    missing_path,
    value_dtype,
    wait_all,
)
from grain_cells.formats._registry import (
    for_path,
    of,
    register,
    registered,
    unregister,
)

__all__ = [
    "LAYOUT_OVERHEAD_BYTES",
    "ByteLayout",
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

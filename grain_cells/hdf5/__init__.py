"""HDF5 datasets read by byte range, outside HDF5 where it is faster (private).

Knows nothing of AnnData: `_format` is the `grain_cells.formats.Format` of
`.h5ad` files (registered when this package is imported), `_open` opens one
by path or URL; `_reads` reads sorted element ranges of a dataset
(uncompressed: positional reads; compressed: `_chunks` decodes chunks in
threads); `_layout` checks that HDF5 can return a dataset's true values.
"""

from grain_cells.hdf5 import _format as _format  # registers the format

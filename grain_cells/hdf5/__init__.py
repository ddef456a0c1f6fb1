"""HDF5 datasets read by byte range, outside HDF5 where it is faster (private).

`_format` is the `formats.Format` of `.h5ad` files (registered on import) and
checks HDF5 can return a dataset's true values; `_open` opens one by path or
URL; `_reads` reads row ranges (positional, or `_chunks` decoding in threads).
"""

from grain_cells.hdf5 import _format as _format  # registers the format

"""A file's matrix reader kept as pure data, to reopen the file without its format.

When every array a matrix reader reads is read positionally (uncompressed,
its bytes at known offsets: `formats.ByteLayout`), the reader is fully
described by those layouts. `layouts_of` takes them from a reader built
through the format, and `reader_of` builds the same reader again
over a new `ByteReader` of the file: one `open` and no format library. A
collection that reads across more files than a process keeps open closes
and reopens files all the time (`grain_cells.io._file_lru`); this makes a
reopen cost a descriptor instead of an HDF5 open and close (about 3 ms).

Memory: one `ByteLayout` per array (`ByteLayout.nbytes`: its chunk
offsets, 8 bytes per chunk, plus about 512 bytes), counted in the bound of
`grain_cells.io._file_lru.Checked`.

Design notes: docs/reference/design.md#io-layouts.
"""

from __future__ import annotations

from grain_cells.formats import ByteLayout, PositionalReader
from grain_cells.io._h5ad import MatrixInfo
from grain_cells.io._matrix import CsrReader, DenseReader
from grain_cells.io._obsm import FieldReader

Reader = CsrReader | DenseReader | FieldReader


def layouts_of(reader: Reader, fd) -> dict[str, ByteLayout] | None:
    """Each array's byte layout when all are read positionally, else None.

    None too when there is no byte reader (the format reads its own store)
    or it is remote (each reopen would stat the object again: the format's
    path stays).
    """
    if fd is None or getattr(fd, "remote", True):
        return None
    out = {}
    for name, array in reader.arrays.items():
        layout = getattr(array, "byte_layout", None)
        if layout is None:
            return None
        out[name] = layout
    return out


def reader_of(info: MatrixInfo, layouts: dict[str, ByteLayout], fd) -> Reader:
    """The matrix reader of `info` over `fd`, from `layouts_of`'s layouts."""
    arrays = {
        name: PositionalReader(layout, info.path, fd)
        for name, layout in layouts.items()
    }
    if "records" in arrays:
        return FieldReader.of_arrays(info, arrays, fd)
    if "x" in arrays:
        return DenseReader.of_arrays(info, arrays, fd)
    return CsrReader.of_arrays(info, arrays, fd)


def layouts_nbytes(layouts: dict[str, ByteLayout] | None) -> int:
    """Memory the layouts hold (0 for None)."""
    return 0 if layouts is None else sum(v.nbytes for v in layouts.values())


__all__ = ["layouts_nbytes", "layouts_of", "reader_of"]

"""Bytes: local files and object stores read by position (private).

`_readers`: a fetch's bytes (`ByteReader`) and where a file is (`FileStat`);
`remote/`: all that talks to an object store.
"""

from grain_cells.storage._readers import (
    ByteReader,
    FileStat,
    LocalByteReader,
    ShortReadError,
    advise_pieces,
    as_byte_reader,
    pread_cached,
    pread_pieces,
    read_counts,
)

__all__ = [
    "ByteReader",
    "FileStat",
    "LocalByteReader",
    "ShortReadError",
    "advise_pieces",
    "as_byte_reader",
    "pread_cached",
    "pread_pieces",
    "read_counts",
]

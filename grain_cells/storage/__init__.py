"""Bytes: local files and object stores read by position (private).

`_readers` gives a fetch its bytes (`ByteReader`: local `pread` or memory map;
remote range GETs); `_identity` says whether a file is still the one a source
was built from. `remote/` holds everything that talks to an object store:
the store and its credentials (`_store`, `_aws`), retries (`_retries`),
range GETs (`_range_gets`), read-ahead (`_read_ahead`), writes
(`_writes`), and which version of an object is read and what its ETag can
vouch for (`_versions`).
"""

from grain_cells.storage._identity import FileStat
from grain_cells.storage._readers import (
    ByteReader,
    LocalByteReader,
    ShortReadError,
    advise_pieces,
    as_byte_reader,
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
    "pread_pieces",
    "read_counts",
]

"""Bytes of local files (`_readers`) and objects (`remote/`) by position (private)."""

from grain_cells.storage._readers import (
    ByteReader,
    FileStat,
    LocalByteReader,
    ShortReadError,
    advise_pieces,
    advise_uncached,
    as_byte_reader,
    plan_requests,
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
    "advise_uncached",
    "as_byte_reader",
    "plan_requests",
    "pread_cached",
    "pread_pieces",
    "read_counts",
]

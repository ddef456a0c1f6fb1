"""Object stores (S3, GCS, Azure, HTTP) through obstore (private)."""

from grain_cells.storage.remote._reader import Pieces, RemoteByteReader
from grain_cells.storage.remote._store import (
    check_not_forked_after_use,
    count_request,
    is_url,
    local_path,
    split_url,
    store_at,
)
from grain_cells.storage.remote._versions import (
    content_due,
    delete,
    head,
    join,
    list_names,
    part_names,
    put_bytes,
    put_file,
    version_of,
)

__all__ = [
    "Pieces",
    "RemoteByteReader",
    "check_not_forked_after_use",
    "content_due",
    "count_request",
    "delete",
    "head",
    "is_url",
    "join",
    "list_names",
    "local_path",
    "part_names",
    "put_bytes",
    "put_file",
    "split_url",
    "store_at",
    "version_of",
]

"""Writing, listing and deleting objects (`preshuffle`); errors `store_error`'s."""

from __future__ import annotations

import os
import re

from grain_cells.storage.remote import _store, _versions

UPLOAD_PART_BYTES = 8 << 20  # S3 needs >= 5 MiB for every part but the last
_MAX_PARTS = 9_000  # of S3's 10,000, with room to spare
_PART_NAME = re.compile(r"^part-\d{5}\.h5ad$")


def join(url: str, name: str) -> str:
    """`url` (a folder-like prefix) and a name below it, with one slash."""
    return f"{url.rstrip('/')}/{name}"


def part_names(names: list[str]) -> list[str]:
    """The names among `names` that `preshuffle` gives its parts."""
    return sorted(n for n in names if _PART_NAME.match(n))


def put_file(url: str, path: str | os.PathLike, storage_options: dict | None) -> None:
    """Uploads the local file at `path` as the object `url` (multipart if large)."""
    part = max(UPLOAD_PART_BYTES, -(-os.path.getsize(path) // _MAX_PARTS))
    with open(path, "rb") as f:
        _call(
            url, storage_options, "upload", "put", f, chunk_size=part, max_concurrency=8
        )


def put_bytes(url: str, data: bytes, storage_options: dict | None) -> None:
    """Writes `data` as the object `url` (one PUT)."""
    _call(url, storage_options, "upload", "put", data)


def list_names(url: str, storage_options: dict | None) -> list[str]:
    """Names of the objects directly below the prefix `url`."""
    found = _call(url, storage_options, "list", "list_with_delimiter")
    return [m["path"].rpartition("/")[2] for m in found["objects"]]


def delete(url: str, storage_options: dict | None) -> None:
    """Deletes the object `url` (no error if it is gone)."""
    _call(url, storage_options, "delete", "delete")


def _call(url: str, storage_options, what: str, function: str, *args, **kwargs):
    """`obstore.<function>(store, key, ...)`; its errors named (see above)."""
    import obstore

    store = _store.store_for(url, storage_options)
    if what == "list":  # the objects below the prefix `url`
        key = _store.split_url(join(url, "x"))[1].rpartition("/")[0] or None
    else:
        key = _store.split_url(url)[1]
    try:
        return getattr(obstore, function)(store, key, *args, **kwargs)
    except Exception as e:
        raise _versions.store_error(e, url, storage_options, what) from None

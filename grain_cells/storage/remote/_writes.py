"""Writing, listing and deleting objects: what `preshuffle` does to a bucket.

Design notes: docs/reference/design.md#storage-remote-writes.
"""

from __future__ import annotations

import os
import re

from grain_cells.storage.remote import _retries, _store

UPLOAD_PART_BYTES = 8 << 20  # S3 needs >= 5 MiB for every part but the last
_MAX_PARTS = 9_000  # of S3's 10,000, with room to spare
_PART_NAME = re.compile(r"^part-\d{5}\.h5ad$")


def upload_part_bytes(size: int) -> int:
    """Bytes per part of a multipart upload of `size` bytes."""
    return max(UPLOAD_PART_BYTES, -(-int(size) // _MAX_PARTS))


def join(url: str, name: str) -> str:
    """`url` (a folder-like prefix) and a name below it, with one slash."""
    return f"{url.rstrip('/')}/{name}"


def put_file(url: str, path: str | os.PathLike, storage_options: dict | None) -> None:
    """Uploads the local file at `path` as the object `url` (multipart if large).

    Raises:
        FileNotFoundError: The bucket does not exist.
        PermissionError: The credentials may not write there.
        OSError: The upload failed after retries.
    """
    import obstore

    store = _store.store_for(url, storage_options)
    _, key = _store.split_url(url)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        _call(
            url,
            storage_options,
            "upload",
            lambda: obstore.put(
                store, key, f, chunk_size=upload_part_bytes(size), max_concurrency=8
            ),
        )


def put_bytes(url: str, data: bytes, storage_options: dict | None) -> None:
    """Writes `data` as the object `url` (one PUT). Raises as `put_file`."""
    import obstore

    store = _store.store_for(url, storage_options)
    _, key = _store.split_url(url)
    _call(url, storage_options, "upload", lambda: obstore.put(store, key, data))


def list_names(url: str, storage_options: dict | None) -> list[str]:
    """Names of the objects directly below the prefix `url`. Raises as `put_file`."""
    import obstore

    _, key = _store.split_url(join(url, "x"))
    folder = key.rpartition("/")[0]  # "a/b" of ".../a/b/x"
    store = _store.store_for(url, storage_options)
    found = _call(
        url,
        storage_options,
        "list",
        lambda: obstore.list_with_delimiter(store, folder or None),
    )
    return [m["path"].rpartition("/")[2] for m in found["objects"]]


def delete(url: str, storage_options: dict | None) -> None:
    """Deletes the object `url` (no error if it is gone). Raises as `put_file`."""
    import obstore

    store = _store.store_for(url, storage_options)
    _, key = _store.split_url(url)
    _call(url, storage_options, "delete", lambda: obstore.delete(store, key))


def part_names(names: list[str]) -> list[str]:
    """The names among `names` that `preshuffle` gives its parts."""
    return sorted(n for n in names if _PART_NAME.match(n))


def _call(url: str, storage_options, what: str, request):
    from obstore import exceptions as ox

    try:
        return request()
    except Exception as e:
        if not isinstance(e, (ox.BaseError, OSError)):
            raise
        status, _, _ = _retries.describe(e)
        if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or (
            status in (401, 403)
        ):
            raise PermissionError(
                f"{url}: {what} refused ({_retries.first_line(e)}). The "
                "credentials in use may not do that there: pass others in "
                "storage_options (or output_storage_options), set AWS_PROFILE or "
                "the AWS_* variables, or ask for write access to the bucket."
            ) from None
        if (
            isinstance(e, (ox.NotFoundError, FileNotFoundError))
            or status == 404
            or "NoSuchBucket" in str(e)
        ):
            raise _store.missing_bucket_or_object(
                url, storage_options, e, what=what
            ) from None
        raise OSError(f"{url}: {what} failed: {_retries.first_line(e)}") from None

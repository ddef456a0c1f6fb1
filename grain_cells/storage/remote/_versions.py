"""Which version of an object a source reads, and what its ETag can vouch for.

A source records each object's size, ETag and Last-Modified (one HEAD) and
checks every read against them (`If-Match`, or a HEAD after each batch of
GETs: `grain_cells.storage.remote._range_gets`). That catches every rewrite
only where the ETag follows the content:

* **S3, GCS, Azure** (and S3-compatible stores such as MinIO): the ETag is a
  digest of the bytes or changes at every write, so only a byte-identical
  rewrite keeps it.
* **HTTP servers** derive the ETag from the file's metadata: nginx sends
  `"<mtime hex>-<size hex>"`, Apache `"<size hex>-<mtime µs hex>"`, Caddy
  and lighttpd similar; some send none, or only `Last-Modified` (one-second
  resolution). A same-size rewrite whose modification time is kept
  (`rsync -t`, `cp -p`, `touch -r`) or falls in the same second keeps every
  header, and If-Match still passes.

So for an object whose ETag does not follow its content
(`tag_follows_content`: every `http(s)://` URL, an ETag that is missing or
weak, or one that spells out the object's size in hex as nginx's and
Apache's do), the source also records `content`, a SHA-256 of
`CONTENT_WINDOWS` windows of `CONTENT_WINDOW` bytes spread evenly over the
object (the first holds the HDF5 superblock), read in one batch of range
GETs. It is read again, and compared, when the source is built, when each
process opens the object, when an iterator state is restored
(`AnnDataSource.verify_files`), and during iteration at most every
`content_check_s` seconds per process and object (the `content_check_s`
storage option, default `DEFAULT_CONTENT_CHECK_S`; 0 checks at every read).
What still slips through there: a same-size rewrite whose changed bytes all
avoid the windows (a few changed values in a large file), and, until the
next periodic check, cells read from a rewrite made during iteration.
"""

from __future__ import annotations

import hashlib
import math
import re

from grain_cells.storage._identity import FileStat
from grain_cells.storage.remote import _range_gets as range_gets
from grain_cells.storage.remote import _store as object_store

CONTENT_WINDOWS = 32
CONTENT_WINDOW = 4 << 10  # bytes: 128 KiB read per check in all
DEFAULT_CONTENT_CHECK_S = 60.0

_HEX_PARTS = re.compile(r'^"?([0-9a-fA-F]+(?:-[0-9a-fA-F]+)+)"?$')


def tag_follows_content(url: str, stat: object_store.ObjectStat) -> bool:
    """Whether `stat.etag` changes whenever the object's bytes do.

    False for `http(s)://` URLs (servers derive ETags from file metadata),
    for a missing or weak (`W/`) ETag, and for an ETag made of hex numbers
    one of which is the size (nginx, Apache), whatever the URL's scheme (an
    `s3://` URL may name such a server through `endpoint_url`).
    """
    if url.split("://", 1)[0].lower() in ("http", "https"):
        return False
    etag = stat.etag.strip()
    if not etag or etag.startswith("W/"):
        return False
    match = _HEX_PARTS.match(etag)
    return not (match and format(stat.size, "x") in match.group(1).lower().split("-"))


def content_windows(size: int) -> list[tuple[int, int]]:
    """`(start, end)` of each sampled window of an object of `size` bytes."""
    if size <= CONTENT_WINDOWS * CONTENT_WINDOW:
        return [(0, size)] if size else []
    last = size - CONTENT_WINDOW
    starts = sorted(
        {math.floor(k * last / (CONTENT_WINDOWS - 1)) for k in range(CONTENT_WINDOWS)}
    )
    return [(s, s + CONTENT_WINDOW) for s in starts]


def content_digest(
    url: str, storage_options: dict | None, stat: object_store.ObjectStat, store=None
) -> str:
    """SHA-256 of the object's sampled windows (one batch of range GETs).

    Raises:
        errors.SourceChangedError: The object's ETag, size or Last-Modified
            is no longer `stat`'s (checked by the HEAD after the GETs).
    """
    windows = content_windows(stat.size)
    digest = hashlib.sha256(f"{stat.size}".encode())
    if windows:
        datas = range_gets.get_ranges(url, storage_options, windows, stat, store)
        for data in datas:
            digest.update(memoryview(data))
    return "sha256:" + digest.hexdigest()[:32]


def version_of(url: str, storage_options: dict | None = None, store=None) -> FileStat:
    """The object's version now (one HEAD, and the sampled bytes if needed).

    The digest of the sampled windows is read when the object's ETag does
    not follow its content (`tag_follows_content`).

    Raises:
        FileNotFoundError: No such object.
        PermissionError: Credentials are missing or refused.
        errors.SourceChangedError: It changed between the HEAD and the GETs.
    """
    stat = object_store.head(url, storage_options)
    content = ""
    if not tag_follows_content(url, stat):
        content = content_digest(url, storage_options, stat, store)
    return FileStat(0, 0, stat.size, stat.last_modified_ns, 0, stat.etag, content)


def content_check_s(storage_options: dict | None) -> float:
    """The `content_check_s` storage option (default `DEFAULT_CONTENT_CHECK_S`).

    Raises:
        ValueError: Not a number >= 0.
    """
    value = (storage_options or {}).get("content_check_s", DEFAULT_CONTENT_CHECK_S)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            "storage_options['content_check_s'] must be a number of seconds "
            ">= 0 (how often each process re-reads the sampled bytes of an "
            f"object whose ETag does not follow its content), got {value!r}"
        )
    return float(value)

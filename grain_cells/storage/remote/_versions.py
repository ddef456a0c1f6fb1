"""Requests for objects: HEAD, range GETs, digests, writes (`preshuffle`), errors.

Design notes: docs/reference/design.md#storage-remote-versions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
import re
import time

from grain_cells import errors
from grain_cells._util import fork
from grain_cells.storage._readers import FileStat
from grain_cells.storage.remote import _errors, _store

CONTENT_WINDOWS = 32
CONTENT_WINDOW = 4 << 10  # bytes: 128 KiB read per check in all
DIGEST_BLOCK = 64 << 10  # bytes per digest of `verify_reads`
_DIGEST_BYTES = 8
_BLOCKS_PREFIX = "blocks:"
_REBUILD = (
    "Build a new source (and do not restore iterator state saved for the old data)."
)

# `verify_reads` tables of this process, by (URL, content digest).
_tables = fork.ProcessCache()
# This process's last read of each object's `content` (windows or blocks):
# URL -> (content found, `time.monotonic()`), the newest `_CONTENT_KEPT` URLs.
_content_read = fork.ProcessCache()
_CONTENT_KEPT = 16_384

UPLOAD_PART_BYTES = 8 << 20  # S3 needs >= 5 MiB for every part but the last
_MAX_PARTS = 9_000  # of S3's 10,000, with room to spare
_PART_NAME = re.compile(r"^part-\d{5}\.h5ad$")
_HEX_PARTS = re.compile(r'^"?([0-9a-fA-F]+(?:-[0-9a-fA-F]+)+)"?$')

verify_reads = functools.partial(_store.option, name="verify_reads")
content_check_s = functools.partial(_store.option, name="content_check_s")


def stat_of(meta) -> FileStat:
    """The `FileStat` of obstore's `ObjectMeta` (ETag with its quotes)."""
    modified = meta.get("last_modified")
    ns = int(modified.timestamp() * 1e9) if modified is not None else 0
    return FileStat(0, 0, int(meta["size"]), ns, 0, str(meta.get("e_tag") or ""))


def head(url: str, storage_options: dict | None = None) -> FileStat:
    """The object's size, ETag and last-modified (one HEAD; errors named)."""
    return stat_of(_call(url, storage_options, "read", "head", count="head"))


def get_ranges(url, storage_options, ranges, stat: FileStat, if_match=False):
    """Bytes of each `[start, end)` of version `stat` (else `SourceChangedError`)."""
    import obstore
    from obstore import exceptions as ox

    store = _store.store_for(url, storage_options)
    _, key = _store.split_url(url)
    starts, ends = [int(a) for a, _ in ranges], [int(b) for _, b in ranges]
    _store.count_request("get", len(ranges))
    if not if_match:
        _store.count_request("check")  # the HEAD after the batch
    where = f"bytes [{min(starts)}, {max(ends)})"
    began = time.monotonic()
    try:
        if if_match:
            options = {"range": (starts[0], ends[0])}
            if stat.etag:
                options["if_match"] = stat.etag
            datas = [obstore.get(store, key, options=options).bytes()]
        else:
            datas = obstore.get_ranges(store, key, starts=starts, ends=ends, coalesce=0)
            now = stat_of(obstore.head(store, key))
    except ox.PreconditionError:
        raise errors.SourceChangedError(
            f"{url}: changed since the AnnDataSource was built: its ETag is no "
            f"longer {stat.etag} (detected at a read of {where}). {_REBUILD}"
        ) from None
    except (ox.NotFoundError, FileNotFoundError):
        where = f"{len(starts)} ranges in {where}" if len(starts) > 1 else where
        raise errors.SourceChangedError(
            f"{url}: removed since the AnnDataSource was built (detected at a "
            f"read of {where}). Build a new source."
        ) from None
    except (ox.BaseError, OSError) as e:
        elapsed = time.monotonic() - began
        raise _errors.read_error(e, url, storage_options, ranges, elapsed) from None
    if not if_match and (
        (now.etag, now.size) != (stat.etag, stat.size)
        or (stat.mtime_ns and now.mtime_ns != stat.mtime_ns)
    ):
        raise errors.SourceChangedError(
            f"{url}: changed since the AnnDataSource was built (ETag "
            f"{stat.etag or 'none'}, {stat.size} bytes then; {now.etag or 'none'}, "
            f"{now.size} bytes now; detected after a read of {where}). {_REBUILD}"
        )
    for data, a, b in zip(datas, starts, ends, strict=True):
        if len(data) != b - a:
            raise errors.CorruptDataError(
                f"{url}: asked for bytes [{a}, {b}), got {len(data)} bytes: the "
                "object ends before HDF5 says its data does (truncated upload?)"
            )
    return datas


def tag_follows_content(url: str, stat: FileStat) -> bool:
    """Whether the ETag follows the bytes: not over HTTP, weak, or holding the size."""
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
    n = CONTENT_WINDOWS - 1
    starts = {math.floor(k * last / n) for k in range(CONTENT_WINDOWS)}
    return [(s, s + CONTENT_WINDOW) for s in sorted(starts)]


def version_of(url: str, storage_options: dict | None = None) -> FileStat:
    """The object's version now: one HEAD, and a content digest where needed."""
    stat = head(url, storage_options)
    content = ""
    if verify_reads(storage_options):
        table = _block_digests(url, storage_options, stat)
        content = _BLOCKS_PREFIX + hashlib.sha256(table).hexdigest()[:32]
        _tables.get_or_make((url, content), lambda: table)
    elif not tag_follows_content(url, stat):
        digest = hashlib.sha256(f"{stat.size}".encode())
        if windows := content_windows(stat.size):
            for data in get_ranges(url, storage_options, windows, stat):
                digest.update(memoryview(data))
        content = "sha256:" + digest.hexdigest()[:32]
    if content:
        _content_read.put_newest(url, (content, time.monotonic()), _CONTENT_KEPT)
    return dataclasses.replace(stat, content=content)


def content_due(url: str, content: str, storage_options: dict | None) -> bool:
    """Whether `url`'s `content` is due to be read again in this process.

    Due `content_check_s` after this process last read it (sampled windows,
    or `verify_reads` blocks) and found `content`; at once where it has not,
    or found other bytes.
    """
    found = _content_read.get(url)
    if found is None or found[0] != content:
        return True
    return time.monotonic() >= found[1] + content_check_s(storage_options)


def _block_digests(url, storage_options, stat: FileStat) -> bytes:
    """8-byte BLAKE2b digests of each `DIGEST_BLOCK` bytes (one streamed GET)."""
    import obstore
    from obstore import exceptions as ox

    store = _store.store_for(url, storage_options)
    _, key = _store.split_url(url)
    options = {"if_match": stat.etag} if stat.etag else {}
    _store.count_request("get")
    table, pending, total = bytearray(), bytearray(), 0
    try:
        for chunk in obstore.get(store, key, options=options).stream(4 << 20):
            pending += memoryview(chunk)
            total += len(chunk)
            full = len(pending) - len(pending) % DIGEST_BLOCK
            view = memoryview(pending)
            for off in range(0, full, DIGEST_BLOCK):
                table += _digest(view[off : off + DIGEST_BLOCK])
            view.release()
            del pending[:full]
    except (ox.PreconditionError, ox.NotFoundError, FileNotFoundError):
        raise errors.SourceChangedError(
            f"{url}: changed or removed while its blocks were being digested "
            "(verify_reads); build the source again"
        ) from None
    if pending:
        table += _digest(memoryview(pending))
    if total != stat.size:
        raise errors.SourceChangedError(
            f"{url}: {total} bytes read while its size was {stat.size} "
            "(verify_reads): it changed while being read; build the source again"
        )
    return bytes(table)


def _digest(data) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest()


def block_table(url: str, storage_options: dict | None, stat: FileStat):
    """The `verify_reads` table of `stat` (None: unverified); digests once a process."""
    if not stat.content.startswith(_BLOCKS_PREFIX):
        return None
    table = _tables.get((url, stat.content))
    if table is None:
        if version_of(url, storage_options).content != stat.content:
            raise _differ(url, 0, stat.size)
        table = _tables[(url, stat.content)]
    return table


def check_blocks(url: str, table: bytes, ranges, wide, datas) -> list:
    """The bytes of `ranges` cut from the blocks `wide` read (`SourceChangedError`)."""
    out = []
    for (a, b), (start, _), data in zip(ranges, wide, datas, strict=True):
        view = memoryview(data)
        for i, off in enumerate(range(0, len(view), DIGEST_BLOCK)):
            k = (start // DIGEST_BLOCK + i) * _DIGEST_BYTES
            if _digest(view[off : off + DIGEST_BLOCK]) != table[k : k + _DIGEST_BYTES]:
                end = start + off + min(DIGEST_BLOCK, len(view) - off)
                raise _differ(url, start + off, end)
        out.append(view[a - start : b - start])
    return out


def _differ(url: str, a: int, b: int) -> errors.SourceChangedError:
    return errors.SourceChangedError(
        f"{url}: changed since the AnnDataSource was built: bytes [{a}, {b}) "
        "differ from their digest then (verify_reads), while the server's "
        "ETag, size and Last-Modified are unchanged: the object was rewritten "
        "in place with its size and modification time kept (rsync -t, cp -p), "
        "which HTTP's headers cannot show. No byte of the new version was "
        f"returned. {_REBUILD}"
    )


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


def _call(url, storage_options, what: str, function: str, *args, count="", **kwargs):
    """`obstore.<function>(store, key, ...)` (a `count`ed request); errors named."""
    import obstore

    store = _store.store_for(url, storage_options)
    if what == "list":  # the objects below the prefix `url`
        key = _store.split_url(join(url, "x"))[1].rpartition("/")[0] or None
    else:
        key = _store.split_url(url)[1]
    if count:
        _store.count_request(count)
    try:
        return getattr(obstore, function)(store, key, *args, **kwargs)
    except Exception as e:
        raise _errors.store_error(e, url, storage_options, what) from None

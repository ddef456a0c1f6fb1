"""Which version of an object a source reads, and what its ETag can vouch for.

Design notes: docs/reference/design.md#storage-remote-versions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re

from grain_cells import errors
from grain_cells._util import fork
from grain_cells.storage._readers import FileStat
from grain_cells.storage.remote import _range_gets, _store

CONTENT_WINDOWS = 32
CONTENT_WINDOW = 4 << 10  # bytes: 128 KiB read per check in all
DIGEST_BLOCK = 64 << 10  # bytes per digest of `verify_reads`
_DIGEST_BYTES = 8
_BLOCKS_PREFIX = "blocks:"

# `verify_reads` tables of this process, by (URL, content digest).
_tables = fork.ProcessCache()

_HEX_PARTS = re.compile(r'^"?([0-9a-fA-F]+(?:-[0-9a-fA-F]+)+)"?$')


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
    starts = {
        math.floor(k * last / (CONTENT_WINDOWS - 1)) for k in range(CONTENT_WINDOWS)
    }
    return [(s, s + CONTENT_WINDOW) for s in sorted(starts)]


def version_of(url: str, storage_options: dict | None = None, store=None) -> FileStat:
    """The object's version now: one HEAD, and a content digest where needed.

    Raises as `head`, or `SourceChangedError` if it changes while digested.
    """
    stat = _store.head(url, storage_options)
    content = ""
    if verify_reads(storage_options):
        table = _block_digests(url, storage_options, stat, store)
        content = _BLOCKS_PREFIX + hashlib.sha256(table).hexdigest()[:32]
        _tables.get_or_make((url, content), lambda: table)
    elif not tag_follows_content(url, stat):
        digest = hashlib.sha256(f"{stat.size}".encode())
        if windows := content_windows(stat.size):
            for data in _range_gets.get_ranges(
                url, storage_options, windows, stat, store
            ):
                digest.update(memoryview(data))
        content = "sha256:" + digest.hexdigest()[:32]
    return dataclasses.replace(stat, content=content)


verify_reads = functools.partial(_store.option, name="verify_reads")
content_check_s = functools.partial(_store.option, name="content_check_s")


def _block_digests(url, storage_options, stat: FileStat, store) -> bytes:
    """8-byte BLAKE2b digests of each `DIGEST_BLOCK` bytes (one streamed GET)."""
    import obstore
    from obstore import exceptions as ox

    store = _store.store_for(url, storage_options) if store is None else store
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


def widen(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Each `[start, end)` widened to whole `DIGEST_BLOCK` blocks (within `size`)."""
    block = DIGEST_BLOCK
    return [(a - a % block, min(size, -(-b // block) * block)) for a, b in ranges]


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
        "returned. Build a new source (and do not restore iterator state "
        "saved for the old data)."
    )

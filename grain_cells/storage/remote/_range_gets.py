"""Range GETs of one version of an object: the bytes every remote read gets.

Design notes: docs/reference/design.md#storage-remote-range-gets.
"""

from __future__ import annotations

import time

from grain_cells import errors
from grain_cells.storage._readers import FileStat
from grain_cells.storage.remote import _retries, _store

_REBUILD = (
    "Build a new source (and do not restore iterator state saved for the old data)."
)


def get_range(url, storage_options, start: int, end: int, etag: str, store=None):
    """Bytes `[start, end)` of the object at `url`: one GET with `If-Match: etag`."""
    version = _store.ObjectStat(0, etag, 0)
    return get_ranges(url, storage_options, [(start, end)], version, store, True)[0]


def get_ranges(
    url: str,
    storage_options: dict | None,
    ranges: list[tuple[int, int]],
    stat: FileStat,
    store=None,
    if_match: bool = False,
) -> list:
    """Bytes of each `[start, end)` of the version `stat`.

    `if_match` (one range): one GET with `If-Match`; else one obstore call, then
    a HEAD that checks `stat`. Raises `SourceChangedError` (changed, removed),
    `CorruptDataError` (too short) or `ObjectStoreError` (retries ran out).
    """
    import obstore
    from obstore import exceptions as ox

    store = _store.store_for(url, storage_options) if store is None else store
    _, key = _store.split_url(url)
    starts, ends = [int(a) for a, _ in ranges], [int(b) for _, b in ranges]
    _store.count_request("get", len(ranges))
    if not if_match:
        _store.count_request("check")  # the HEAD after the batch
    began = time.monotonic()
    try:
        if if_match:
            options = {"range": (starts[0], ends[0])}
            if stat.etag:
                options["if_match"] = stat.etag
            datas = [obstore.get(store, key, options=options).bytes()]
        else:
            datas = obstore.get_ranges(store, key, starts=starts, ends=ends, coalesce=0)
            now = _store.stat_of(obstore.head(store, key))
    except ox.PreconditionError:
        where = f"bytes [{min(starts)}, {max(ends)})"
        raise errors.SourceChangedError(
            f"{url}: changed since the AnnDataSource was built: its ETag is no "
            f"longer {stat.etag} (detected at a read of {where}). {_REBUILD}"
        ) from None
    except (ox.BaseError, OSError) as e:
        if isinstance(e, (ox.NotFoundError, FileNotFoundError)):
            where = f"bytes [{min(starts)}, {max(ends)})"
            if len(starts) > 1:
                where = f"{len(starts)} ranges in {where}"
            raise errors.SourceChangedError(
                f"{url}: removed since the AnnDataSource was built (detected at a "
                f"read of {where}). Build a new source."
            ) from None
        elapsed = time.monotonic() - began  # retries ran out (policy: _retries)
        raise _retries.named_error(e, url, storage_options, ranges, elapsed) from None
    if not if_match and (
        (now.etag, now.size) != (stat.etag, stat.size)
        or (stat.mtime_ns and now.mtime_ns != stat.mtime_ns)
    ):
        raise errors.SourceChangedError(
            f"{url}: changed since the AnnDataSource was built (ETag "
            f"{stat.etag or 'none'}, {stat.size} bytes then; {now.etag or 'none'}, "
            f"{now.size} bytes now; detected after a read of bytes "
            f"[{min(starts)}, {max(ends)})). {_REBUILD}"
        )
    for data, a, b in zip(datas, starts, ends, strict=True):
        if len(data) != b - a:
            raise errors.CorruptDataError(
                f"{url}: asked for bytes [{a}, {b}), got {len(data)} bytes: the "
                "object ends before HDF5 says its data does (truncated upload?)"
            )
    return datas

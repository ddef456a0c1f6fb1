"""Range GETs of one version of an object: the bytes every remote read gets.

Design notes: docs/reference/design.md#storage-remote-range-gets.
"""

from __future__ import annotations

import time

from grain_cells import errors
from grain_cells.storage.remote import _retries, _store


def get_range(
    url: str,
    storage_options: dict | None,
    start: int,
    end: int,
    etag: str,
    store=None,
):
    """Bytes `[start, end)` of the object at `url`: one GET with `If-Match: etag`.

    Raises:
        errors.SourceChangedError: The object changed or was removed.
        errors.CorruptDataError: The object ends before `end`.
        errors.ObjectStoreError: The request failed after obstore's retries.
    """
    import obstore
    from obstore import exceptions as ox

    if store is None:
        store = _store.store_for(url, storage_options)
    _, key = _store.split_url(url)
    options = {"range": (int(start), int(end))}
    if etag:
        options["if_match"] = etag
    _store.count_request("get")
    began = time.monotonic()
    try:
        data = obstore.get(store, key, options=options).bytes()
    except ox.PreconditionError:
        raise errors.SourceChangedError(
            f"{url}: changed since the AnnDataSource was built: its ETag is no "
            f"longer {etag} (detected at a read of bytes [{start}, {end})). "
            "Build a new source (and do not restore iterator state saved for "
            "the old data)."
        ) from None
    except (ox.BaseError, OSError) as e:
        raise _failure(
            e, url, storage_options, [int(start)], [int(end)], began
        ) from None
    _check_lengths(url, [data], [start], [end])
    return data


def get_ranges(
    url: str,
    storage_options: dict | None,
    ranges: list[tuple[int, int]],
    stat: _store.ObjectStat,
    store=None,
) -> list:
    """Bytes of each `[start, end)`: one obstore call, then a HEAD that checks `stat`.

    Raises as `get_range`.
    """
    import obstore
    from obstore import exceptions as ox

    if store is None:
        store = _store.store_for(url, storage_options)
    _, key = _store.split_url(url)
    starts = [int(a) for a, _ in ranges]
    ends = [int(b) for _, b in ranges]
    _store.count_request("get", len(ranges))
    _store.count_request("check")  # the HEAD after the batch
    began = time.monotonic()
    try:
        datas = obstore.get_ranges(store, key, starts=starts, ends=ends, coalesce=0)
        meta = obstore.head(store, key)
    except (ox.BaseError, OSError) as e:
        raise _failure(e, url, storage_options, starts, ends, began) from None
    now = _store.stat_of(meta)
    if (now.etag, now.size) != (stat.etag, stat.size) or (
        stat.last_modified_ns and now.last_modified_ns != stat.last_modified_ns
    ):
        raise errors.SourceChangedError(
            f"{url}: changed since the AnnDataSource was built (ETag "
            f"{stat.etag or 'none'}, {stat.size} bytes then; {now.etag or 'none'}, "
            f"{now.size} bytes now; detected after a read of bytes "
            f"[{min(starts)}, {max(ends)})). Build a new source (and do not "
            "restore iterator state saved for the old data)."
        ) from None
    _check_lengths(url, datas, starts, ends)
    return datas


def _failure(e, url, storage_options, starts, ends, began) -> Exception:
    """The error of a GET batch that failed: removed, or retries ran out."""
    from obstore import exceptions as ox

    if isinstance(e, (ox.NotFoundError, FileNotFoundError)):
        where = (
            f"bytes [{starts[0]}, {ends[0]})"
            if len(starts) == 1
            else f"{len(starts)} ranges in bytes [{min(starts)}, {max(ends)})"
        )
        return errors.SourceChangedError(
            f"{url}: removed since the AnnDataSource was built (detected at a "
            f"read of {where}). Build a new source."
        )
    return _retries.named_error(  # retries ran out (policy: _retries)
        e,
        url=url,
        ranges=list(zip(starts, ends, strict=True)),
        retry=_retries.retry_config(storage_options),
        elapsed_s=time.monotonic() - began,
    )


def _check_lengths(url, datas, starts, ends) -> None:
    for data, a, b in zip(datas, starts, ends, strict=True):
        if len(data) != b - a:
            raise errors.CorruptDataError(
                f"{url}: asked for bytes [{a}, {b}), got {len(data)} bytes: the "
                "object ends before HDF5 says its data does (truncated upload?)"
            )

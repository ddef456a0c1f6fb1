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
    """Bytes `[start, end)` of the object at `url`, if its ETag is still `etag`.

    The one function through which every remote read goes. The GET carries
    `If-Match: etag`, so the server refuses it once the object has changed:
    a read never mixes bytes of two versions.

    `store` is `_store.store_for(url, storage_options)` when the caller holds it
    (a reader sending many GETs skips the lookup).

    Returns:
        A buffer (`obstore.Bytes`) of exactly `end - start` bytes.

    Raises:
        errors.SourceChangedError: The object changed or was removed.
        errors.CorruptDataError: The object ends before `end`.
        errors.ObjectStoreError: The request failed after obstore's retries
            (`grain_cells.storage.remote._retries`); names URL, range, status, attempts.
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
    except (ox.NotFoundError, FileNotFoundError):
        raise errors.SourceChangedError(
            f"{url}: removed since the AnnDataSource was built (detected at a "
            f"read of bytes [{start}, {end})). Build a new source."
        ) from None
    except (ox.BaseError, OSError) as e:
        # Retries ran out (see store_retries for the policy).
        raise _retries.named_error(
            e,
            url=url,
            ranges=[(int(start), int(end))],
            retry=_retries.retry_config(storage_options),
            elapsed_s=time.monotonic() - began,
        ) from None
    if len(data) != end - start:
        raise errors.CorruptDataError(
            f"{url}: asked for bytes [{start}, {end}), got {len(data)} bytes: the "
            "object ends before HDF5 says its data does (truncated upload?)"
        )
    return data


def get_ranges(
    url: str,
    storage_options: dict | None,
    ranges: list[tuple[int, int]],
    stat: _store.ObjectStat,
    store=None,
) -> list:
    """Bytes of each `[start, end)` of the object, if it is still version `stat`.

    The batched form of `get_range`: all of `ranges` in one call into obstore
    (no coalescing), then one HEAD that checks `stat`'s ETag, size and
    last-modified time (`obstore.get_ranges` sends no `If-Match`).

    Returns:
        One buffer (`obstore.Bytes`) of exactly `end - start` bytes per range.

    Raises:
        errors.SourceChangedError: The object changed or was removed.
        errors.CorruptDataError: The object ends before a range does.
        errors.ObjectStoreError: A request failed after obstore's retries.
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
    except (ox.NotFoundError, FileNotFoundError):
        raise errors.SourceChangedError(
            f"{url}: removed since the AnnDataSource was built (detected at a "
            f"read of {len(ranges)} ranges in bytes [{min(starts)}, {max(ends)})). "
            "Build a new source."
        ) from None
    except (ox.BaseError, OSError) as e:
        raise _retries.named_error(
            e,
            url=url,
            ranges=list(zip(starts, ends, strict=True)),
            retry=_retries.retry_config(storage_options),
            elapsed_s=time.monotonic() - began,
        ) from None
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
    for data, a, b in zip(datas, starts, ends, strict=True):
        if len(data) != b - a:
            raise errors.CorruptDataError(
                f"{url}: asked for bytes [{a}, {b}), got {len(data)} bytes: the "
                "object ends before HDF5 says its data does (truncated upload?)"
            )
    return datas

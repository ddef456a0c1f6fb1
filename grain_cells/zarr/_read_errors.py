"""The named error of a zarr-python read that fails on damaged bytes.

`read_error` turns zarr-python's bare `ValueError` (or a codec's error) into
`errors.CorruptChunkError` naming the store, array, key, rows and fix.

Design notes: docs/reference/design.md#zarr-read-errors.
"""

from __future__ import annotations

from grain_cells import errors

# What zarr-python and its codecs raise on bytes that do not decode.
READ_ERRORS = (ValueError, RuntimeError, OSError, EOFError)


def read_error(
    array, path: str, start: int, stop: int, exc: BaseException
) -> errors.CorruptChunkError:
    """The error of a failed zarr-python read (`exc`) of rows `[start, stop)`."""
    name = "/" + array.path.lstrip("/")
    shards = getattr(array, "shards", None)
    size = int(shards[0] if shards else array.chunks[0])
    kind = "shard" if shards else "chunk"
    first, last = start // size, max(start, stop - 1) // size
    tail = (0,) * (array.ndim - 1)
    prefix = array.path.strip("/")

    def key(k: int) -> str:
        return f"{prefix}/{array.metadata.encode_chunk_key((k, *tail))}".lstrip("/")

    keys = repr(key(first)) + (f" (to {key(last)!r})" if last > first else "")
    rows = (first * size, min((last + 1) * size, int(array.shape[0])))
    what = "its index or a chunk in it" if shards else "its bytes"
    return errors.CorruptChunkError(
        f"{path}: {name} {kind} {keys}, which holds rows [{rows[0]}, {rows[1]}) "
        f"of {name}, cannot be read ({type(exc).__name__}: {exc}): {what} "
        "is cut short or has flipped bytes. The store is damaged: rewrite it, "
        "or copy it again from its source.",
        path=path,
        dataset=name,
        rows=rows,
        chunk_key=key(first),
    )

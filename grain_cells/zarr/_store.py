"""Opening zarr stores read-only: local directories, `.zarr.zip`, buckets and URLs.

Design notes: docs/reference/design.md#zarr-store.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile

import numpy as np
import zarr

from grain_cells import errors
from grain_cells.storage.remote import (
    count_request,
    is_url,
    local_path,
    store_at,
)
from grain_cells.zarr import _keys

# Metadata documents: their content (not just size/mtime) enters the digest.
METADATA_KEYS = (".zgroup", ".zarray", ".zattrs", ".zmetadata", "zarr.json")


def zarr_store(path: str, storage_options: dict | None = None):
    """The read-only zarr store behind `path` (not yet opened as a group)."""
    p = local_path(os.fspath(path))
    if is_url(p):
        if p.rstrip("/").endswith(".zip"):
            raise errors.AnnDataFormatError(
                f"{p}: a zipped zarr store in an object store cannot be read by "
                "range; unzip it into the bucket (a .zarr prefix) or download it"
            )
        if (storage_options or {}).get("verify_reads"):
            raise ValueError(
                f"{p}: storage_options['verify_reads'] checks the blocks of "
                ".h5ad objects and does not apply to zarr stores: in a bucket "
                "every chunk read is already conditional on its key's ETag; on "
                "a plain HTTP server nothing can check a chunk rewritten in "
                "place. Copy the store to a bucket or a local disk, or drop "
                "verify_reads for it."
            )
        store = store_at(p, storage_options)  # refused in a child forked after use
        versions = _keys.take(store)  # of the listing that gave the digest
        url = p.rstrip("/")
        return _keys.VersionedObjectStore(store, url=url, versions=versions)
    if not os.path.exists(p):
        raise FileNotFoundError(f"{p}: no such file or directory")
    if os.path.isfile(p):
        return zarr.storage.ZipStore(p, mode="r")
    return zarr.storage.LocalStore(p, read_only=True)


def open_group(path: str, storage_options: dict | None = None) -> zarr.Group:
    """The root group, read-only (`AnnDataFormatError`: not a group, or damaged)."""
    p = local_path(os.fspath(path))
    root_array = errors.AnnDataFormatError(
        f"{p}: a zarr array at its root, not a group; expected an AnnData "
        "store (a group holding obs, var and X) written by anndata's write_zarr"
    )
    has = [os.path.isfile(os.path.join(p, n)) for n in (".zgroup", "zarr.json")]
    if os.path.isdir(p) and not any(has):
        if os.path.isfile(os.path.join(p, ".zarray")):
            raise root_array
        raise errors.AnnDataFormatError(
            f"{p}: is a directory but not a zarr store (no zarr.json or "
            f".zgroup at its root; it holds {sorted(os.listdir(p))[:8]}); expected "
            "an .h5ad file or a zarr store written by anndata's write_zarr"
        )
    if os.path.isfile(p) and not zipfile.is_zipfile(p):
        raise errors.AnnDataFormatError(
            f"{p}: a file that is neither a zip archive (.zarr.zip) nor a "
            "zarr store directory; expected a store written by anndata's "
            "write_zarr (or an .h5ad file, named .h5ad)"
        )
    store = zarr_store(p, storage_options)
    try:
        return zarr.open_group(store, mode="r")
    except zarr.errors.ContainsArrayError as e:
        raise root_array from e
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, KeyError) as e:
        raise errors.AnnDataFormatError(
            f"{p}: not a zarr store: no zarr group metadata (zarr.json or "
            f".zgroup) at its root ({type(e).__name__}: {e}). Expected a store "
            "written by anndata's write_zarr (or annbatch); pass its root folder."
        ) from e
    except (ValueError, json.JSONDecodeError, zarr.errors.MetadataValidationError) as e:
        raise errors.AnnDataFormatError(
            f"{p}: the zarr group metadata at its root does not parse "
            f"({type(e).__name__}: {e}); the store is damaged or not a zarr "
            "store: rewrite it."
        ) from e


def read(array, index, path: str, rows: tuple[int, int]) -> np.ndarray:
    """`array[index]` (`vindex` for an index array); `CorruptChunkError` named."""
    try:
        if isinstance(index, np.ndarray):
            return np.asarray(array.vindex[index])
        return np.asarray(array[index])
    except (ValueError, RuntimeError, OSError, EOFError) as e:  # zarr's, codecs'
        exc = e
    name = "/" + array.path.lstrip("/")
    shards = getattr(array, "shards", None)
    size = int(shards[0] if shards else array.chunks[0])
    start, stop = rows[0], min(rows[1], int(array.shape[0]))
    first, last = start // size, max(start, stop - 1) // size
    tail = (0,) * (array.ndim - 1)

    def key(k: int) -> str:
        encoded = array.metadata.encode_chunk_key((k, *tail))
        return f"{array.path.strip('/')}/{encoded}".lstrip("/")

    keys = repr(key(first)) + (f" (to {key(last)!r})" if last > first else "")
    rows = (first * size, min((last + 1) * size, int(array.shape[0])))
    kind = "shard" if shards else "chunk"
    what = "its index or a chunk in it" if shards else "its bytes"
    raise errors.CorruptChunkError(
        f"{path}: {name} {kind} {keys}, which holds rows [{rows[0]}, {rows[1]}) "
        f"of {name}, cannot be read ({type(exc).__name__}: {exc}): {what} "
        "is cut short or has flipped bytes. The store is damaged: rewrite it, "
        "or copy it again from its source.",
        path=path,
        dataset=name,
        rows=rows,
        chunk_key=key(first),
    ) from exc


def check_array(array: zarr.Array, path: str) -> zarr.Array:
    """`array` reopened from its own metadata document, checked against `array`."""
    try:
        zarr_format = array.metadata.zarr_format
        own = zarr.open_array(
            array.store, path=array.path, mode="r", zarr_format=zarr_format
        )
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise errors.AnnDataFormatError(
            f"{path}: /{array.path} is listed in the store's consolidated "
            f"metadata but its own metadata document is missing or unreadable "
            f"({type(e).__name__}: {e}); rewrite the store, or re-consolidate "
            "it with zarr.consolidate_metadata if the arrays are intact."
        ) from e
    mine, theirs = own.metadata.to_dict(), array.metadata.to_dict()
    # Attributes do not change what a range read returns: only the fields
    # that do (shape, chunks, dtype, codecs, fill value, ...) must agree.
    diff = sorted(
        k for k in {*mine, *theirs} - {"attributes"} if mine.get(k) != theirs.get(k)
    )
    if diff:
        raise errors.AnnDataFormatError(
            f"{path}: the consolidated metadata of /{array.path} disagrees with "
            f"the array's own document in {', '.join(diff)} (consolidated: "
            f"{ {k: theirs.get(k) for k in diff} }, array: "
            f"{ {k: mine.get(k) for k in diff} }); the store was changed after "
            "it was consolidated. Re-consolidate it (zarr.consolidate_metadata) "
            "or rewrite it."
        )
    return own


def store_digest(path: str, storage_options: dict | None = None) -> str:
    """A digest that changes when the store's arrays or metadata change."""
    # Keys, sizes, mtimes or ETags, metadata contents; a zip: size and mtime.
    p = local_path(os.fspath(path))
    h = hashlib.sha256()
    if is_url(p):
        _digest_bucket(p, storage_options, h)
        return h.hexdigest()
    if os.path.isfile(p):
        st = os.stat(p)
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
        return h.hexdigest()
    for root, dirs, files in os.walk(p):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            st = os.stat(full)
            rel = os.path.relpath(full, p)
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            if name in METADATA_KEYS:
                with open(full, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _digest_bucket(url: str, storage_options: dict | None, h) -> None:
    import obstore

    store = store_at(url, storage_options)
    metas = []
    try:
        for batch in obstore.list(store, chunk_size=1000):
            count_request("list")
            metas.extend(batch)
    except Exception:
        if not url.lower().startswith(("http://", "https://")):
            raise
        metas = []  # plain HTTP lists nothing: the root's documents are covered
        for key in METADATA_KEYS:
            try:
                meta = obstore.head(store, key)
            except FileNotFoundError:
                continue
            count_request("head")
            metas.append({**meta, "path": key})
    else:
        # The next open of the store in this thread (`zarr_store`) reads with these.
        _keys.remember(store, _keys.KeyVersions(metas))
    metas.sort(key=lambda m: m["path"])
    for m in metas:
        h.update(f"{m['path']}\0{m['size']}\0{m.get('e_tag') or ''}\n".encode())
    for m in metas:  # a metadata document without ETag (HTTP): its content
        if not m.get("e_tag") and m["path"].rpartition("/")[2] in METADATA_KEYS:
            count_request("get")
            data = bytes(obstore.get(store, m["path"]).bytes())
            h.update(hashlib.sha256(data).digest())

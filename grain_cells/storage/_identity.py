"""File identity: is this still the file a source (or a checkpoint) was made from?

An `AnnDataSource` reads files in place, from several processes, for days.
A file rewritten or replaced meanwhile would silently yield other cells, so
every file gets a `FileIdentity` when the source is built, made of two parts:

* **Where it is** (`FileStat`): device, inode, size, modification and status
  change times in nanoseconds. Cheap (one `fstat`, about a microsecond), so it
  is compared at every fetch, whenever a process opens the file and when an
  iterator state is restored. It only means something on this machine and
  this path, so checkpoints do not record it.
* **What it holds** (`layout` and `sample`, two SHA-256 digests): the
  metadata that locates the matrix (HDF5 object addresses, shapes, dtypes,
  storage layout, filters, the byte offset of contiguous data or of sampled
  chunks, and for CSR a sample of `indptr`), and a sample of the stored values
  (a few short windows of `data`/`indices`, or of dense rows). A byte-for-byte
  copy has the same digests wherever it lies, so checkpoints and preshuffle
  markers record these (with the size), not paths or times.

What is detected, exactly:

* Any write to the file (in place or by replacing it) after the source was
  built, in any process that reads it: the size, mtime or ctime changes, or
  the path now names another inode. `touch -d`/`cp -p`/`rsync -t` can restore
  the mtime but not the ctime, so these are detected too. So is a `chmod` or
  `chown` (they change the ctime): build a new source after one.
* A file replaced before a worker opens it: the inode differs.
* A restore (or a preshuffle rerun) on a file whose size, matrix layout,
  sampled `indptr` or sampled values differ from those recorded.

Objects in a store (`s3://...`, see `grain_cells.storage.remote._store`) have no
device, inode or ctime: their `FileStat` holds the size, last-modified time
and ETag, taken by one HEAD when the source is built, and every range GET
carries `If-Match: <ETag>` (or a batch of GETs is followed by a HEAD), so any
overwrite that changes the ETag is detected at the next read in any process
(`verify_files` sends a HEAD per object). Where the ETag does not follow the
content (HTTP servers such as nginx: `"<mtime>-<size>"`), the `FileStat`
also holds a digest of sampled bytes, read again when a process opens the
object, at restore and periodically while reading
(`grain_cells.storage.remote._versions`, which says exactly what each kind
of server lets through).

A zarr store (a directory, `.zarr.zip` or bucket prefix of many keys) has
no one inode: its `FileStat` holds a digest of every key with its size and
modification time (ETags in a bucket; `grain_cells.zarr._store.store_digest`),
taken when the source is built and compared when a process opens the store
and by `verify_files`, so a chunk or metadata file written, added or
removed under a source is detected. At every fetch a process that has the
store open compares only the `stat`s of its root metadata files
(`zarr.json`, `.zgroup`, `.zmetadata`, ...; of a `.zarr.zip`, the file),
which anndata rewrites whenever it writes a store
(`grain_cells.io._nodes.StoreFile.check_root`). Its `layout` digest covers each array's
zarr format, shape, dtype, chunk and shard grid and stored bytes,
its `sample` the same value windows as a file's. A checkpoint records
`format: zarr` for a store, so a state saved on an `.h5ad` file is refused
on a zarr store of the same cells (and the other way round): the identity
is that of the stored file, not of the cells. Restore on the format the
state was saved on, or start a new run.

Not detected: a replacement after a process opened the file by rename (that
process keeps reading the original inode, which stays consistent); a change
to a file that the matrix only links to (HDF5 external links and virtual
dataset sources: their layout is recorded, not their times); and, across
processes (restore, preshuffle), a different file of the same size and
layout whose differences avoid the sampled `indptr` entries and values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys

import h5py
import numpy as np

from grain_cells import errors

# Evenly spaced samples: indptr entries, chunks located, and value windows.
_INDPTR_SAMPLES = 65
_CHUNK_SAMPLES = 17
_VALUE_WINDOWS = 8
_WINDOW = 64  # elements (or columns of a dense row) per value window


@dataclasses.dataclass(frozen=True)
class FileStat:
    """Where a file is and when it last changed (`os.stat` fields)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    etag: str = ""  # objects in a store: their ETag (dev, ino and ctime are 0)
    # Objects whose ETag does not follow their content (HTTP servers): a
    # digest of sampled bytes (`grain_cells.storage.remote._versions`).
    content: str = ""
    # zarr stores (a directory or bucket prefix of many keys): a digest of
    # every key with its size and modification time, or its ETag
    # (`grain_cells.zarr._store.store_digest`); the other fields are 0.
    store: str = ""

    @classmethod
    def of(cls, st: os.stat_result) -> FileStat:
        """The fields of a `stat` result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def changes(self, now: FileStat) -> list[str]:
        """What differs between this (then) and `now`, in words."""
        out = []
        if self.store != now.store:
            return [
                "the zarr store's keys, sizes or modification times differ "
                f"(store digest {self.store[:16] or 'none'} then, "
                f"{now.store[:16] or 'none'} now): a chunk or metadata file was "
                "written, added or removed"
            ]
        if self.etag != now.etag:
            out.append(f"ETag {self.etag or 'none'} then, {now.etag or 'none'} now")
        if (self.dev, self.ino) != (now.dev, now.ino):
            out.append(
                f"the path now names another file (inode {self.ino} on device "
                f"{self.dev} then, {now.ino} on {now.dev} now)"
            )
        if self.size != now.size:
            out.append(f"size {self.size} bytes then, {now.size} now")
        if self.mtime_ns != now.mtime_ns:
            out.append(f"modified (mtime {self.mtime_ns} ns then, {now.mtime_ns} now)")
        if self.content != now.content and not out:
            out.append(
                f"its bytes differ (digest of sampled bytes {self.content or 'none'} "
                f"then, {now.content or 'none'} now) while its size, ETag and "
                "Last-Modified are unchanged: rewritten in place with its "
                "modification time kept (rsync -t, cp -p) on a server whose ETag "
                "follows size and modification time, not content (nginx, Apache)"
            )
        if self.ctime_ns != now.ctime_ns and not out:
            out.append(
                f"inode changed (ctime {self.ctime_ns} ns then, {now.ctime_ns} "
                "now): written with its mtime restored, or its permissions changed"
            )
        return out


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """A file's identity: where it is (`stat`) and what it holds (digests).

    Attributes:
        path: The file.
        element: HDF5 path of the matrix the digests describe.
        stat: Device, inode, size and times when the identity was taken.
        layout: SHA-256 (hex) of the metadata that locates the matrix.
        sample: SHA-256 (hex) of sampled stored values.
    """

    path: str
    element: str
    stat: FileStat
    layout: str
    sample: str

    @classmethod
    def take(
        cls, f: h5py.File, path: str, element: str, stat: FileStat | None = None
    ) -> FileIdentity:
        """The identity of an open file's matrix at `element`.

        The `stat` comes from the descriptor HDF5 opened (unless given: an
        object's ETag, size and time), so it describes the very file the
        digests were computed from.
        """
        return cls(
            os.fspath(path),
            element,
            stat_of_h5(f, path) if stat is None else stat,
            layout_digest(f, element),
            sample_digest(f, element),
        )

    def content(self) -> dict:
        """What a checkpoint records: location-free (a copy matches)."""
        store = {"format": "zarr"} if self.stat.store else {}
        return {
            **store,
            "element": self.element,
            "bytes": self.stat.size,
            "layout": self.layout[:16],
            "sample": self.sample[:16],
        }

    def check_stat(self, now: FileStat, when: str) -> None:
        """Raises `SourceChangedError` if `now` differs from `stat`.

        Args:
            now: The file's stat now.
            when: What was being done, for the message (e.g. "at a fetch").
        """
        changes = self.stat.changes(now)
        if changes:
            raise errors.SourceChangedError(
                f"{self.path}: changed since the AnnDataSource was built "
                f"(detected {when}): {'; '.join(changes)}. The cells read now "
                "would not be the cells the source describes. Build a new "
                "source (and do not restore iterator state saved for the old "
                "data)."
            )

    def check_layout(self, f: h5py.File, when: str) -> None:
        """Raises `SourceChangedError` if the open file's layout differs."""
        now = layout_digest(f, self.element)
        if now != self.layout:
            raise errors.SourceChangedError(
                f"{self.path}: changed since the AnnDataSource was built "
                f"(detected {when}): the storage of {self.element} moved or "
                f"changed (layout digest {self.layout[:16]} then, {now[:16]} "
                "now). Build a new source (and do not restore iterator state "
                "saved for the old data)."
            )


def stat_of_h5(f: h5py.File, path: str) -> FileStat:
    """The stat of the descriptor behind an open h5py file (else of `path`)."""
    try:
        fd = f.id.get_vfd_handle()
    except Exception:  # a driver without a POSIX descriptor
        fd = None
    if isinstance(fd, int) and fd >= 0:
        try:
            return FileStat.of(os.fstat(fd))
        except OSError:
            pass
    return FileStat.of(os.stat(path))


def _is_zarr_array(obj) -> bool:
    zarr = sys.modules.get("zarr")  # imported by whoever opened a store
    return zarr is not None and isinstance(obj, zarr.Array)


def _is_dataset(obj) -> bool:
    return isinstance(obj, h5py.Dataset) or _is_zarr_array(obj)


def _zarr_storage(array) -> list:
    """What locates one zarr array's bytes: its grid and stored size.

    Fields that read the same under every zarr-python version (not the
    metadata's JSON, whose spelling may change): a codec change shows in
    the stored bytes.
    """
    return [
        array.path,
        array.metadata.zarr_format,
        tuple(array.shape),
        np.dtype(array.dtype).str,
        tuple(array.chunks),
        None if array.shards is None else tuple(array.shards),
        int(array.nbytes_stored()),
    ]


def _storage(ds) -> list:
    """What locates one dataset's bytes in the file (sampled for chunks)."""
    if _is_zarr_array(ds):
        return _zarr_storage(ds)
    plist = ds.id.get_create_plist()
    layout = plist.get_layout()
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    out = [
        ds.name,
        h5py.h5o.get_info(ds.id).addr,
        ds.shape,
        ds.dtype.str,
        ds.chunks,
        int(layout),
        filters,
    ]
    if layout == h5py.h5d.CONTIGUOUS:
        out.append(ds.id.get_offset())
    elif layout == h5py.h5d.VIRTUAL:
        out.append(
            [
                (plist.get_virtual_filename(i), plist.get_virtual_dsetname(i))
                for i in range(plist.get_virtual_count())
            ]
        )
    elif layout == h5py.h5d.CHUNKED and ds.shape and ds.shape[0]:
        n_chunks = -(-ds.shape[0] // ds.chunks[0])
        picks = np.unique(np.linspace(0, n_chunks - 1, _CHUNK_SAMPLES).astype(int))
        for k in picks.tolist():
            coord = (k * ds.chunks[0],) + (0,) * (len(ds.shape) - 1)
            try:
                info = ds.id.get_chunk_info_by_coord(coord)
                out.append((info.byte_offset, info.size, info.filter_mask))
            except Exception:  # a chunk never written
                out.append(None)
    return out


def _datasets(f, element: str) -> list:
    obj = f[element]
    if _is_dataset(obj):
        return [obj]
    return [obj[k] for k in ("data", "indices", "indptr") if k in obj]


def layout_digest(f: h5py.File, element: str) -> str:
    """SHA-256 (hex) of what locates the matrix at `element`.

    Covers the HDF5 addresses, shapes, dtypes, storage layout and filters of
    its datasets, the byte offsets of contiguous data or of evenly spaced
    chunks, the element's `shape` attribute, and evenly spaced `indptr`
    entries for CSR. Reads a few hundred bytes.
    """
    obj = f[element]
    parts: list = [element]
    group = not _is_dataset(obj)
    if group:
        parts.append(np.asarray(obj.attrs.get("shape", ())).tolist())
        parts.append(str(obj.attrs.get("encoding-type", "")))
    for ds in _datasets(f, element):
        parts.append(_storage(ds))
    if group and "indptr" in obj:
        ptr = obj["indptr"]
        n = ptr.shape[0]
        if n:
            at = np.unique(np.linspace(0, n - 1, _INDPTR_SAMPLES).astype(np.int64))
            picked = ptr.vindex[at] if _is_zarr_array(ptr) else ptr[at]
            parts.append(np.asarray(picked).astype(np.int64).tolist())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def sample_digest(f: h5py.File, element: str) -> str:
    """SHA-256 (hex) of a few evenly spaced windows of the stored values.

    CSR: `_VALUE_WINDOWS` windows of `_WINDOW` elements of `data` and of
    `indices`; dense: the first `_WINDOW` columns of evenly spaced rows.
    """
    digest = hashlib.sha256(element.encode())
    for ds in _datasets(f, element):
        if ds.name.endswith("indptr") or not ds.shape or not ds.shape[0]:
            continue
        n = ds.shape[0]
        starts = np.unique(
            np.linspace(0, max(n - _WINDOW, 0), _VALUE_WINDOWS).astype(np.int64)
        )
        for a in starts.tolist():
            window = ds[a : a + _WINDOW] if ds.ndim == 1 else ds[a, :_WINDOW]
            digest.update(np.ascontiguousarray(window).tobytes())
    return digest.hexdigest()


def _digest(values) -> str:
    """Short SHA-256 of a sequence of strings (None for none)."""
    if values is None:
        return "none"
    joined = "\0".join(str(v) for v in np.asarray(values).tolist())
    return "sha256:" + hashlib.sha256(joined.encode()).hexdigest()[:16]


def source_identity(source) -> dict:
    """What a checkpoint records about an `AnnDataSource`: content, not paths.

    The files (in order) by cell count, matrix element, size and digests
    (`FileIdentity.content`), the output genes and obs categories by digest,
    and the configuration by value. A copy of the files in another folder
    gives the same identity; other data or another configuration does not.

    Args:
        source: An `AnnDataSource` (or a view of one).

    Returns:
        A JSON-serialisable dict.
    """
    return {
        "files": [
            {
                "cells": source.file_info(i).n_obs,
                **source.file_identity(i).content(),
            }
            for i in range(len(source.paths))
        ],
        "block_size": source.block_size,
        "blocks": source.blocks_id or "all",
        "obs_columns": list(source.obs_columns),
        "obs_missing": source.obs_missing,
        "categories": {c: _digest(v) for c, v in source.categories.items()},
        "join": source.join,
        "genes": f"{source.num_genes} {_digest(source.var_names)}",
        # Only when set, so states saved before the option still restore.
        **({"genes_from": source.genes_from} if source.genes_from else {}),
    }

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

Design notes: docs/reference/design.md#io-identity.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

import numpy as np

from grain_cells import errors
from grain_cells.io import _nodes
from grain_cells.storage import FileStat

# Evenly spaced samples: indptr entries and value windows (chunks located:
# the format's, `Format.array_layout`).
_INDPTR_SAMPLES = 65
_VALUE_WINDOWS = 8
_WINDOW = 64  # elements (or columns of a dense row) per value window
# An uncompressed 1-D array up to this size is read whole for its windows
# (one read, not eight: a thin file's `data` and `indices`, issue 33); a
# compressed one is not (its other chunks would be decoded, or refused).
_WHOLE_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class FileIdentity:
    """A file's identity: where it is (`stat`) and what it holds (digests).

    Attributes:
        path: The file.
        element: HDF5 path of the matrix the digests describe.
        stat: Device, inode, size and times when the identity was taken.
        layout: SHA-256 (hex) of the metadata that locates the matrix.
        sample: SHA-256 (hex) of sampled stored values.
        format: What checkpoints record as the file's format
            (`Format.recorded_format`; None for `.h5ad` files).
    """

    path: str
    element: str
    stat: FileStat
    layout: str
    sample: str
    format: str | None = None

    @classmethod
    def take(
        cls,
        f,
        path: str,
        element: str,
        stat: FileStat | None = None,
        nodes: tuple | None = None,
    ) -> FileIdentity:
        """The identity of an open file's matrix at `element`.

        The `stat` comes from the open file (`Format.stat_of`: the descriptor
        HDF5 opened) unless given (an object's ETag, size and time), so it
        describes the very file the digests were computed from. `nodes`:
        `matrix_nodes(f, element)`, when the caller has them.
        """
        if nodes is None:
            nodes = matrix_nodes(f, element)  # looked up once for both digests
        return cls(
            os.fspath(path),
            element,
            _nodes.stat_of(f, path) if stat is None else stat,
            layout_digest(f, element, nodes),
            sample_digest(f, element, nodes),
            _nodes.format_of(f).recorded_format(),
        )

    def content(self) -> dict:
        """What a checkpoint records: location-free (a copy matches)."""
        recorded = {"format": self.format} if self.format else {}
        return {
            **recorded,
            "element": self.element,
            "bytes": self.stat.size,
            "layout": self.layout[:16],
            "sample": self.sample[:16],
        }

    def check_stat(self, now: FileStat, when: str) -> None:
        """Raises `SourceChangedError` if `now` differs from `stat`.

        `when`: what was being done, for the message (e.g. "at a fetch").
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

    def check_layout(self, f, when: str) -> None:
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


def matrix_nodes(f, element: str) -> tuple:
    """`(node, arrays)`: the element and its arrays by name (`""`: dense)."""
    obj = _nodes.at(f, element)
    if _nodes.is_array(obj):
        return obj, {"": obj}
    arrays = {k: _nodes.get(obj, k) for k in ("data", "indices", "indptr")}
    return obj, {k: v for k, v in arrays.items() if v is not None}


def layout_digest(f, element: str, nodes: tuple | None = None) -> str:
    """SHA-256 (hex) of what locates the matrix at `element`.

    Covers what locates each of its arrays' bytes (`Format.array_layout`;
    HDF5: addresses, shapes, dtypes, storage layout and filters, the byte
    offsets of contiguous data or of evenly spaced chunks), the element's
    `shape` attribute, and evenly spaced `indptr` entries for CSR. Reads a
    few hundred bytes. `nodes`: `matrix_nodes(f, element)`, when the caller
    has them.
    """
    obj, arrays = matrix_nodes(f, element) if nodes is None else nodes
    parts: list = [element]
    group = "" not in arrays
    if group:
        parts.append(np.asarray(_nodes.attr(obj, "shape", ())).tolist())
        parts.append(str(_nodes.attr(obj, "encoding-type", "")))
    for ds in arrays.values():
        parts.append(_nodes.format_of(ds).array_layout(ds))
    ptr = arrays.get("indptr")
    if ptr is not None:
        n = ptr.shape[0]
        if n:
            at = _spaced(n - 1, _INDPTR_SAMPLES)
            picked = _nodes.read(ptr, at, _nodes.file_name(f), (int(at[0]), n))
            parts.append(np.asarray(picked).astype(np.int64).tolist())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def sample_digest(f, element: str, nodes: tuple | None = None) -> str:
    """SHA-256 (hex) of a few evenly spaced windows of the stored values.

    CSR: `_VALUE_WINDOWS` windows of `_WINDOW` elements of `data` and of
    `indices`; dense: the first `_WINDOW` columns of evenly spaced rows.
    `nodes` as in `layout_digest`.
    """
    arrays = (matrix_nodes(f, element) if nodes is None else nodes)[1]
    digest = hashlib.sha256(element.encode())
    path = _nodes.file_name(f)
    for ds in arrays.values():
        shape = ds.shape
        if ds.name.endswith("indptr") or not shape or not shape[0]:
            continue
        read = _nodes.format_of(ds).read
        n = shape[0]
        starts = _spaced(max(n - _WINDOW, 0), _VALUE_WINDOWS)
        if (
            len(shape) == 1
            and n * ds.dtype.itemsize <= _WHOLE_BYTES
            and _nodes.chunk_bytes(ds) is None
        ):  # small and stored plain: one read, its windows cut from it (same bytes)
            whole = np.ascontiguousarray(read(ds, np.s_[0:n], path, (0, n)))
            for a in starts.tolist():
                digest.update(whole[a : a + _WINDOW].tobytes())
            continue
        for a in starts.tolist():
            if len(shape) == 1:
                window = read(ds, np.s_[a : a + _WINDOW], path, (a, a + _WINDOW))
            else:
                window = read(ds, np.s_[a, :_WINDOW], path, (a, a + 1))
            digest.update(np.ascontiguousarray(window).tobytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=256)
def _spaced(stop: int, num: int) -> np.ndarray:
    """`num` evenly spaced integers from 0 to `stop`, distinct (read-only).

    Remembered: a collection's files mostly repeat their sizes (issue 33).
    """
    out = np.unique(np.linspace(0, stop, num).astype(np.int64))
    out.flags.writeable = False
    return out


def _digest(values) -> str:
    """Short SHA-256 of a sequence of strings (None for none)."""
    if values is None:
        return "none"
    joined = "\0".join(str(v) for v in np.asarray(values).tolist())
    return "sha256:" + hashlib.sha256(joined.encode()).hexdigest()[:16]


# A source of more files than this records them by one digest (`files_entry`).
LISTED_FILES = 16


def file_entries(source) -> list[dict]:
    """Each file's content record, in order: cells and `FileIdentity.content`."""
    return [
        {"cells": source.file_info(i).n_obs, **source.file_identity(i).content()}
        for i in range(len(source.paths))
    ]


def files_entry(entries: list) -> list | dict:
    """What a checkpoint records of the files: the entries, or their digest.

    Up to `LISTED_FILES` files, the entries themselves (a mismatch names
    the file). Past it, a fixed-size summary, so that a state's size and
    `get_state`'s cost do not grow with the files (issue 33: 1.45 MB at
    10,000 files): the count, total cells and bytes, and a SHA-256 of the
    entries as JSON (sorted keys). A state that lists more files than
    that was saved by an older grain_cells and is refused by name
    (`grain_cells.pipeline._state_checks`).
    """
    if not isinstance(entries, list) or len(entries) <= LISTED_FILES:
        return entries
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    return {
        "count": len(entries),
        "cells": sum(int(e.get("cells", 0)) for e in entries),
        "bytes": sum(int(e.get("bytes", 0)) for e in entries),
        "sha256": hashlib.sha256(text.encode()).hexdigest()[:32],
    }


def source_identity(source) -> dict:
    """What a checkpoint records about an `AnnDataSource`: content, not paths.

    The files (in order) by cell count, matrix element, size and digests
    (`FileIdentity.content`; past `LISTED_FILES` files, by one digest of
    those: `files_entry`), the output genes and obs categories by digest,
    and the configuration by value. A copy of the files in another folder
    gives the same identity; other data or another configuration does not.
    A JSON-serialisable dict, of an `AnnDataSource` or a view of one.
    """
    return {
        "files": files_entry(file_entries(source)),
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

"""Each file's byte layouts on disk: a process's first open of it without its format.

`take` records, while the build inspects a file, the byte layouts of the
matrix's arrays and of the obs columns read when all are uncompressed;
`grain_cells.io._meta_cache` writes them inside the file's metadata entry
(`grain_cells.io._entries`: one file per file). `first_open` then opens
an unchanged local file with `open` + `fstat` (compared with the identity
taken at build), one small JSON read and positional reads of its obs
columns: no format library. Anything missing, unreadable, of another shape
or with codes outside a column's categories is a miss: the file opens
through its format.

Design notes: docs/reference/design.md#io-layout-cache.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import numpy as np

from grain_cells import formats
from grain_cells.formats import ByteLayout, PositionalReader
from grain_cells.io import _entries, _layouts
from grain_cells.io._obs_cache import MIN_CELLS
from grain_cells.io._obsm import OBSM, element_reader
from grain_cells.storage import FileStat

_VERSION = "layouts-v1"


def take(f, fmt, path: str, info, stat: FileStat, kinds, nodes) -> dict | None:
    """The file's layouts entry (JSON-able), or None when not all positional.

    Takes the layouts from the nodes the build already looked up (HDF5:
    its own calls on each array, no reader built: issue 33).

    Args:
        f: The open file's root (`Format.open`).
        fmt: Its format.
        path: The file.
        info: Its matrix summary.
        stat: Its stat.
        kinds: The kinds of the obs columns read that the file has
            (`ColumnKind.read`).
        nodes: `(matrix, columns)`: the matrix's `(element, arrays)` as
            `_identity.matrix_nodes` gives them, and per column in `kinds`
            its array of values or codes where the column is plain
            (`obs_column_kinds`).
    """
    if "://" in path or stat.etag or stat.content or stat.store:
        return None
    try:
        return _take(f, fmt, path, info, stat, kinds, nodes)
    except Exception:  # only a shortcut: the file opens through its format
        return None


def _take(f, fmt, path, info, stat, kinds, nodes) -> dict | None:
    fd = fmt.open_bytes(f, path, {}, stat)
    if fd is None:
        return None
    try:
        if getattr(fd, "remote", True):
            return None
        matrix_nodes, columns = nodes
        matrix = _matrix_layouts(f, fmt, path, info, fd, matrix_nodes)
        if matrix is None:
            return None
        obs = {}
        for c, kind in kinds.items():
            array = columns.get(c)
            if array is None:
                return None  # read whole: only its format reads it
            column = _column_layout(fmt, path, fd, kind, array)
            if column is None:
                return None
            obs[c] = column
    finally:
        fd.close()
    out = {k: _layout_json(v) for k, v in matrix.items()}
    if any(v is None for v in out.values()):
        return None
    return {"version": _VERSION, "path": path, "matrix": out, "obs": obs}


def _matrix_layouts(f, fmt, path, info, fd, matrix) -> dict | None:
    """The matrix's layouts by the names `_layouts.reader_of` takes."""
    _, arrays = matrix
    if info.element.startswith(OBSM) or not (
        set(arrays) == {""} or set(arrays) == {"data", "indices", "indptr"}
    ):  # other element kinds: from the reader itself
        return _layouts.layouts_of(element_reader(f, info, fd), fd)
    out = {}
    for name, array in arrays.items():
        layout = fmt.byte_layout(array, path, fd)
        if layout is None:
            return None
        out[name or "x"] = layout
    return out


def _column_layout(fmt, path: str, fd, kind, array) -> dict | None:
    """A plain obs column's values as a layout (`obs_column_kinds`)."""
    layout = fmt.byte_layout(array, path, fd)
    if layout is None or len(layout.shape) != 1:
        return None
    as_json = _layout_json(layout)
    if as_json is None:
        return None
    categories = kind.categories
    return {
        "layout": as_json,
        "as": np.dtype(kind.dtype).str,
        "n_categories": None if categories is None else len(categories),
    }


def _layout_json(layout: ByteLayout) -> dict | None:
    d = layout.dtype
    if d.hasobject or d.fields is not None or np.dtype(d.str) != d:
        return None
    return {
        "name": layout.name,
        "dtype": d.str,
        "shape": list(layout.shape),
        "chunk_rows": int(layout.chunk_rows),
        "offsets": layout.offsets.tolist(),
        "chunk_length": layout.chunk_length,
    }


def _layout(d: dict) -> ByteLayout:
    return ByteLayout(
        str(d["name"]),
        np.dtype(d["dtype"]),
        tuple(int(x) for x in d["shape"]),
        int(d["chunk_rows"]),
        np.array(d["offsets"], np.int64),
        None if d["chunk_length"] is None else int(d["chunk_length"]),
    )


class Found(NamedTuple):
    """What a first open takes from an entry."""

    format: object
    layouts: dict
    obs: dict


def first_open(files, i: int) -> Found | None:
    """File `i` of `files` (a `FileSet`) from its entry, or None (a miss).

    The file's descriptor is opened and its `fstat` checked against the
    identity taken at build (a changed file raises `SourceChangedError`,
    as any open does); its obs columns are read positionally through it.
    On a miss the caller opens the file through its format.
    """
    identity = files.identities[i]
    stat = identity.stat
    if stat.etag or stat.content or stat.store or "://" in identity.path:
        return None
    info = files.infos[i]
    if files.obs_names and info.n_obs >= MIN_CELLS:
        return None  # its obs columns are mapped from the shared cache
    fmt = formats.for_path(identity.path)
    fd = fmt.open_bytes(None, identity.path, files.storage_options, stat)
    if fd is None:
        return None
    try:
        now = fd.stat()
        identity.check_stat(now, "when a process opened it")
        found = _from_entry(files, i, fd, now)
    finally:
        fd.close()
    return None if found is None else Found(fmt, *found)


def _from_entry(files, i: int, fd, stat: FileStat):
    info = files.infos[i]
    name = _entries.entry_name(info.path, files.element, files.genes.genes_from, stat)
    try:
        with open(os.path.join(_entries.cache_dir(), name), "rb") as fh:
            entry = json.loads(fh.read())
        if entry.get("version") != _entries.VERSION or entry.get("path") != info.path:
            return None
        entry = entry["layouts"]
        if entry is None or entry.get("version") != _VERSION:
            return None
        layouts = {k: _layout(v) for k, v in entry["matrix"].items()}
        obs = {}
        for c in files.obs_names:
            column = files.obs[c]
            if not column.present[i]:
                obs[c] = column.file_values(i, None, info.n_obs)
                continue
            values = _read_column(entry["obs"][c], info, fd)
            if values is None:
                return None
            obs[c] = column.file_values(i, _Values(values), info.n_obs)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return layouts, obs


class _Values:
    """What `HarmonisedColumn.file_values` reads of a column (`values`)."""

    __slots__ = ("values",)

    def __init__(self, values):
        self.values = values


def _read_column(d: dict, info, fd) -> np.ndarray | None:
    layout = _layout(d["layout"])
    n = layout.shape[0]
    if n != info.n_obs:
        return None
    out = np.empty(n, layout.dtype)
    if n:
        PositionalReader(layout, info.path, fd).read(np.array([0]), np.array([n]), out)
    n_cat = d["n_categories"]
    if n_cat is not None:
        if n and (int(out.max()) >= n_cat or int(out.min()) < -1):
            return None  # the format's reader reports it
        return out
    return out.astype(np.dtype(d["as"]), copy=False)


__all__ = ["Found", "first_open", "take"]

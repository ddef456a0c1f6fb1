"""File identity: is this still the file a source (or a checkpoint) was made from?

Where the file is (`FileStat`: compared at every fetch, open and restore,
never recorded) and what it holds (SHA-256 of the matrix's layout and of
sampled values: a copy has the same, so checkpoints record these).

Design notes: docs/reference/design.md#io-identity.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import operator
import os

import numpy as np

from grain_cells import errors
from grain_cells.io import _nodes
from grain_cells.storage import FileStat

# Evenly spaced samples: indptr entries and value windows.
_INDPTR_SAMPLES = 65
_VALUE_WINDOWS = 8
_WINDOW = 64  # elements (or columns of a dense row) per value window
_WHOLE_BYTES = 256 * 1024  # an uncompressed 1-D array up to this: one read
# What a fetch compares of a local file's `FileStat` and of its `os.fstat`.
stat_key = operator.attrgetter("ino", "dev", "size", "mtime_ns", "ctime_ns")
fstat_key = operator.attrgetter(
    "st_ino", "st_dev", "st_size", "st_mtime_ns", "st_ctime_ns"
)


@dataclasses.dataclass(frozen=True, slots=True)
class FileIdentity:
    """A file's `stat` and its matrix's digests; `format`: recorded (None: `.h5ad`)."""

    path: str
    element: str
    stat: FileStat
    layout: str
    sample: str
    format: str | None = None

    @classmethod
    def take(
        cls, f, path: str, element: str, stat: FileStat | None = None, nodes=None
    ) -> FileIdentity:
        """The identity of an open file's matrix (`stat`: the file's unless given)."""
        nodes = nodes or matrix_nodes(f, element)  # once for both digests
        fmt = _nodes.format_of(f)
        stat = fmt.stat_of(f, path) if stat is None else stat
        digests = layout_digest(f, element, nodes), sample_digest(f, element, nodes)
        return cls(os.fspath(path), element, stat, *digests, fmt.recorded_format())

    @property
    def local(self) -> bool:
        """Whether the file is local and its `stat` alone identifies it."""
        stat = self.stat
        return not (stat.etag or stat.content or stat.store or "://" in self.path)

    @property
    def is_object(self) -> bool:
        """Whether it is an object (a URL, not a store): each read is of this
        version (its ETag checked per GET; its sampled bytes where due).
        """  # noqa: D205
        stat = self.stat
        return bool(stat.etag or stat.content) and not stat.store

    def content(self) -> dict:
        """What a checkpoint records: location-free (a copy matches)."""
        return content_entry(
            self.format, self.element, self.stat.size, self.layout, self.sample
        )

    def check_stat(self, now: FileStat, when: str) -> None:
        """Raises `SourceChangedError` if `now` differs (`when`: e.g. "at a fetch")."""
        changes = self.stat.changes(now)
        if changes:
            raise self._changed(
                when,
                f"{'; '.join(changes)}. The cells read now would not be the "
                "cells the source describes",
            )

    def check_layout(self, f, when: str) -> None:
        """Raises `SourceChangedError` if the open file's layout differs."""
        now = layout_digest(f, self.element)
        if now != self.layout:
            raise self._changed(
                when,
                f"the storage of {self.element} moved or changed (layout digest "
                f"{self.layout[:16]} then, {now[:16]} now)",
            )

    def _changed(self, when: str, what: str) -> errors.SourceChangedError:
        return errors.SourceChangedError(
            f"{self.path}: changed since the AnnDataSource was built (detected "
            f"{when}): {what}. Build a new source (and do not restore iterator "
            "state saved for the old data)."
        )


def matrix_nodes(f, element: str) -> tuple:
    """`(node, arrays)`: the element and its arrays by name (`""`: dense)."""
    obj = _nodes.at(f, element)
    if _nodes.is_array(obj):
        return obj, {"": obj}
    arrays = {k: _nodes.get(obj, k) for k in ("data", "indices", "indptr")}
    return obj, {k: v for k, v in arrays.items() if v is not None}


def layout_digest(f, element: str, nodes: tuple | None = None) -> str:
    """SHA-256 (hex) of what locates the matrix at `element` (a few hundred bytes)."""
    obj, arrays = matrix_nodes(f, element) if nodes is None else nodes
    parts: list = [element]
    group = "" not in arrays
    if group:
        parts.append(np.asarray(_nodes.attr(obj, "shape", ())).tolist())
        parts.append(str(_nodes.attr(obj, "encoding-type", "")))
    for ds in arrays.values():
        parts.append(_nodes.format_of(ds).array_layout(ds))
    ptr = arrays.get("indptr")
    if ptr is not None and ptr.shape[0]:
        n = ptr.shape[0]
        at = _spaced(n - 1, _INDPTR_SAMPLES)
        path = _nodes.file_name(f)
        picked = _nodes.format_of(ptr).read(ptr, at, path, (int(at[0]), n))
        parts.append(np.asarray(picked).astype(np.int64).tolist())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def sample_digest(f, element: str, nodes: tuple | None = None) -> str:
    """SHA-256 (hex) of evenly spaced windows of the matrix's stored values."""
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
        whole = None
        if (
            len(shape) == 1
            and n * ds.dtype.itemsize <= _WHOLE_BYTES
            and _nodes.format_of(ds).chunk_bytes(ds) is None
        ):  # small and stored plain: one read, its windows cut from it (same bytes)
            whole = read(ds, np.s_[0:n], path, (0, n))
        for a in starts.tolist():
            if whole is not None:
                window = whole[a : a + _WINDOW]
            elif len(shape) == 1:
                window = read(ds, np.s_[a : a + _WINDOW], path, (a, a + _WINDOW))
            else:
                window = read(ds, np.s_[a, :_WINDOW], path, (a, a + 1))
            digest.update(np.ascontiguousarray(window).tobytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=256)
def _spaced(stop: int, num: int) -> np.ndarray:
    """`num` evenly spaced distinct integers from 0 to `stop` (read-only)."""
    out = np.unique(np.linspace(0, stop, num).astype(np.int64))
    out.flags.writeable = False
    return out


def _digest(values) -> str:
    """Short SHA-256 of a sequence of strings (None for none)."""
    if values is None:
        return "none"
    joined = "\0".join(str(v) for v in np.asarray(values).tolist())
    return "sha256:" + hashlib.sha256(joined.encode()).hexdigest()[:16]


def content_entry(fmt, element: str, size: int, layout: str, sample: str) -> dict:
    """`FileIdentity.content` from its fields (`FileRecords.contents`: columns)."""
    recorded = {"format": fmt} if fmt else {}
    return {
        **recorded,
        "element": element,
        "bytes": size,
        "layout": layout[:16],
        "sample": sample[:16],
    }


# A source of more files than this records them by one digest (`files_entry`).
LISTED_FILES = 16


def file_entries(source) -> list[dict]:
    """Each file's content record, in order: cells and `FileIdentity.content`."""
    return source.files.records.contents()  # (`FileIdentity.content`'s fields)


def files_entry(entries: list) -> list | dict:
    """What a checkpoint records of the files: the entries, or their digest."""
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
    """What a checkpoint records of an `AnnDataSource`: content, not paths (JSON)."""
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

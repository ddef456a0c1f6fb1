"""What a source takes of each file when it is built, cached by the file's stat.

`MetaCache` keeps each file's matrix summary, identity, gene keys, obs
column names and obs column kinds in `$GRAIN_CELLS_CACHE/file-meta/` (else
`$XDG_CACHE_HOME/grain_cells` or `~/.cache/grain_cells`): a build over
unchanged files takes one `stat` and one small read per file instead of an
open (`inspect_file`). An entry's name digests the path, element, gene key
column and the file's whole `stat`, so a stale entry is never read; only
local files with a plain `stat` identity, quiet for `QUIET_NS`, are
cached. Anything unreadable is a miss. Delete the folder any time.

Design notes: docs/reference/design.md#io-meta-cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat as stat_mod
import time

import numpy as np

from grain_cells import formats
from grain_cells._util.cache_files import write_atomic
from grain_cells.io import _h5ad, _layout_cache, _nodes
from grain_cells.io._entries import STAT_FIELDS as _STAT
from grain_cells.io._entries import VERSION as _VERSION
from grain_cells.io._entries import cache_dir, entry_name
from grain_cells.io._genes import read_gene_keys
from grain_cells.io._h5ad import MatrixInfo
from grain_cells.io._identity import FileIdentity, matrix_nodes
from grain_cells.io._obs import ColumnKind
from grain_cells.io._open import open_file
from grain_cells.storage import FileStat, LocalByteReader

# A file changed less than this long ago is not cached (see "Key").
QUIET_NS = 2_000_000_000
# A local file up to this size is asked ahead whole before it is inspected.
READ_AHEAD_BYTES = 2 << 20


class FileMeta:
    """What `FileSet.inspect` takes of one file (see the module docstring)."""

    __slots__ = ("have", "identity", "info", "keys", "kinds", "layouts")

    def __init__(self, info, identity, keys, have, kinds, layouts=None):
        self.info: MatrixInfo = info
        self.identity: FileIdentity = identity
        self.keys: np.ndarray = keys
        self.have: list[str] = have
        self.kinds: dict[str, ColumnKind] = kinds  # columns read (present ones)
        # Byte layouts for a first open without the format (`_layout_cache`).
        self.layouts: dict | None = layouts


def _local_stat(path: str) -> FileStat | None:
    """A local regular file's stat, or None (URLs, stores, missing files)."""
    if "://" in path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStat.of(st) if stat_mod.S_ISREG(st.st_mode) else None


class MetaCache:
    """Entries of one build: arrays read once per build (`_arrays`)."""

    def __init__(self, element: str, genes_from: str | None):
        self.element = element
        self.genes_from = genes_from
        self.folder = cache_dir()
        self._arrays: dict[str, np.ndarray] = {}
        # Names of arrays stored by this build, by content (`_save_array`):
        # a collection's files mostly share one gene list and categories.
        self._names: dict[tuple, str | None] = {}
        # The same, by the identity of a read-only array met before: files of
        # one gene list share one array (`_frames.var_names`), unhashed here.
        self._by_id: dict[int, tuple] = {}

    def lookup(self, path: str, obs_names) -> FileMeta | None:
        """The file's entry if the file is unchanged and it has every column."""
        stat = _local_stat(path)
        if stat is None:
            return None
        name = entry_name(path, self.element, self.genes_from, stat)
        try:
            with open(os.path.join(self.folder, name), "rb") as f:
                entry = json.loads(f.read())
            meta = self._parse(entry, path, stat)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None
        if meta is None or any(
            c in meta.have and c not in meta.kinds for c in obs_names
        ):
            return None
        return meta

    def _parse(self, entry: dict, path: str, stat: FileStat) -> FileMeta | None:
        if entry.get("version") != _VERSION or entry.get("path") != path:
            return None
        i, d = entry["info"], entry["identity"]
        if FileStat(*d["stat"]) != stat:
            return None
        info = MatrixInfo(
            path,
            str(i["element"]),
            str(i["encoding"]),
            int(i["n_obs"]),
            int(i["n_vars"]),
            np.dtype(i["dtype"]),
            None if i["nnz"] is None else int(i["nnz"]),
            None if i["chunk_bytes"] is None else int(i["chunk_bytes"]),
        )
        identity = FileIdentity(
            path,
            str(d["element"]),
            stat,
            str(d["layout"]),
            str(d["sample"]),
            d["format"],
        )
        keys = self._array(entry["keys"])
        kinds = {}
        for c, k in entry["kinds"].items():
            cats = None if k["categories"] is None else self._array(k["categories"])
            kinds[c] = ColumnKind(cats, np.dtype(k["dtype"]))
        have = [str(c) for c in entry["have"]]
        return FileMeta(info, identity, keys, have, kinds)

    def _array(self, name: str) -> np.ndarray:
        held = self._arrays.get(name)
        if held is not None:
            return held
        digest, kind = name.split("-")
        where = os.path.join(self.folder, "arrays", name + ".npy")
        with open(where, "rb") as f:
            data = f.read()
        if hashlib.sha256(kind.encode() + data).hexdigest()[:40] != digest:
            with contextlib.suppress(OSError):
                os.unlink(where)  # written again by the next store
            raise ValueError(f"damaged cache array {name}")
        a = np.load(io.BytesIO(data), allow_pickle=False)
        if kind == "object":
            a = a.astype(object)
        a.flags.writeable = False
        self._arrays[name] = a
        return a

    def store(self, meta: FileMeta) -> None:
        """Writes the file's entry, if its identity is a local `stat`."""
        stat = meta.identity.stat
        path = meta.info.path
        if stat.etag or stat.content or stat.store or _local_stat(path) != stat:
            return
        if time.time_ns() - max(stat.mtime_ns, stat.ctime_ns) < QUIET_NS:
            return  # changed just now: a write within the same tick would hide
        try:
            entry = self._entry(meta)
            if entry is None:
                return
            # The first opens' layouts in the same file: one write per file.
            entry["layouts"] = meta.layouts
            name = entry_name(path, self.element, self.genes_from, stat)
            _write(self.folder, name, json.dumps(entry).encode())
        except OSError:  # a read-only or full cache: open the file next time
            return

    def _entry(self, meta: FileMeta) -> dict | None:
        info, identity = meta.info, meta.identity
        if not all(_plain_dtype(d) for d in (info.dtype, *_kind_dtypes(meta))):
            return None
        keys = self._save_array(meta.keys)
        kinds = {}
        for c, k in meta.kinds.items():
            cats = None
            if k.categories is not None:
                cats = self._save_array(k.categories)
                if cats is None:
                    return None
            kinds[c] = {"categories": cats, "dtype": k.dtype.str}
        if keys is None:
            return None
        return {
            "version": _VERSION,
            "path": info.path,
            "info": {
                "element": info.element,
                "encoding": info.encoding,
                "n_obs": info.n_obs,
                "n_vars": info.n_vars,
                "dtype": info.dtype.str,
                "nnz": info.nnz,
                "chunk_bytes": info.chunk_bytes,
            },
            "identity": {
                "element": identity.element,
                "stat": [getattr(identity.stat, f) for f in _STAT],
                "layout": identity.layout,
                "sample": identity.sample,
                "format": identity.format,
            },
            "keys": keys,
            "have": list(meta.have),
            "kinds": kinds,
        }

    def _save_array(self, a: np.ndarray) -> str | None:
        """The array's name, written if new; None if it cannot round-trip."""
        a = np.asarray(a)
        hit = self._by_id.get(id(a))
        if hit is not None and hit[0] is a:
            return hit[1]
        if a.dtype == object:
            values = a.tolist()  # equal values of other types are not one array
            content = (a.shape, tuple(values), frozenset(map(type, values)))
        else:
            content = (a.dtype.str, a.shape, a.tobytes())
        if content not in self._names:
            self._names[content] = self._save_new(a)
        if not a.flags.writeable:  # its content cannot change under this id
            self._by_id[id(a)] = (a, self._names[content])
        return self._names[content]

    def _save_new(self, a: np.ndarray) -> str | None:
        if a.dtype == object:
            values = a.tolist()
            # 'U' arrays drop trailing NULs: such strings are not cached.
            if not all(type(v) is str and not v.endswith("\0") for v in values):
                return None
            kind, plain = "object", np.array(values, dtype=str).reshape(a.shape)
        elif a.dtype.kind in "iufbUS" and a.dtype.isnative:
            kind, plain = "plain", a
        else:
            return None
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(plain), allow_pickle=False)
        data = buf.getvalue()
        name = f"{hashlib.sha256(kind.encode() + data).hexdigest()[:40]}-{kind}"
        if name not in self._arrays:
            try:
                self._array(name)  # there and whole (a damaged one is removed)
            except (OSError, ValueError):
                _write(os.path.join(self.folder, "arrays"), name + ".npy", data)
                self._arrays[name] = a
        return name


def inspect_file(
    path: str, element: str, obs_names, genes_from, storage_options
) -> FileMeta:
    """Opens one file to take what a source needs of it (`FileSet.inspect`)."""
    _read_ahead(path)
    # Nodes and attributes asked for again come from memory (`remembered`),
    # from the open's own checks (`check_anndata`) on.
    with _nodes.remembered(), open_file(path, storage_options) as f:
        info = _h5ad.inspect_matrix(f, element)
        stat = _nodes.stat_of(f, path)
        # Each node is looked up once for the identity and the layouts.
        matrix = matrix_nodes(f, info.element)
        identity = FileIdentity.take(f, path, info.element, stat, matrix)
        keys = read_gene_keys(f, element, genes_from)
        have = _h5ad.obs_columns(f)
        columns: dict = {}
        kinds = ColumnKind.read(f, [c for c in obs_names if c in have], have, columns)
        layouts = _layout_cache.take(
            f, formats.for_path(path), path, info, stat, kinds, (matrix, columns)
        )
    return FileMeta(info, identity, keys, list(have), kinds, layouts)


def _read_ahead(path: str) -> None:
    """Asks the page cache for all of a small local file at once (async).

    Its inspection reads metadata spread over the file: from a cold cache,
    about a hundred small reads that each wait for their own disk request
    cost more CPU than reading the file in a few large ones (a 684 KB thin
    file, issue 33). Larger files and URLs are left to their reads.
    """
    if "://" in path:
        return
    try:
        reader = LocalByteReader.open(path)
    except OSError:  # the format's open says why
        return
    try:
        size = os.fstat(reader.fd).st_size
        if 0 < size <= READ_AHEAD_BYTES:
            reader.advise([0], [size])
    except OSError:
        pass
    finally:
        reader.close()


def _kind_dtypes(meta: FileMeta):
    return [k.dtype for k in meta.kinds.values()]


def _plain_dtype(d: np.dtype) -> bool:
    """A dtype that its `.str` names exactly (no objects, fields or metadata)."""
    return not d.hasobject and d.fields is None and np.dtype(d.str) == d


def _write(folder: str, name: str, data: bytes) -> None:
    write_atomic(os.path.join(folder, name), lambda out: out.write(data))


__all__ = ["FileMeta", "MetaCache", "cache_dir", "inspect_file"]

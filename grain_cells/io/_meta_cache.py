"""What a build takes of each file, cached by the file's stat: one JSON per file.

An entry holds a file's matrix summary, identity, gene keys, obs kinds and
(local, uncompressed) byte layouts: a later build takes one `stat` and one small
read per file, a first open no format library. In `$GRAIN_CELLS_CACHE/file-meta/`;
anything unreadable or stale is a miss. Delete the folder any time.

Design notes: docs/reference/design.md#io-meta-cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import stat as stat_mod
import sys
import time
import types

import numpy as np

from grain_cells import formats
from grain_cells._util.cache_files import cache_root, write_atomic, write_new
from grain_cells.formats import ByteLayout, PositionalReader
from grain_cells.io import _h5ad, _nodes
from grain_cells.io._frames import obs_columns
from grain_cells.io._genes import read_gene_keys
from grain_cells.io._h5ad import MatrixInfo, open_file
from grain_cells.io._identity import FileIdentity, matrix_nodes
from grain_cells.io._obs import ColumnKind, ObsColumn
from grain_cells.storage import FileStat, LocalByteReader

# v4: one entry format, layouts inside it as lists (no version of their own).
VERSION = "file-meta-v4"
STAT_FIELDS = ("dev", "ino", "size", "mtime_ns", "ctime_ns")
# A file changed less than this long ago is not cached (a write within the
# same tick would not change its stat).
QUIET_NS = 2_000_000_000
# A local file up to this size is asked ahead whole before it is inspected.
READ_AHEAD_BYTES = 2 << 20
_ERRORS = (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError)


def cache_dir() -> str:
    """The folder of entries: never the folder of the data."""
    return os.path.join(cache_root(), "file-meta")


def entry_name(path: str, element: str, genes_from, stat: FileStat) -> str:
    """The entry's file name: a digest of the version, file, element, key, stat."""
    parts = [VERSION, path, element, genes_from, _stat_list(stat)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:40] + ".json"


@dataclasses.dataclass(slots=True)
class FileMeta:
    """What `FileSet.inspect` takes of one file; `kinds`: the present columns read."""

    info: MatrixInfo
    identity: FileIdentity
    keys: np.ndarray
    have: list[str]
    kinds: dict[str, ColumnKind]
    layouts: dict | None = None  # JSON of the matrix's and obs's byte layouts


class MetaCache:
    """Entries of one build; arrays (gene keys, categories) read and written once."""

    def __init__(self, element: str, genes_from: str | None):
        self.element = element
        self.genes_from = genes_from
        self.folder = cache_dir()
        self._arrays: dict[str, np.ndarray] = {}
        # Names of arrays this build stored, by content and by the identity
        # of read-only arrays met before (files mostly share their genes).
        self._names: dict[tuple, str | None] = {}
        self._by_id: dict[int, tuple] = {}

    def lookup(self, path: str, obs_names, stat=None) -> FileMeta | None:
        """The file's entry if the file is unchanged and it has every column.

        `stat`: an object's or store's version (`version_of`), asked by the caller.
        """
        stat = _local_stat(path) if stat is None else stat
        if stat is None:
            return None
        try:
            e = _read_entry(path, self.element, self.genes_from, stat)
            if e is None or e["identity"][1] != _stat_list(stat):
                return None
            i, d = e["info"], e["identity"]
            # Names every file repeats: one object each (in memory and pickles).
            element, encoding = sys.intern(i[0]), sys.intern(i[1])
            info = MatrixInfo(path, element, encoding, *i[2:4], np.dtype(i[4]), *i[5:7])
            fmt = d[4] if d[4] is None else sys.intern(d[4])
            identity = FileIdentity(path, element, stat, d[2], d[3], fmt)
            kinds = {}
            for c, (cats, dtype) in e["kinds"].items():
                cats = None if cats is None else self._array(cats)
                kinds[c] = ColumnKind(cats, np.dtype(dtype))
            keys = self._array(e["keys"])
            meta = FileMeta(info, identity, keys, e["have"], kinds, e["layouts"])
        except _ERRORS:
            return None
        if any(c in meta.have and c not in meta.kinds for c in obs_names):
            return None
        return meta

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

    def store(self, meta: FileMeta) -> bool:
        """Writes the file's entry, if its identity is a quiet local `stat` or a
        remote version (an ETag, content digest or store listing); False if not.
        """  # noqa: D205
        stat, info = meta.identity.stat, meta.info
        if "://" in info.path:
            if not versioned(stat):
                return False
        elif not meta.identity.local or _local_stat(info.path) != stat:
            return False
        elif time.time_ns() - max(stat.mtime_ns, stat.ctime_ns) < QUIET_NS:
            return False  # changed just now: a write within the same tick would hide
        dtypes = [info.dtype, *(k.dtype for k in meta.kinds.values())]
        if not all(map(_plain_dtype, dtypes)):
            return False
        try:
            kinds = {}
            for c, k in meta.kinds.items():
                cats = None if k.categories is None else self._save_array(k.categories)
                kinds[c] = [cats, k.dtype.str]
            d = meta.identity
            i = [info.element, info.encoding, info.n_obs, info.n_vars]
            i += [info.dtype.str, info.nnz, info.chunk_bytes]
            entry = {
                "version": VERSION,
                "path": info.path,
                "info": i,
                "identity": [d.element, _stat_list(stat), d.layout, d.sample, d.format],
                "keys": self._save_array(meta.keys),
                "have": list(meta.have),
                "kinds": kinds,
                "layouts": meta.layouts,
            }
            name = entry_name(info.path, self.element, self.genes_from, stat)
            data = json.dumps(entry).encode()
            write_new(os.path.join(self.folder, name), data)
        except (OSError, ValueError):  # a read-only or full cache, or arrays that
            return False  # do not round-trip: open the file next time
        return True

    def _save_array(self, a: np.ndarray) -> str:
        """The array's name, written if new; ValueError if it cannot round-trip."""
        a = np.asarray(a)
        hit = self._by_id.get(id(a))
        if hit is not None and hit[0] is a and hit[1] is not None:
            return hit[1]  # (None: raised below again)
        if a.dtype == object:
            values = a.tolist()  # equal values of other types are not one array
            content = (a.shape, tuple(values), frozenset(map(type, values)))
        else:
            content = (a.dtype.str, a.shape, a.tobytes())
        if content not in self._names:
            self._names[content] = self._save_new(a)
        name = self._names[content]
        if not a.flags.writeable:  # its content cannot change under this id
            self._by_id[id(a)] = (a, name)
        if name is None:
            raise ValueError("an array that does not round-trip through .npy")
        return name

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
                where = os.path.join(self.folder, "arrays", name + ".npy")
                write_atomic(where, lambda out: out.write(data))
                self._arrays[name] = a
        return name


def inspect_file(
    path: str, element: str, obs_names, genes_from, storage_options, stat=None
) -> FileMeta:
    """Opens one file to take what a source needs of it (`FileSet.inspect`).

    `stat`: the version to open (None: the one there now).
    """
    fd = _read_ahead(path, storage_options)  # byte layouts are taken on it too
    try:
        # Nodes and attributes asked for again come from memory.
        with _nodes.remembered(), open_file(path, storage_options, stat) as f:
            info = _h5ad.inspect_matrix(f, element)
            stat = _nodes.format_of(f).stat_of(f, path)
            matrix = matrix_nodes(f, info.element)  # once for identity and layouts
            identity = FileIdentity.take(f, path, info.element, stat, matrix)
            keys = read_gene_keys(f, element, genes_from)
            have = obs_columns(f)
            columns: dict = {}
            kinds = ColumnKind.read(
                f, [c for c in obs_names if c in have], have, columns
            )
            layouts = None
            # The layouts are taken over `fd`: only when it reads this very file
            # (an object's reads are of the version `stat` inspected, as `f`'s).
            if identity.is_object:
                fd = _nodes.format_of(f).open_bytes(f, path, storage_options, stat)
            same = fd is not None and (
                identity.is_object or not stat.changes(fd.stat())
            )
            if same and (identity.local or identity.is_object):
                with contextlib.suppress(Exception):  # only a shortcut
                    layouts = _take_layouts(f, fd, info, kinds, matrix, columns)
            # An object's metadata read so far is saved for the next open: the
            # process holds it only while a file of it is open.
            _nodes.format_of(f).opened(f)
    finally:
        if fd is not None:
            fd.close()
    return FileMeta(info, identity, keys, list(have), kinds, layouts)


def _read_ahead(path: str, storage_options) -> LocalByteReader | None:
    """A local file's `ByteReader` (a small file asked ahead whole, async), or None."""
    if "://" in path:
        return None
    try:
        reader = formats.for_path(path).open_bytes(None, path, storage_options, None)
        if isinstance(reader, LocalByteReader):
            size = os.fstat(reader.fd).st_size
            if 0 < size <= READ_AHEAD_BYTES:
                reader.advise([0], [size])
    except OSError:  # the format's open says why
        return None
    return reader


def _take_layouts(f, fd, info, kinds, matrix, columns) -> dict | None:
    """The matrix's and obs columns' byte layouts as JSON; None if not positional."""
    fmt, path = _nodes.format_of(f), info.path
    # A source's matrix: a CSR's three arrays, or one dense array ("x").
    found = {k or "x": fmt.byte_layout(a, path, fd) for k, a in matrix[1].items()}
    if None in found.values():
        return None
    out = {"matrix": {k: _layout_json(v) for k, v in found.items()}, "obs": {}}
    for c, kind in kinds.items():
        array = columns.get(c)  # None: read whole, only its format reads it
        layout = None if array is None else fmt.byte_layout(array, path, fd)
        if layout is None or len(layout.shape) != 1:
            return None
        n_cat = None if kind.categories is None else len(kind.categories)
        out["obs"][c] = [_layout_json(layout), np.dtype(kind.dtype).str, n_cat]
    values = [*out["matrix"].values(), *(v[0] for v in out["obs"].values())]
    return None if None in values else out


def layouts_of(reader, fd, identity) -> dict[str, ByteLayout] | None:
    """A reader's arrays' byte layouts when all are positional over `fd`.

    An object whose ETag does not follow its content has its sampled bytes
    read again, where due, before each open from them (`check_content`).
    """
    if fd is None or not (identity.local or identity.is_object):
        return None
    out = {k: getattr(a, "byte_layout", None) for k, a in reader.arrays.items()}
    return None if None in out.values() else out


def entry_of(files, i: int, fd) -> tuple[dict, dict] | None:
    """`(obs, layouts)` of file `i` from its entry over its checked `fd`, or None."""
    info = files.infos[i]
    try:
        e = _read_entry(info.path, files.element, files.genes.genes_from, fd.stat())
        layouts = {k: _layout(v) for k, v in e["layouts"]["matrix"].items()}
        wanted = [c for c in files.obs_names if files.obs[c].present[i]]
        pins = [
            layouts.get("indptr"),
            *(_layout(e["layouts"]["obs"][c][0]) for c in wanted),
        ]
    except _ERRORS:
        return None
    if fd.remote:  # in one batch of GETs; a failing store raises (not a miss)
        _pin([p for p in pins if p is not None], info.path, fd)
    try:
        obs = {}
        for c in files.obs_names:
            column, d = files.obs[c], e["layouts"]["obs"].get(c)
            values = _read_column(d, info, fd) if c in wanted else None
            obs[c] = column.file_values(i, values, info.n_obs)
    except _ERRORS:
        return None
    return obs, layouts


def _pin(layouts: list[ByteLayout], path: str, fd) -> None:
    """Pins every chunk of these arrays through `fd` in one call (errors named)."""
    offsets, nbytes = [], []
    for layout in layouts:
        o, n = PositionalReader(layout, path, fd).pin_pieces()
        offsets, nbytes = offsets + o, nbytes + n
    names = types.SimpleNamespace(name=", ".join(x.name for x in layouts), path=path)
    with formats.naming_errors(names):
        fd.pin(offsets, nbytes)


def _read_column(d: list, info, fd) -> ObsColumn:
    """A column for `HarmonisedColumn.file_values` (its codes or values; ValueError)."""
    layout = _layout(d[0])
    n = layout.shape[0]
    if n != info.n_obs:
        raise ValueError(f"{n} obs values, expected {info.n_obs}")
    out = np.empty(n, layout.dtype)
    if n:
        PositionalReader(layout, info.path, fd).read(np.array([0]), np.array([n]), out)
    if d[2] is None:
        return ObsColumn(out.astype(np.dtype(d[1]), copy=False), None)
    if n and (int(out.max()) >= d[2] or int(out.min()) < -1):
        raise ValueError("codes out of range")  # the format's reader reports them
    return ObsColumn(out, None)


def _read_entry(path, element, genes_from, stat) -> dict | None:
    name = entry_name(path, element, genes_from, stat)
    with open(os.path.join(cache_dir(), name), "rb") as f:
        entry = json.loads(f.read())
    ok = entry.get("version") == VERSION and entry.get("path") == path
    return entry if ok else None


def _layout_json(layout: ByteLayout) -> list | None:
    if not _plain_dtype(layout.dtype):
        return None
    out = [layout.name, layout.dtype.str, list(layout.shape), int(layout.chunk_rows)]
    return [*out, layout.offsets.tolist(), layout.chunk_length]


def _layout(d: list) -> ByteLayout:
    name, dtype, shape, rows, offsets, length = d
    offsets = np.array(offsets, np.int64)
    return ByteLayout(name, np.dtype(dtype), tuple(shape), rows, offsets, length)


def _local_stat(path: str) -> FileStat | None:
    """A local regular file's stat, or None (URLs, stores, missing files)."""
    if "://" in path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStat.of(st) if stat_mod.S_ISREG(st.st_mode) else None


def versioned(stat: FileStat) -> bool:
    """Whether a remote `stat` names one version of the bytes (else: no entry)."""
    return bool(stat.etag or stat.content or stat.store)


def _stat_list(stat: FileStat) -> list:
    out = [getattr(stat, f) for f in STAT_FIELDS]
    return [*out, stat.etag, stat.content, stat.store] if versioned(stat) else out


def _plain_dtype(d: np.dtype) -> bool:
    """A dtype that its `.str` names exactly (no objects, fields or metadata)."""
    return not d.hasobject and d.fields is None and np.dtype(d.str) == d

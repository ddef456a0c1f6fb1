"""`.h5ad` files as a `formats.Format`: h5py's nodes, HDF5's low-level calls.

Asked last: it claims every path no other format claims. Checks that HDF5
returns a dataset's true values (links, virtual sources, filters). Design
notes: docs/reference/design.md#hdf5-format, #hdf5-layout.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import h5py
import numpy as np

from grain_cells import errors, formats
from grain_cells.hdf5 import _open, _reads
from grain_cells.hdf5._reads import byte_layout, range_reader
from grain_cells.storage import FileStat, LocalByteReader
from grain_cells.storage.remote import RemoteByteReader, is_url, version_of

# Chunks located (evenly spaced) for a chunked dataset's layout digest.
_CHUNK_SAMPLES = 17
_MTYPES: dict = {}  # memory types (`_mtype`): ~17 us each to make
# Decoded string lists by their bytes (`strings`): decoding costs half as much
# as reading them.
_DECODED: dict = {}
_DECODED_MAX = 1 << 17  # strings held in all (a 62,710-gene list and categories)


class Hdf5Format(formats.Format):
    """HDF5 (`.h5ad`) files, local or by URL; nodes are h5py's own."""

    name = "hdf5"
    description = "HDF5"
    fallback = True

    def can_open(self, path: str) -> bool:
        return True  # every path no other format claims

    def open(self, path, storage_options=None, stat=None) -> h5py.File:
        return _open.open_h5(path, storage_options, stat)

    def stat_path(self, path, storage_options=None) -> FileStat:
        if is_url(path):
            return version_of(path, storage_options)
        return FileStat.of(os.stat(path))

    def stat_of(self, f, path) -> FileStat:
        """An object's version read; else `fstat` of HDF5's descriptor."""
        if (rf := _open.range_files.get(f)) is not None:
            return rf.stat
        try:
            fd = f.id.get_vfd_handle()
        except Exception:  # a driver without a POSIX descriptor
            fd = None
        if isinstance(fd, int) and fd >= 0:
            with contextlib.suppress(OSError):
                return FileStat.of(os.fstat(fd))
        return FileStat.of(os.stat(path))

    def file_name(self, f) -> str:
        rf = _open.range_files.get(f)  # h5py's `filename` is ASCII-squeezed
        return rf.url if rf is not None else f.filename

    def owns(self, node) -> bool:
        return isinstance(node, (h5py.Group, h5py.Dataset))

    def is_group(self, node) -> bool:
        return isinstance(node, h5py.Group)

    def is_array(self, node) -> bool:
        return isinstance(node, h5py.Dataset)

    def child(self, group, name: str):
        """`group.get(name)`; read-only from the parent, not an `h5py.File` of it."""
        try:
            oid = h5py.h5o.open(group.id, name.encode("utf-8"))
        except KeyError:
            return None
        kind = h5py.h5i.get_type(oid)
        if kind == h5py.h5i.GROUP:
            node = h5py.Group(oid)
        elif kind == h5py.h5i.DATASET:
            read_only = _reads.handle(group) is not None  # `open_h5` opens "r"
            if not read_only:
                fid = h5py.h5i.get_file_id(oid)
                read_only = fid.get_intent() == h5py.h5f.ACC_RDONLY
            node = h5py.Dataset(oid, readonly=read_only)
        else:
            return group.get(name)
        _reads.inherit(group, node)
        return node

    def is_string_array(self, node) -> bool:
        return h5py.check_string_dtype(node.dtype) is not None

    def attr(self, node, name: str, default=None):
        """`node.attrs.get`; variable-length strings and numbers read directly."""
        oid, key = node.id, name.encode("utf-8")
        try:
            attr = h5py.h5a.open(oid, key)
        except KeyError:  # no such attribute
            return default
        space = attr.get_space()
        kind = space.get_simple_extent_type()
        if kind not in (h5py.h5s.SCALAR, h5py.h5s.SIMPLE):
            return node.attrs.get(name, default)
        tid = attr.get_type()
        cls = tid.get_class()
        if cls == h5py.h5t.STRING and tid.is_variable_str():
            dtype = tid.dtype  # read as bytes, decoded as h5py decodes them
            out = np.zeros(space.get_simple_extent_dims(), dtype=dtype)
            attr.read(out, mtype=_mtype(dtype))
            text = [b.decode("utf-8", "surrogateescape") for b in out.flat]
            if kind == h5py.h5s.SCALAR:
                return text[0]
            return np.array(text, dtype=dtype).reshape(out.shape)
        if cls in (h5py.h5t.INTEGER, h5py.h5t.FLOAT):
            dtype = tid.dtype
            if dtype.subdtype is None and dtype.kind in "iuf":
                out = np.zeros(space.get_simple_extent_dims(), dtype=dtype)
                attr.read(out, mtype=_mtype(dtype))
                return out[()] if out.ndim == 0 else out
        return node.attrs.get(name, default)

    def strings(self, node) -> np.ndarray:
        """Read-only: a list equal to one read before in the process is that array."""
        dtype = node.dtype
        info = h5py.check_string_dtype(dtype)
        shape = node.shape
        if info.length is not None or not shape or not node.size:
            return np.asarray(node.asstr()[()], dtype=object)
        # What `node[()]` reads, without h5py's selection wrapping. (HDF5's own
        # conversion to fixed-width strings leaks ~300 KB per 2,000 names.)
        raw = np.empty(shape, dtype=dtype)
        node.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=_mtype(dtype))
        key = (info.encoding, shape, tuple(raw.reshape(-1).tolist()))
        held = _DECODED.get(key)
        if held is None:
            held = np.array([b.decode(info.encoding) for b in key[2]], dtype=object)
            held = held.reshape(shape)
            held.flags.writeable = False
            if sum(v.size for v in _DECODED.values()) + held.size > _DECODED_MAX:
                _DECODED.clear()
            _DECODED[key] = held
        return held

    def read(self, array, index, path: str, rows: tuple[int, int]) -> np.ndarray:
        """`array[index]`; sorted distinct indices in one selection."""
        shape = array.shape  # h5py selects an index array's points one at a time
        one_d = shape is not None and len(shape) == 1 and array.dtype.kind in "biuf"
        if one_d and (points := _reads.sorted_points(index, shape[0])) is not None:
            space = array.id.get_space()
            space.select_elements(points.astype(np.uint64).reshape(-1, 1))
            out = np.empty(points.size, dtype=array.dtype)
            array.id.read(h5py.h5s.create_simple((points.size,)), space, out)
            return out
        return np.asarray(array[index])

    def element_problem(self, node, element: str) -> str | None:
        if not isinstance(node, h5py.Group):
            return None
        f = node if isinstance(node, h5py.File) else node.file
        return link_problem(f, element)

    def check_array(self, path: str, dataset) -> None:
        """Refuses a virtual dataset missing a source (`CorruptDataError`), a filter."""
        for source in dataset.virtual_sources() if dataset.is_virtual else ():
            name, inner = source.file_name, source.dset_name
            if name == ".":
                ok = inner in dataset.file
                where = f"dataset {inner} of the same file"
            else:
                found, ok = _find(dataset.file.filename, name), False
                with contextlib.suppress(OSError):
                    if found is not None:
                        with h5py.File(found, "r") as g:
                            ok = isinstance(g.get(inner), h5py.Dataset)
                where = f"dataset {inner} of {name}"
            if not ok:
                raise errors.CorruptDataError(
                    f"{path}: {dataset.name.lstrip('/')} is a virtual dataset whose "
                    f"source ({where}) is missing; HDF5 would read that part as "
                    "fill values (zeros). Restore the source file, or rebuild the "
                    "file with its data copied in."
                )
        check_filters(path, dataset)

    def chunk_bytes(self, array) -> int | None:
        if array.chunks is None or _reads.create_plist(array.id).get_nfilters() == 0:
            return None
        return int(np.prod(array.chunks, dtype=np.int64)) * array.dtype.itemsize

    def open_bytes(self, f, path, storage_options, stat):
        if is_url(path):
            return RemoteByteReader(path, storage_options, stat)
        return LocalByteReader.open(path)

    def opened(self, f) -> None:
        if (rf := _open.range_files.get(f)) is not None:
            rf.opened()

    def range_reader(self, array, path, fd, *, cache_bytes=0, fill_missing=False):
        del fill_missing  # HDF5 has no unwritten chunks here
        check_filters(path, array)
        return range_reader(array, path, fd, cache_bytes=cache_bytes)

    def byte_layout(self, array, path, fd):
        return byte_layout(array, path) if fd is not None else None

    def recorded_format(self) -> None:
        return None  # `.h5ad` identities record no format (states saved before)

    def array_layout(self, ds) -> list:
        """HDF5 address, shape, dtype, layout, filters and sampled chunk offsets."""
        plist = _reads.create_plist(ds.id)
        layout = plist.get_layout()
        filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
        chunks = plist.get_chunk() if layout == h5py.h5d.CHUNKED else None
        addr = h5py.h5o.get_info(ds.id).addr
        out = [ds.name, addr, ds.shape, ds.dtype.str, chunks, int(layout), filters]
        if layout == h5py.h5d.CONTIGUOUS:
            out.append(ds.id.get_offset())
        elif layout == h5py.h5d.VIRTUAL:
            count = plist.get_virtual_count()
            out.append(
                [
                    (plist.get_virtual_filename(i), plist.get_virtual_dsetname(i))
                    for i in range(count)
                ]
            )
        elif layout == h5py.h5d.CHUNKED and ds.shape and ds.shape[0]:
            n_chunks = -(-ds.shape[0] // chunks[0])
            picks = np.linspace(0, n_chunks - 1, _CHUNK_SAMPLES).astype(int)
            if n_chunks <= 4 * _CHUNK_SAMPLES:  # one walk of the index, `byte_layout`'s
                table = _reads.row_chunks(ds.id, chunks[0], ds.shape[0])
                at = [tuple(int(a[k]) for a in table) for k in np.unique(picks)]
                out += [None if t[0] < 0 else t for t in at]
                return out
            for k in np.unique(picks).tolist():
                coord = (k * chunks[0],) + (0,) * (len(ds.shape) - 1)
                try:
                    info = ds.id.get_chunk_info_by_coord(coord)
                except Exception:  # a chunk never written
                    info = None
                # An unwritten chunk's StoreInfo has no offset and an
                # uninitialised filter mask (differs between processes).
                unwritten = info is None or info.byte_offset is None
                out.append(
                    None
                    if unwritten
                    else (info.byte_offset, info.size, info.filter_mask)
                )
        return out


def _mtype(dtype: np.dtype):
    """`h5py.h5t.py_create(dtype)`, made once per dtype and h5py's metadata."""
    key = (dtype.str, repr(dtype.metadata))  # (text, enums: metadata)
    made = _MTYPES.get(key)
    if made is None:
        made = _MTYPES[key] = h5py.h5t.py_create(dtype)
    return made


# Registered HDF5 filter ids (https://github.com/HDFGroup/hdf5_plugins) that
# hdf5plugin provides, for error messages.
_PLUGIN_FILTERS = {
    307: "bzip2",
    32001: "blosc",
    32004: "lz4",
    32008: "bitshuffle",
    32013: "zfp",
    32015: "zstd",
    32017: "sz",
    32018: "fcidecomp",
    32024: "sz3",
    32026: "blosc2",
}


def link_problem(f: h5py.File, element: str) -> str | None:
    """Why `element` does not resolve when a link on its path dangles, else None."""
    node = f
    parts = [p for p in element.split("/") if p]
    for depth, part in enumerate(parts):
        name = "/".join(parts[: depth + 1])
        # A link can exist while what it points to does not: ask for the link.
        link = node.get(part, getlink=True) if isinstance(node, h5py.Group) else None
        if link is None:
            return None
        if isinstance(link, h5py.ExternalLink):
            target = link.filename
            where = (
                target
                if os.path.isabs(target)
                else f"{target} (relative to {os.path.dirname(f.filename) or '.'} "
                "or the working directory)"
            )
            if _find(f.filename, target) is None:
                return (
                    f"{name} is an external link to {link.path} in {where}, and "
                    "that file does not exist. Restore it, or rewrite the link "
                    "(h5py: `del f[name]; f[name] = h5py.ExternalLink(file, path)`)"
                )
        try:
            node = node[part]
        except (KeyError, OSError, RuntimeError) as e:
            if isinstance(link, h5py.ExternalLink):
                return (
                    f"{name} is an external link to {link.path} in {where}, which "
                    f"cannot be opened there ({e})"
                )
            if not isinstance(link, h5py.SoftLink):
                raise
            return (
                f"{name} is a soft link to {link.path}, which does not exist "
                "in this file (or the links form a loop)"
            )
    return None


def _find(linking_file: str, name: str) -> str | None:
    """The file a link names: beside the linking file, else as given."""
    base = os.path.dirname(os.path.abspath(linking_file))
    candidates = [name] if os.path.isabs(name) else [os.path.join(base, name), name]
    return next((c for c in candidates if os.path.exists(c)), None)


def check_filters(path: str, dataset: h5py.Dataset) -> None:
    """`UnsupportedLayoutError` for a filter HDF5 lacks (after importing hdf5plugin)."""
    plist = _reads.create_plist(dataset.id)
    for i in range(plist.get_nfilters()):
        code, _, _, name = plist.get_filter(i)
        if h5py.h5z.filter_avail(code):
            continue
        try:
            plugin = importlib.import_module("hdf5plugin")
        except ImportError:
            plugin = None
        if h5py.h5z.filter_avail(code):
            continue
        label = _PLUGIN_FILTERS.get(code) or (
            name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        )
        if plugin is None and code in _PLUGIN_FILTERS:
            fix = "Install hdf5plugin (`pip install hdf5plugin`), which provides it."
        elif plugin is None:
            fix = (
                "Install the HDF5 plugin that provides it (hdf5plugin covers the "
                "common ones: `pip install hdf5plugin`)."
            )
        else:
            fix = (
                f"hdf5plugin {plugin.version} is installed but does not provide "
                "it; install an HDF5 plugin that does (HDF5_PLUGIN_PATH)."
            )
        raise errors.UnsupportedLayoutError(
            f"{path}: {dataset.name.lstrip('/')} is compressed with HDF5 filter {code} "
            f"({label}), which is not available to this HDF5. {fix}"
        )


HDF5 = formats.register(Hdf5Format())

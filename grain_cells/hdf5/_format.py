"""`.h5ad` files as a `grain_cells.formats.Format` (HDF5 through h5py).

Node kinds and strings, storage checks and chunk sizes, the per-process
byte reader and remote metadata cache, and what locates a dataset's bytes
for the layout digest (saved states compare it). Registered on import of
`grain_cells.hdf5`, asked last: it claims every path no other format claims,
and refuses what is not HDF5 by name.

Design notes: docs/reference/design.md#hdf5-format.
"""

from __future__ import annotations

import h5py
import numpy as np

from grain_cells import formats
from grain_cells.hdf5 import _handles, _layout, _remote
from grain_cells.hdf5._open import open_h5
from grain_cells.hdf5._reads import RangeReader, byte_layout, read_positional
from grain_cells.storage import FileStat

# Chunks located (evenly spaced) for a chunked dataset's layout digest.
_CHUNK_SAMPLES = 17


class Hdf5Format(formats.Format):
    """HDF5 (`.h5ad`) files, local or by URL; nodes are h5py's own."""

    name = "hdf5"
    description = "HDF5"
    fallback = True

    def can_open(self, path: str) -> bool:
        """True: every path no other format claims is opened as HDF5."""
        return True

    def open(self, path, storage_options=None, stat=None) -> h5py.File:
        """See `grain_cells.hdf5._open.open_h5`."""
        return open_h5(path, storage_options, stat)

    def stat_path(self, path, storage_options=None) -> FileStat:
        """`os.stat`, or one HEAD of an object."""
        return _remote.stat_path(path, storage_options)

    def stat_of(self, f, path) -> FileStat:
        """`fstat` of HDF5's descriptor; an object's version without a request."""
        return _remote.stat_of(f, path)

    def file_name(self, f) -> str:
        """The path or URL (h5py names a remote file by an ASCII repr)."""
        return _remote.file_name(f)

    def owns(self, node) -> bool:
        """h5py files, groups and datasets."""
        return isinstance(node, (h5py.Group, h5py.Dataset))

    def is_group(self, node) -> bool:
        """An h5py group (a file is one)."""
        return isinstance(node, h5py.Group)

    def is_array(self, node) -> bool:
        """An h5py dataset."""
        return isinstance(node, h5py.Dataset)

    def child(self, group, name: str):
        """`group.get(name)` through HDF5's own calls (`_child`)."""
        return _child(group, name)

    def is_string_array(self, node) -> bool:
        """HDF5 variable- or fixed-length strings."""
        return h5py.check_string_dtype(node.dtype) is not None

    def attr(self, node, name: str, default=None):
        """As `node.attrs.get` gives it (`_attr`: numbers and text, directly)."""
        return _attr(node, name, default)

    def strings(self, node) -> np.ndarray:
        """Decoded as h5py's `asstr` decodes them (`_strings`; read-only)."""
        return _strings(node)

    def read(self, array, index, path: str, rows: tuple[int, int]) -> np.ndarray:
        """`array[index]`: positional where it can (`_reads.read_positional`).

        Else sorted distinct indices in one selection (`_points`), else h5py.
        """
        out = read_positional(array, index, path)
        if out is not None:
            return out
        if isinstance(index, np.ndarray):
            out = _points(array, index)
            if out is not None:
                return out
        return np.asarray(array[index])

    def element_problem(self, node, element: str) -> str | None:
        """A dangling soft or external link on `element`'s path (`_layout`)."""
        if not isinstance(node, h5py.Group):
            return None
        f = node if isinstance(node, h5py.File) else node.file
        return _layout.link_problem(f, element)

    def check_array(self, path: str, array) -> None:
        """Links, virtual sources and filters (`_layout.check_dataset`)."""
        _layout.check_dataset(path, array)

    def chunk_bytes(self, array) -> int | None:
        """Decoded bytes of one chunk when the dataset has filters."""
        if array.chunks is None or _layout.create_plist(array.id).get_nfilters() == 0:
            return None
        return int(np.prod(array.chunks, dtype=np.int64)) * array.dtype.itemsize

    def open_bytes(self, f, path, storage_options, stat):
        """A local `ByteReader`, or range GETs of the object version `stat`."""
        return _remote.open_bytes(path, storage_options, stat)

    def opened(self, f) -> None:
        """Saves the remote metadata h5py read while opening (`_remote`)."""
        _remote.opened(f)

    def range_reader(self, array, path, fd, *, cache_bytes=0, fill_missing=False):
        """`grain_cells.hdf5._reads.RangeReader` (HDF5 has no unwritten chunks)."""
        del fill_missing
        return RangeReader(array, path, fd, cache_bytes=cache_bytes)

    def byte_layout(self, array, path, fd):
        """`_reads.byte_layout`: HDF5's own calls, no reader built."""
        return byte_layout(array, path) if fd is not None else None

    def recorded_format(self) -> None:
        """None: `.h5ad` identities record no format (states saved before)."""
        return None

    def array_layout(self, array) -> list:
        """HDF5 address, shape, dtype, layout, filters and sampled offsets."""
        return _storage(array)


# Decoded string lists by their bytes: a collection's files mostly repeat one
# gene list and the same categories (issue 33), and decoding them costs half
# as much as reading them.
_DECODED: dict = {}
_DECODED_MAX = 1 << 17  # strings held in all (a 62,710-gene list and categories)


def _strings(node) -> np.ndarray:
    """A string dataset as an object array of `str`, as `asstr()[()]` gives it.

    Read-only: a list equal to one read before in this process is that very
    array (a collection's files mostly repeat one gene list and the same
    categories), so callers that compare lists can compare them by identity.
    """
    dtype = node.dtype
    info = h5py.check_string_dtype(dtype)
    shape = node.shape
    if info.length is not None or not shape or not node.size:
        return np.asarray(node.asstr()[()], dtype=object)
    # What `node[()]` reads, without h5py's selection wrapping (most of the
    # cost of a short list: a file's categories). (HDF5's own conversion to
    # fixed-width strings would save a bytes object per string, but leaks
    # about 300 KB per read of 2,000 names in HDF5 2.0.)
    raw = np.empty(shape, dtype=dtype)
    node.id.read(h5py.h5s.ALL, h5py.h5s.ALL, raw, mtype=h5py.h5t.py_create(dtype))
    key = (info.encoding, shape, tuple(raw.reshape(-1).tolist()))
    held = _DECODED.get(key)
    if held is None:
        held = np.array(
            [b.decode(info.encoding) for b in key[2]], dtype=object
        ).reshape(shape)
        held.flags.writeable = False
        if sum(v.size for v in _DECODED.values()) + held.size > _DECODED_MAX:
            _DECODED.clear()
        _DECODED[key] = held
    return held


def _child(group, name: str):
    """`group.get(name)`: a group or dataset opened directly, else by h5py.

    h5py's lookup makes an `h5py.File` of the node's file for every dataset
    it opens (to ask whether it is read-only), half its cost; a build looks
    up about thirty nodes per file (issue 33). A node of a file `open_h5`
    opened takes the answer from its parent (`_handles`), others from HDF5.
    """
    try:
        oid = h5py.h5o.open(group.id, name.encode("utf-8"))
    except KeyError:
        return None
    kind = h5py.h5i.get_type(oid)
    if kind == h5py.h5i.GROUP:
        node = h5py.Group(oid)
    elif kind == h5py.h5i.DATASET:
        handle = _handles.of(group)
        if handle is None:
            fid = h5py.h5i.get_file_id(oid)
            read_only = fid.get_intent() == h5py.h5f.ACC_RDONLY
        else:
            read_only = handle.read_only
        node = h5py.Dataset(oid, readonly=read_only)
    else:
        return group.get(name)
    _handles.inherit(group, node)
    return node


def _points(ds, index: np.ndarray) -> np.ndarray | None:
    """`ds[index]` of a 1-D numeric dataset, as one point selection.

    h5py selects an index array's points one call at a time (65 `indptr`
    samples: 0.18 ms, against 0.05); None where the index is not sorted,
    distinct and in range (h5py's own read raises then).
    """
    shape = ds.shape
    if (
        index.ndim != 1
        or not index.size
        or index.dtype.kind not in "iu"
        or shape is None
        or len(shape) != 1
        or ds.dtype.kind not in "biuf"
    ):
        return None
    index = index.astype(np.int64, copy=False)
    if index[0] < 0 or index[-1] >= shape[0] or (np.diff(index) <= 0).any():
        return None
    space = ds.id.get_space()
    space.select_elements(index.astype(np.uint64).reshape(-1, 1))
    out = np.empty(index.size, dtype=ds.dtype)
    ds.id.read(h5py.h5s.create_simple((index.size,)), space, out)
    return out


_TEXT = h5py.string_dtype("utf-8")
_TEXT_TYPE = h5py.h5t.py_create(_TEXT)


def _attr(node, name: str, default=None):
    """`node.attrs.get(name, default)`, the common kinds read directly.

    Variable-length strings (a scalar, or an array as `column-order`) and
    a scalar or array of numbers are read as h5py's
    `AttributeManager.__getitem__` reads them, without its per-attribute
    wrapping (half its cost: a file's inspection reads about twenty
    attributes, issue 33); every other kind goes through h5py.
    """
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
        if kind == h5py.h5s.SCALAR:
            out = np.zeros((), dtype=_TEXT)
            attr.read(out, mtype=_TEXT_TYPE)
            return out[()].decode("utf-8", "surrogateescape")
        dtype = tid.dtype  # an array (`column-order`): h5py's own decoding
        out = np.zeros(space.get_simple_extent_dims(), dtype=dtype)
        attr.read(out, mtype=h5py.h5t.py_create(dtype))
        text = [b.decode("utf-8", "surrogateescape") for b in out.flat]
        return np.array(text, dtype=dtype).reshape(out.shape)
    if cls in (h5py.h5t.INTEGER, h5py.h5t.FLOAT):
        dtype = tid.dtype
        if dtype.subdtype is None and dtype.kind in "iuf":
            out = np.zeros(space.get_simple_extent_dims(), dtype=dtype)
            attr.read(out, mtype=h5py.h5t.py_create(dtype))
            return out[()] if out.ndim == 0 else out
    return node.attrs.get(name, default)


def _storage(ds) -> list:
    """What locates one dataset's bytes in the file (sampled for chunks)."""
    plist = _layout.create_plist(ds.id)
    layout = plist.get_layout()
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    chunks = plist.get_chunk() if layout == h5py.h5d.CHUNKED else None
    out = [
        ds.name,
        h5py.h5o.get_info(ds.id).addr,
        ds.shape,
        ds.dtype.str,
        chunks,
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
        n_chunks = -(-ds.shape[0] // chunks[0])
        picks = np.unique(np.linspace(0, n_chunks - 1, _CHUNK_SAMPLES).astype(int))
        written = _chunk_infos(ds, n_chunks)
        for k in picks.tolist():
            coord = (k * chunks[0],) + (0,) * (len(ds.shape) - 1)
            info = None if written is None else written.get(coord)
            if info is None:  # many chunks, or one never written: HDF5 says
                try:
                    info = ds.id.get_chunk_info_by_coord(coord)
                except Exception:  # a chunk never written
                    info = None
            # An unwritten chunk's StoreInfo has no offset and an
            # uninitialised filter mask (differs between processes).
            unwritten = info is None or info.byte_offset is None
            out.append(
                None if unwritten else (info.byte_offset, info.size, info.filter_mask)
            )
    return out


def _chunk_infos(ds, n_chunks: int) -> dict | None:
    """Each written chunk's `StoreInfo` by its first coordinate, when few.

    One walk of the chunk index instead of a lookup per sampled chunk (a
    thin file's arrays have a few chunks each, issue 33); None for many
    chunks (the sampled lookups then). The walk gives what the lookup of a
    written chunk gives.
    """
    if n_chunks > 4 * _CHUNK_SAMPLES:
        return None
    found: dict = {}
    ds.id.chunk_iter(lambda info: found.__setitem__(tuple(info.chunk_offset), info))
    return found


HDF5 = formats.register(Hdf5Format())

__all__ = ["HDF5", "Hdf5Format"]

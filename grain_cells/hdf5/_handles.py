"""What an open file's nodes share: read-only or not, and the file's descriptor.

h5py asks an `h5py.File` of a dataset's file whether it is read-only each
time it opens one (half of `Group.get`); a build opens about a dozen
datasets per file (issue 33). `opened` records, for a file `open_h5`
opened read-only from a local path, that it is read-only and which POSIX
descriptor HDF5 reads it through; `_format._child` hands that record on to
each node it opens (`inherit`), so `of` answers for any node without asking
HDF5. Records are kept by the identity of the node's id object (a weak
reference tells it from a later one) and keep no file open.

Design notes: docs/reference/design.md#hdf5-handles.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import NamedTuple

import h5py


class Handle(NamedTuple):
    """A node's file as it was opened: read-only, its path and descriptor.

    `fd` is None unless HDF5 reads the local file `path` through its default
    POSIX driver (the descriptor is HDF5's own, valid while the node is).
    """

    read_only: bool
    path: str
    fd: int | None


_HANDLES: dict[int, tuple] = {}
_MAX = 256  # nodes held in all (a build's one open file has about thirty)


def opened(f: h5py.File, path: str) -> None:
    """Records a file `open_h5` just opened read-only from the local `path`."""
    fd = None
    if _default_driver_is_posix():
        fd = f.id.get_vfd_handle()
        if not isinstance(fd, int) or fd < 0:
            fd = None
    _put(f.id, Handle(True, path, fd))


def inherit(parent, child) -> None:
    """`child` (opened from `parent`, a group) shares its parent's record."""
    handle = of(parent)
    if handle is not None:
        _put(child.id, handle)


def of(node) -> Handle | None:
    """The record of `node`'s file, or None (opened some other way)."""
    oid = node.id
    held = _HANDLES.get(id(oid))
    if held is None or held[0]() is not oid:
        return None
    return held[1]


def local_fd(node, path: str) -> int | None:
    """HDF5's descriptor of `path` when `node` lies in it and is open, else None.

    Only for a node whose dataset `byte_layout` has placed in `path`; a
    closed node (its file closed) has none.
    """
    handle = of(node)
    if handle is None or handle.fd is None or handle.path != path:
        return None
    return handle.fd if node.id.valid else None


def _put(oid, handle: Handle) -> None:
    if len(_HANDLES) >= _MAX:
        _HANDLES.clear()
    _HANDLES[id(oid)] = (weakref.ref(oid), handle)


@functools.lru_cache(maxsize=1)
def _default_driver_is_posix() -> bool:
    """Whether `h5py.File(path)` reads through HDF5's POSIX driver here.

    Asked once per process: `HDF5_DRIVER` can name another default driver.
    """
    try:
        fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        return fapl.get_driver() == h5py.h5fd.SEC2 and os.name == "posix"
    except Exception:  # an HDF5 that cannot say: read through h5py
        return False


__all__ = ["Handle", "inherit", "local_fd", "of", "opened"]

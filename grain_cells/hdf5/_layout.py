"""What HDF5 says of a dataset's storage, asked once per open node.

Checks that HDF5 can return a dataset's true values (links, virtual sources,
filters); records per open node (by its id object, weakly): its creation
property list, its byte layout, and for files `open_h5` opened from a local
path, that path and HDF5's descriptor. Design notes:
docs/reference/design.md#hdf5-layout and #hdf5-handles.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import weakref

import h5py

from grain_cells import errors

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


def held(table: dict, oid, key, make, limit: int = 64):
    """`make()`, kept in `table` for the open node `oid` and `key`."""
    entry = table.get(id(oid))
    if entry is not None and entry[0]() is oid and entry[1] == key:
        return entry[2]
    value = make()
    if len(table) >= limit:
        table.clear()
    table[id(oid)] = (weakref.ref(oid), key, value)
    return value


_PLISTS: dict[int, tuple] = {}
_HANDLES: dict[int, tuple] = {}  # a build's one open file has about thirty nodes


def create_plist(dsid):
    """`dsid.get_create_plist()`, once per dataset (its storage cannot change)."""
    return held(_PLISTS, dsid, None, dsid.get_create_plist)


def opened(f: h5py.File, path: str) -> None:
    """Records a file `open_h5` just opened read-only from the local `path`."""
    fd = f.id.get_vfd_handle() if _default_driver_is_posix() else None
    if not isinstance(fd, int) or fd < 0:
        fd = None
    held(_HANDLES, f.id, None, lambda: (path, fd), 256)


def inherit(parent, child) -> None:
    """`child` (opened from the group `parent`) shares its parent's record."""
    if (record := handle(parent)) is not None:
        held(_HANDLES, child.id, None, lambda: record, 256)


def handle(node) -> tuple[str, int | None] | None:
    """`(path, HDF5's descriptor or None)` of a node of a file `open_h5` opened."""
    entry = _HANDLES.get(id(node.id))
    return entry[2] if entry is not None and entry[0]() is node.id else None


def local_fd(node, path: str) -> int | None:
    """HDF5's descriptor of `path` while the open `node` lies in it, else None."""
    record = handle(node)
    if record is None or record[1] is None or record[0] != path:
        return None
    return record[1] if node.id.valid else None


@functools.lru_cache(maxsize=1)
def _default_driver_is_posix() -> bool:
    """Whether `h5py.File(path)` reads through HDF5's POSIX driver (`HDF5_DRIVER`)."""
    try:
        fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        return fapl.get_driver() == h5py.h5fd.SEC2 and os.name == "posix"
    except Exception:  # an HDF5 that cannot say: read through h5py
        return False


def stored_in(dataset: h5py.Dataset, path: str) -> bool:
    """Whether the dataset's bytes live in the file `path` (not behind a link)."""
    if "://" not in path and h5py.h5f.get_name(dataset.id) == os.fsencode(path):
        return True  # HDF5 names the file as given: no `stat`
    if "://" in path:  # an object: h5py names its file-like by the URL
        return dataset.file.filename == path
    try:
        return os.path.samefile(dataset.file.filename, path)
    except OSError:
        return False


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
            except (KeyError, OSError) as e:
                return (
                    f"{name} is an external link to {link.path} in {where}, which "
                    f"cannot be opened there ({e})"
                )
            continue
        if isinstance(link, h5py.SoftLink):
            try:
                node = node[part]
            except (KeyError, OSError, RuntimeError):
                return (
                    f"{name} is a soft link to {link.path}, which does not exist "
                    "in this file (or the links form a loop)"
                )
            continue
        node = node[part]
    return None


def _find(linking_file: str, name: str) -> str | None:
    """The file a link names: beside the linking file, else as given."""
    base = os.path.dirname(os.path.abspath(linking_file))
    candidates = [name] if os.path.isabs(name) else [os.path.join(base, name), name]
    return next((c for c in candidates if os.path.exists(c)), None)


def check_dataset(path: str, dataset: h5py.Dataset) -> None:
    """Refuses a virtual dataset missing a source (`CorruptDataError`), or a filter."""
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


def check_filters(path: str, dataset: h5py.Dataset) -> None:
    """Refuses data compressed with a filter HDF5 lacks (after importing hdf5plugin).

    Raises `errors.UnsupportedLayoutError` naming the filter and its provider.
    """
    plist = create_plist(dataset.id)
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

"""Whether HDF5 can return a dataset's true values, checked before any read.

HDF5 returns wrong values silently in a few storage layouts, and fails with
unhelpful messages in others: links, virtual datasets with a missing source,
filters this HDF5 lacks. Each is checked here once per file open.

Design notes: docs/reference/design.md#hdf5-layout.
"""

from __future__ import annotations

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


def link_problem(f: h5py.File, element: str) -> str | None:
    """Why `element` does not resolve, when a link on its path is dangling.

    Returns:
        A sentence naming the link, its target and the file, or None when no
        link on the path is broken (the element is simply absent).
    """
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
            if not _external_exists(f.filename, target):
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


def _external_exists(linking_file: str, target: str) -> bool:
    if os.path.isabs(target):
        return os.path.exists(target)
    base = os.path.dirname(os.path.abspath(linking_file))
    return os.path.exists(os.path.join(base, target)) or os.path.exists(target)


def stored_in(dataset: h5py.Dataset, path: str) -> bool:
    """Whether the dataset's bytes live in the file `path` (not behind a link).

    Offsets HDF5 reports (`H5Dget_offset`, `H5Dchunk_iter`) are byte offsets
    in the file that holds the dataset, counted from the start of that file
    (a user block included).
    """
    if "://" in path:  # an object: h5py names its file-like by the URL
        return dataset.file.filename == path
    try:
        return os.path.samefile(dataset.file.filename, path)
    except OSError:
        return False


def check_dataset(path: str, dataset: h5py.Dataset) -> None:
    """Refuses a dataset whose values HDF5 would get wrong or cannot decode.

    Args:
        path: The file that refers to the dataset, for messages.
        dataset: The dataset (maybe reached through a link).

    Raises:
        errors.CorruptDataError: A virtual dataset's source is missing.
        errors.UnsupportedLayoutError: A filter is not available.
    """
    if dataset.is_virtual:
        _check_virtual_sources(path, dataset)
    check_filters(path, dataset)


def _check_virtual_sources(path: str, dataset: h5py.Dataset) -> None:
    base = os.path.dirname(os.path.abspath(dataset.file.filename))
    for source in dataset.virtual_sources():
        name, inner = source.file_name, source.dset_name
        if name == ".":
            ok = inner in dataset.file
            where = f"dataset {inner} of the same file"
        else:
            candidates = (
                [name]
                if os.path.isabs(name)
                else [
                    os.path.join(base, name),
                    name,
                ]
            )
            found = next((c for c in candidates if os.path.exists(c)), None)
            ok = found is not None and _has_dataset(found, inner)
            where = f"dataset {inner} of {name}"
        if not ok:
            raise errors.CorruptDataError(
                f"{path}: {dataset.name.lstrip('/')} is a virtual dataset whose source "
                f"({where}) is missing; HDF5 would read that part as fill "
                "values (zeros). Restore the source file, or rebuild the file "
                "with its data copied in."
            )


def _has_dataset(file_name: str, inner: str) -> bool:
    try:
        with h5py.File(file_name, "r") as g:
            return isinstance(g.get(inner), h5py.Dataset)
    except OSError:
        return False


# Creation property lists by dataset (a weak reference tells a dataset
# from a later one at the same address, and keeps no file open): a build
# asks each array's several times (issue 33).
_PLISTS: dict[int, tuple] = {}


def create_plist(dsid):
    """`dsid.get_create_plist()`, once per dataset (its storage cannot change)."""
    held = _PLISTS.get(id(dsid))
    if held is not None and held[0]() is dsid:
        return held[1]
    plist = dsid.get_create_plist()
    if len(_PLISTS) >= 64:
        _PLISTS.clear()
    _PLISTS[id(dsid)] = (weakref.ref(dsid), plist)
    return plist


def check_filters(path: str, dataset: h5py.Dataset) -> None:
    """Refuses data compressed with a filter HDF5 cannot apply.

    Imports `hdf5plugin` (which registers its filters) when a filter is
    missing and the package is installed.

    Raises:
        errors.UnsupportedLayoutError: A filter is missing; the message names
            its id and name and the package that provides it.
    """
    plist = create_plist(dataset.id)
    for i in range(plist.get_nfilters()):
        code, _, _, name = plist.get_filter(i)
        if h5py.h5z.filter_avail(code):
            continue
        plugin = _load_hdf5plugin()
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


def _load_hdf5plugin():
    try:
        return importlib.import_module("hdf5plugin")
    except ImportError:
        return None

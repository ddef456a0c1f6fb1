"""The files `preshuffle` leaves: parts, their markers, temporaries, manifest.

Design notes: docs/reference/design.md#preshuffle-preshuffle ("Full disk").
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import secrets
import shutil

import h5py

from grain_cells._util.cache_files import write_atomic
from grain_cells.io import inspect_matrix, open_file
from grain_cells.preshuffle._plan import FORMAT, Plan
from grain_cells.storage.remote import is_url

MANIFEST = "preshuffle.json"
"""Name of the manifest written last into the output folder."""

MARKER_ATTR = "grain_cells_preshuffle"
"""Root attribute of a complete output part (JSON: what it was made from)."""

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_ABANDONED: list = []  # HDF5 files that failed mid-write: never released


def completed_marker(
    path: pathlib.Path | str, plan: Plan, index: int, storage_options=None
) -> dict | None:
    """The part's marker if `path` (or a URL) is a complete part of this run."""
    if not is_url(path) and not pathlib.Path(path).is_file():
        return None
    try:
        with open_file(path, storage_options) as f:
            marker = matching_marker(f.attrs.get(MARKER_ATTR), plan, index)
            if marker is None:
                return None
            info = inspect_matrix(f, "X")
            if info.n_obs != marker.get("cells") or info.nnz != marker.get("nnz"):
                return None
            return marker
    except Exception:  # unreadable, truncated, foreign: not complete
        return None


def matching_marker(raw, plan: Plan, index: int) -> dict | None:
    """The marker (`MARKER_ATTR`'s JSON) if it records part `index` of this run."""
    if raw is None:
        return None
    marker = json.loads(raw)
    if (
        marker.get("fingerprint") != plan.fingerprint
        or marker.get("part") != index
        or marker.get("parts") != len(plan.part_paths)
    ):
        return None
    return marker


def create_temporary(directory: pathlib.Path, name: str, folder: bool = False):
    """Creates `.<name>.<random>.tmp` in `directory`: `(fd, path)`, or a folder.

    A file gets 0666 less the umask (not `mkstemp`'s 0600): the output keeps it.
    """
    while True:
        path = directory / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            if folder:
                path.mkdir()
                return None, path
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666), path
        except FileExistsError:
            continue


def remove_temporaries(output_dir: pathlib.Path) -> None:
    """Deletes temporaries (files, or a zarr part's folders) of an interrupted run."""
    for pattern in (".part-*.h5ad.*.tmp", ".part-*.zarr.*.tmp", f".{MANIFEST}.*.tmp"):
        for path in output_dir.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def remove_stale_parts(plan: Plan) -> None:
    """Deletes parts of earlier runs into this folder beyond this run's count."""
    keep = {p.name for p in plan.part_paths}
    for path in plan.output_dir.glob("part-*.h5ad"):
        if path.name in keep:
            continue
        try:
            with h5py.File(path, "r") as f:
                ours = MARKER_ATTR in f.attrs
        except Exception:
            ours = False
        if ours:
            path.unlink(missing_ok=True)


def manifest_of(plan: Plan, markers: dict[int, dict]) -> dict:
    """The manifest's content: the run's fingerprint, the parts and their statistics."""
    return {
        "format": FORMAT,
        "fingerprint": plan.fingerprint,
        "cells": plan.n_cells,
        "parts": [
            {"file": plan.part_paths[i].name, **markers[i]["stats"]}
            for i in range(len(plan.part_paths))
        ],
    }


def write_manifest(plan: Plan, markers: dict[int, dict]) -> None:
    """Writes `MANIFEST` (the parts and their statistics), atomically."""
    text = json.dumps(manifest_of(plan, markers), indent=1).encode()
    write_atomic(plan.output_dir / MANIFEST, lambda f: f.write(text), fsync=True)


def fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def reserve_space(path: pathlib.Path, nbytes: int, what: str) -> None:
    """Extends `path` by `nbytes` of allocated disk space, or raises `OSError`.

    The message names the folder, the bytes needed and the bytes free.
    """
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        try:
            os.posix_fallocate(fd, size, max(int(nbytes), 1))
        except OSError as e:
            if e.errno in _NO_SPACE:
                raise _no_space(path, nbytes, what, e) from e
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            # A file system without fallocate: compare with the free space.
            if shutil.disk_usage(path.parent).free < nbytes:
                raise _no_space(path, nbytes, what, e) from e
    finally:
        os.close(fd)


def check_free_space(directory: pathlib.Path, nbytes: int, what: str) -> None:
    """Raises `OSError` (ENOSPC) unless `directory`'s disk has `nbytes` free.

    For outputs that cannot reserve their space (a zarr part is many files).
    """
    if shutil.disk_usage(directory).free < nbytes:
        e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise _no_space(directory / what, nbytes, what, e)


def _no_space(path: pathlib.Path, nbytes: int, what: str, e: OSError) -> OSError:
    free = shutil.disk_usage(path.parent).free
    return OSError(
        e.errno,
        f"{path.parent}: not enough disk space to write {what}: it needs about "
        f"{nbytes:,} bytes and {free:,} are free ({os.strerror(e.errno)}). "
        "Nothing incomplete was left under a part's name; free some space (or "
        "choose another output_dir, or smaller parts with cells_per_file) and "
        "run preshuffle again: complete parts are kept.",
    )


def abandon(f: h5py.File, path: pathlib.Path) -> None:
    """Gives up on a file whose writing failed, releasing its disk space.

    HDF5 cannot close a file after a failed write (its close, or the release of any of
    its objects, crashes the interpreter), so the file is truncated and its handle kept,
    never closed, for the life of the process.
    """
    _ABANDONED.append(f)
    with contextlib.suppress(OSError):  # through a descriptor of our own
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)


def disk_filled(plan: Plan, part: pathlib.Path, e: BaseException) -> OSError:
    """The clean error for a part whose writes met a full disk."""
    what = "folder" if part.suffix == ".zarr" else "file"
    return OSError(
        errno.ENOSPC,
        f"{plan.output_dir}: the disk filled up while writing part {part.name} "
        f"({e}); its temporary {what} was removed and no part looks complete. "
        "Free some space and run preshuffle again: complete parts are kept.",
    )


def is_disk_full(e: BaseException) -> bool:
    """Whether an error (or one it wraps) is a lack of disk space."""
    while e is not None:
        if isinstance(e, OSError) and (
            e.errno in _NO_SPACE or "No space left" in str(e)
        ):
            return True
        e = e.__cause__ or e.__context__
    return False

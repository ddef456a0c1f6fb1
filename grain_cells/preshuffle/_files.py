"""The files `preshuffle` leaves: parts' markers, temporaries, manifest; full disks.

Design notes: docs/reference/design.md#preshuffle-preshuffle ("Full disk").
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import secrets
import shutil

from grain_cells._util.cache_files import write_atomic
from grain_cells.io import inspect_matrix, is_group, open_file
from grain_cells.preshuffle._plan import FORMAT, Plan

MANIFEST = "preshuffle.json"
"""Name of the manifest written last into the output folder."""

MARKER_ATTR = "grain_cells_preshuffle"
"""Root attribute of a complete output part (JSON: what it was made from)."""

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def completed_marker(
    plan: Plan, index: int, url: str | None = None, storage_options=None
) -> dict | None:
    """Part `index`'s marker if its file (or `url`) is a complete part of this run."""
    path = url or plan.part_paths[index]
    zarr_part = plan.zarr_format is not None
    if url is None and not (path.is_dir() if zarr_part else path.is_file()):
        return None
    try:
        with open_file(path, storage_options) as f:
            marker, x = json.loads(f.attrs[MARKER_ATTR]), f["X"]
            arrays = ([x[k] for k in x] if is_group(x) else [x]) if zarr_part else []
            if any(a.nchunks_initialized < a.nchunks for a in arrays):
                return None  # a zarr chunk (or shard) is missing
            info = inspect_matrix(f, "X")
            found = (info.n_obs, info.nnz)
    except Exception:  # unreadable, truncated, damaged, foreign: not complete
        return None
    want = (plan.fingerprint, index, len(plan.part_paths), *found)
    got = tuple(marker.get(k) for k in ("fingerprint", "part", "parts", "cells", "nnz"))
    return marker if got == want else None


def create_temporary(directory: pathlib.Path, name: str, folder: bool = False):
    """Creates an empty file (or a `folder`) `.<name>.<random>.tmp` in `directory`.

    A file gets 0666 less the umask (not `mkstemp`'s 0600): the output keeps it.
    """
    while True:
        path = directory / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            if folder:
                path.mkdir()
            else:
                os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666))
            return path
        except FileExistsError:
            continue


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_temporaries(output_dir: pathlib.Path) -> None:
    """Deletes temporaries (files, or a zarr part's folders) of an interrupted run."""
    for pattern in (".part-*.h5ad.*.tmp", ".part-*.zarr.*.tmp", f".{MANIFEST}.*.tmp"):
        for path in output_dir.glob(pattern):
            _remove(path)


def remove_stale_parts(plan: Plan) -> None:
    """Deletes parts (with a marker) of earlier runs beyond this run's count."""
    keep = {p.name for p in plan.part_paths}
    for path in plan.output_dir.glob("part-*"):
        stale = path.name not in keep and path.suffix in (".h5ad", ".zarr")
        linked = path.suffix == ".zarr" and path.is_symlink()  # not ours to empty
        if stale and not linked and is_ours(path):
            _remove(path)


def is_ours(path, storage_options=None) -> bool:
    """Whether `path` (a file, store or URL) is a part of some run (has the marker)."""
    try:
        with open_file(path, storage_options) as f:
            return MARKER_ATTR in f.attrs
    except Exception:  # unreadable, foreign, gone: not ours to delete
        return False


def manifest_of(plan: Plan, markers: dict[int, dict]) -> bytes:
    """The manifest (JSON): the run's fingerprint, the parts and their statistics."""
    parts = [
        {"file": p.name, **markers[i]["stats"]} for i, p in enumerate(plan.part_paths)
    ]
    manifest = {"format": FORMAT, "fingerprint": plan.fingerprint}
    manifest.update(cells=plan.n_cells, parts=parts)
    return json.dumps(manifest, indent=1).encode()


def write_manifest(plan: Plan, markers: dict[int, dict]) -> None:
    """Writes `MANIFEST` (the parts and their statistics), atomically."""
    text = manifest_of(plan, markers)
    write_atomic(plan.output_dir / MANIFEST, lambda f: f.write(text), fsync=True)


def fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Flushes `tmp` (a file, or a folder's files) and renames it to `final`."""
    inside = [pathlib.Path(d, n) for d, ds, ns in os.walk(tmp) for n in ds + ns]
    for path in [*inside, tmp]:
        fsync_path(path)
    aside = None
    if tmp.is_dir() and os.path.lexists(final):  # an incomplete or foreign part
        aside = create_temporary(final.parent, final.name, True)
        os.replace(final, aside / "old")
    os.replace(tmp, final)
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def reserve_space(path: pathlib.Path, nbytes: int, what: str) -> None:
    """Allocates `nbytes` at the end of file `path` (a folder: checks its free space).

    Raises `OSError` naming the folder, the bytes needed and the bytes free.
    """
    if path.is_dir():
        if shutil.disk_usage(path).free < nbytes:
            e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise _no_space(path / what, nbytes, what, e)
        return
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

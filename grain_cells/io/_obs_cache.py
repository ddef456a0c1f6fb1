"""obs codes shared between processes: one `.npy` per (file, column) on disk.

The first process that opens a file writes each harmonised column once; every
process maps it read-only. A collection's whole column is one more entry
(`_collection.joined_columns`).

Design notes: docs/reference/design.md#io-obs-cache.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib

import numpy as np

from grain_cells._util.cache_files import cache_root, file_lock, write_atomic
from grain_cells.io import _h5ad
from grain_cells.io._identity import FileIdentity
from grain_cells.io._obs import HarmonisedColumn

_log = logging.getLogger("grain_cells")

MIN_CELLS = 1 << 16  # smaller files keep their columns in memory
_VERSION = "obs-cache-1"  # part of every key: bump when the values' layout changes
_STAMP = 40  # hex digits of the name, also written after the values
_warned: set[str] = set()


def cache_folder() -> pathlib.Path | None:
    """The folder of obs cache entries, or None when switched off."""
    own = os.environ.get("GRAIN_CELLS_OBS_CACHE", "")
    if own.lower() in ("off", "0", "false", "none"):
        return None
    if own:
        return pathlib.Path(own).expanduser()
    return pathlib.Path(cache_root(xdg=False)).expanduser() / "obs"


def entry_name(identity: FileIdentity, column: HarmonisedColumn, i: int) -> str:
    """The entry's file name: a digest of everything its values depend on."""
    code_map = column.code_maps[i]
    kind = "categorical" if column.categories is not None else f"numeric {column.dtype}"
    codes = "identity" if code_map is None else code_map.astype("<i8").tobytes().hex()
    where = [_VERSION, identity.path, repr(identity.stat), identity.element]
    parts = [*where, identity.layout, identity.sample, column.name, kind, codes]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return f"{digest[:_STAMP]}.npy"


def file_obs(
    f, identity: FileIdentity, columns: dict[str, HarmonisedColumn], i: int, n_obs: int
) -> dict[str, np.ndarray]:
    """File `i`'s obs columns by name: read-only maps of cache entries, or in memory."""
    folder = cache_folder() if n_obs >= MIN_CELLS else None
    out = {}
    for name, column in columns.items():
        if not column.present[i]:
            out[name] = column.file_values(i, None, n_obs)
            continue
        path = None if folder is None else folder / entry_name(identity, column, i)

        def read(column=column, name=name):
            return column.file_values(i, _h5ad.read_obs_column(f, name), n_obs)

        out[name] = cached(path, column, n_obs, read)
    return out


def cached(path: pathlib.Path | None, column, n_obs: int, read) -> np.ndarray:
    """The entry at `path` mapped, else `read()` stored there (one process, flock)."""
    mapped = None if path is None else _load(path, column, n_obs, quiet=True)
    if mapped is not None:
        return mapped
    with file_lock(None if path is None else path.with_suffix(".lock")):
        mapped = None if path is None else _load(path, column, n_obs)
        if mapped is None:
            values = read()
            if path is not None:
                mapped = _store(path, values, column, n_obs)
            if mapped is None:
                mapped = values
    return mapped


def _load(path: pathlib.Path, column: HarmonisedColumn, n_obs: int, quiet=False):
    """The entry mapped read-only, or None (a damaged one logged unless `quiet`)."""
    kind = "i" if column.categories is not None else column.dtype.kind
    try:
        mapped = np.load(path, "r", allow_pickle=False)
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(size - _STAMP, 0))
            stamp = fh.read()
        problem = None
        if mapped.shape != (n_obs,):
            problem = f"shape {mapped.shape}, expected ({n_obs},)"
        elif mapped.dtype.kind != kind or mapped.dtype.hasobject:
            problem = f"dtype {mapped.dtype}, expected kind {kind!r}"
        elif column.categories is None and mapped.dtype != column.dtype:
            problem = f"dtype {mapped.dtype}, expected {column.dtype}"
        elif size != mapped.offset + mapped.nbytes + _STAMP:
            problem = f"{size} bytes, expected {mapped.offset + mapped.nbytes + _STAMP}"
        elif stamp != path.stem.encode():
            problem = "another entry's values (its digest differs)"
    except FileNotFoundError:
        return None
    except (OSError, ValueError, EOFError) as e:
        problem = e
    if problem is None:
        return mapped.view(np.ndarray)  # slices stay ndarrays; the base is the map
    if not quiet:
        _log.warning("obs cache: rebuilding %s (%s)", path, problem)
    return None


def own_map(values: np.ndarray) -> np.ndarray:
    """`values` (a column of `file_obs`) read-only, in a map the caller's drop ends."""
    base = values.base
    if isinstance(base, np.memmap) and base.filename and values.ndim == 1:
        again = np.memmap(base.filename, values.dtype, "r", base.offset, values.shape)
        return again.view(np.ndarray)
    out = values.view()
    out.flags.writeable = False
    return out


def _store(path: pathlib.Path, values: np.ndarray, column, n_obs: int):
    """Writes the entry atomically and maps it; None when it cannot be written."""

    def write(fh):
        np.save(fh, np.ascontiguousarray(values), allow_pickle=False)
        fh.write(path.stem.encode())

    try:
        write_atomic(path, write, fsync=True, prefix=path.stem)
    except OSError as e:
        folder = str(path.parent)
        if folder not in _warned:
            _warned.add(folder)
            _log.warning(
                f"obs cache: cannot write {folder} ({e}); obs columns stay in each "
                "process's memory. Set GRAIN_CELLS_OBS_CACHE to a writable "
                "folder, or to 'off'."
            )
        return None
    return _load(path, column, n_obs)

"""obs codes shared between processes: one `.npy` per (file, column) on disk.

Every process that reads a source (the trainer and each Grain worker) needs
the obs columns of every file it opens, one value per cell. Read whole into
each process, they cost ~5 bytes per cell per process for four categorical
columns (590 MiB per worker at 100M cells; benchmarks/RESULTS.md, "Scale:
obs columns shared"). Instead, the first process that opens a file writes
each column's harmonised values (`HarmonisedColumn.file_values`: the codes
in the source's shared category list, or numeric values in the source's
dtype) once to a cache file, and every process maps it read-only
(`np.memmap`): the pages are the kernel's page cache, shared by every
process and dropped under memory pressure, not anonymous memory of each.

**Where.** `$GRAIN_CELLS_OBS_CACHE` if set (`off` keeps today's in-memory
columns), else `obs/` under `$GRAIN_CELLS_CACHE` or `~/.cache/grain_cells`.
A folder that cannot be written (a read-only home) falls back to reading
the column into memory, with one warning per process. Files of fewer than
`MIN_CELLS` cells keep their columns in memory (a few pages each: less than
the file's open handle costs), so a collection of many small files makes
no cache files and no maps.

**Which entry.** An entry's name is a digest of the file's path and its
whole `FileIdentity` (stat: device, inode, size, times, or an object's
ETag, or a zarr store's digest; layout and sample digests), the column, and
its harmonisation (category code map or numeric dtype), with a version of
this layout. A file rewritten or replaced has another identity, so it gets
another entry: a stale entry is never read. Two sources over the same file
and columns with the same harmonisation share one entry.

**Writing** goes to a temporary file in the same folder, flushed, then
renamed over the entry (`os.replace`, atomic), so a reader sees a whole
entry or none; processes that race write the same bytes and the last rename
wins. Processes that miss the same entry at once take turns on a lock file
beside it (`flock`), so one reads the column and the others map what it
wrote. An entry is a `.npy` file (`np.load` reads it) followed by its own
name's digest. **Reading** checks the header (one dimension, the file's
cell count, a dtype of the column's kind), that the file's size is exactly
header, values and digest, and the digest; an entry that fails (truncated,
damaged in its header, foreign) is rebuilt from the file. Values damaged in
place on disk are not detected (that needs a read of every page). Old
entries are not removed: delete the folder any time no source is being read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import pathlib
import tempfile

import numpy as np

from grain_cells.io import _h5ad as h5ad
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
    root = os.environ.get("GRAIN_CELLS_CACHE") or (
        pathlib.Path.home() / ".cache" / "grain_cells"
    )
    return pathlib.Path(root).expanduser() / "obs"


def entry_name(identity: FileIdentity, column: HarmonisedColumn, i: int) -> str:
    """The entry's file name: a digest of everything its values depend on."""
    code_map = column.code_maps[i]
    parts = [
        _VERSION,
        identity.path,
        repr(identity.stat),
        identity.element,
        identity.layout,
        identity.sample,
        column.name,
        "categorical" if column.categories is not None else f"numeric {column.dtype}",
        "identity" if code_map is None else code_map.astype("<i8").tobytes().hex(),
    ]
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:_STAMP]
    return f"{digest}.npy"


def file_obs(
    f,
    identity: FileIdentity,
    columns: dict[str, HarmonisedColumn],
    i: int,
    n_obs: int,
) -> dict[str, np.ndarray]:
    """File `i`'s obs columns, mapped from the cache where it can.

    Args:
        f: The open file's root (`Format.open`).
        identity: The file's identity, taken when the source was built.
        columns: The source's harmonised obs columns, by name.
        i: The file's index in the source.
        n_obs: The file's cells.

    Returns:
        Per column, one value per cell: a read-only array over a memory map
        of the cache entry (its `base` is an `np.memmap`), or, for small
        files, a switched-off or unwritable cache, the values in memory as
        `HarmonisedColumn.file_values` gives them.
    """
    folder = cache_folder() if n_obs >= MIN_CELLS else None
    out = {}
    for name, column in columns.items():
        if not column.present[i]:
            out[name] = column.file_values(i, None, n_obs)
            continue
        path = None if folder is None else folder / entry_name(identity, column, i)
        mapped = None if path is None else _load(path, column, n_obs, quiet=True)
        if mapped is None:
            with _writer_lock(path):
                # Another process may have written it while this one waited.
                mapped = None if path is None else _load(path, column, n_obs)
                if mapped is None:
                    values = column.file_values(i, h5ad.read_obs_column(f, name), n_obs)
                    if path is not None:
                        mapped = _store(path, values, column, n_obs)
                    if mapped is None:
                        mapped = values
        out[name] = mapped
    return out


@contextlib.contextmanager
def _writer_lock(path: pathlib.Path | None):
    """Holds `<entry>.lock` (flock): one process of many racing reads the column.

    The others wait, then map what it wrote, instead of each reading the
    whole column into its own memory. No lock (an unwritable folder) is
    not an error: the entry is then not written either.
    """
    if path is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _load(path: pathlib.Path, column: HarmonisedColumn, n_obs: int, quiet=False):
    """The entry mapped read-only, or None when absent or not valid.

    A damaged entry is logged (unless `quiet`: the check is then repeated
    under the writer's lock, and logged there).
    """
    try:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise ValueError(f"npy version {version}")
            offset = fh.tell()
            size = os.fstat(fh.fileno()).st_size
            fh.seek(max(size - _STAMP, 0))
            stamp = fh.read(_STAMP)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        if not quiet:
            _log.warning("obs cache: rebuilding %s (%s)", path, e)
        return None
    expected_kind = "i" if column.categories is not None else column.dtype.kind
    problem = None
    if shape != (n_obs,) or fortran:
        problem = f"shape {shape}, expected ({n_obs},)"
    elif dtype.kind != expected_kind or dtype.hasobject:
        problem = f"dtype {dtype}, expected kind {expected_kind!r}"
    elif column.categories is None and dtype != column.dtype:
        problem = f"dtype {dtype}, expected {column.dtype}"
    elif size != offset + n_obs * dtype.itemsize + _STAMP:
        problem = f"{size} bytes, expected {offset + n_obs * dtype.itemsize + _STAMP}"
    elif stamp != path.stem.encode():
        problem = "another entry's values (its digest differs)"
    if problem is not None:
        if not quiet:
            _log.warning("obs cache: rebuilding %s (%s)", path, problem)
        return None
    return _as_array(np.memmap(path, dtype, "r", offset, (n_obs,)))


def own_map(values: np.ndarray) -> np.ndarray:
    """`values` (a column `file_obs` gave) in a map of the caller's own.

    A column mapped from the cache is mapped again: the same pages of the
    page cache, but a mapping that ends when the caller drops the array, so
    a pass over a whole column (a split, class weights) leaves no pages
    mapped in the process after it. Any other column is returned as a
    read-only view.
    """
    base = values.base
    if isinstance(base, np.memmap) and base.filename and values.ndim == 1:
        again = np.memmap(base.filename, values.dtype, "r", base.offset, values.shape)
        return _as_array(again)
    out = values.view()
    out.flags.writeable = False
    return out


def _as_array(mapped: np.memmap) -> np.ndarray:
    """A plain ndarray view (slices stay ndarrays); its base is the map."""
    return mapped.view(np.ndarray)


def _store(path: pathlib.Path, values: np.ndarray, column, n_obs: int):
    """Writes the entry atomically and maps it; None when it cannot be written."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from other users
        with os.fdopen(fd, "wb") as fh:
            np.save(fh, np.ascontiguousarray(values), allow_pickle=False)
            fh.write(path.stem.encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        folder = str(path.parent)
        if folder not in _warned:
            _warned.add(folder)
            _log.warning(
                "obs cache: cannot write %s (%s); obs columns stay in each "
                "process's memory. Set GRAIN_CELLS_OBS_CACHE to a writable "
                "folder, or to 'off'.",
                folder,
                e,
            )
        return None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return _load(path, column, n_obs)


__all__ = ["MIN_CELLS", "cache_folder", "entry_name", "file_obs"]

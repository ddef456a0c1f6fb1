"""A many-file source's fetch with no per-file record: one table, joined obs.

`LayoutTable`: the byte pieces of every local, uncompressed CSR file, taken
from what the build inspected; `joined_columns`: each obs column over all
files, one shared cache entry. A fetch of many files reads through both, so its
cost and a process's memory do not grow with the files a source has.

Design notes: docs/reference/design.md#io-collection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterator, Sequence

import numpy as np

from grain_cells import formats
from grain_cells.io import _h5ad
from grain_cells.io._direct_csr import Pieces
from grain_cells.io._identity import fstat_key
from grain_cells.io._obs_cache import MIN_CELLS, cache_folder, cached, entry_name
from grain_cells.io._open_file import entry_open

_NAMES = ("indptr", "data", "indices")


@dataclasses.dataclass(frozen=True, eq=False)
class LayoutTable:
    """Files' CSR byte pieces (`Pieces`, a row per file) and their `stat` fields.

    `member[i]`: file i is in the table (local, uncompressed, plain CSR of the
    table's dtypes); `stats[i]`: its (ino, dev, size, mtime_ns, ctime_ns).
    """

    pieces: Pieces
    member: np.ndarray
    stats: np.ndarray

    @classmethod
    def build(cls, infos, identities, matrices: Sequence[dict | None], stats):
        """The table of files' matrix layouts (`FileMeta.layouts["matrix"]`), or
        None (fewer than two files in it). `stats`: every file's `stat_key` (the
        `FileRecords`' own array: one copy in a process).
        """  # noqa: D205
        n = len(infos)
        counts, rows = np.zeros((n, 3), np.int64), np.ones((n, 3), np.int64)
        nnz, n_vars = np.zeros(n, np.int64), np.zeros(n, np.int64)
        member = np.zeros(n, bool)
        offsets: list = []
        dtypes = None
        for i, (info, identity, matrix) in enumerate(
            zip(infos, identities, matrices, strict=True)
        ):
            matrix = matrix or {}
            local_csr = info.encoding == _h5ad.CSR and identity.local
            if not local_csr or set(matrix) != set(_NAMES):
                continue
            # Each: [name, dtype, shape, rows, offsets, chunk length].
            arrays = [matrix[k] for k in _NAMES]
            own = tuple(np.dtype(a[1]) for a in arrays)
            flat = all(len(a[2]) == 1 and a[3] >= 1 for a in arrays)
            if not flat or own != (dtypes or own):
                continue
            dtypes = own
            member[i] = True
            counts[i] = [len(a[4]) for a in arrays]
            rows[i] = [a[3] for a in arrays]
            nnz[i], n_vars[i] = info.nnz, info.n_vars
            offsets += (o for a in arrays for o in a[4])
        if member.sum() < 2:
            return None
        pieces = Pieces(np.array(offsets, np.int64), counts, rows, nnz, n_vars, dtypes)
        return cls(pieces, member, stats)


@contextlib.contextmanager
def table_fds(handles, indices: Sequence[int]) -> Iterator[tuple | None]:
    """`(which, fds)` of files `indices` read through their `LayoutTable`, or None.

    `fds`: descriptors of the fetch's own, each `fstat` as the build saw it (room
    made in the bound); None when a file is not in the table, gone or changed
    (the per-file path then says how).
    """
    table = handles.files.layouts
    which = np.asarray(indices, np.int64)
    if table is None or not table.member[which].all():
        yield None
        return
    handles.reserve(which.size)
    paths, fds = handles.files.paths, []
    try:
        for i, then in zip(indices, table.stats[which].tolist(), strict=True):
            try:
                fd = os.open(paths[i], os.O_RDONLY)
            except OSError:
                break
            fds.append(fd)
            if list(fstat_key(os.fstat(fd))) != then:
                break
        else:
            yield which, fds
            return
        yield None
    finally:
        for fd in fds:
            os.close(fd)


def joined_column(files, name: str) -> np.ndarray:
    """Obs column `name` over all `files`, joined (one entry; `SourceChangedError`)."""
    return joined_columns(files, [name])[name]


def joined_columns(files, names: Sequence[str]) -> dict[str, np.ndarray]:
    """Obs columns `names` over all `files`: one cache entry each, read in one pass.

    Mapped read-only when the source has `MIN_CELLS` cells or more and the obs
    cache is on; else in memory.
    """
    counts = files.n_obs.tolist()
    total = sum(counts)
    folder = cache_folder() if total >= MIN_CELLS else None
    done: dict[str, np.ndarray] = {}

    def read_all() -> dict[str, np.ndarray]:  # every column, once
        if not done:
            parts = [_member_columns(files, i, names, n) for i, n in enumerate(counts)]
            for name in names:
                values = np.concatenate([p[name] for p in parts])
                values.flags.writeable = False
                done[name] = values
        return done

    out = {}
    identities = list(files.identities) if folder is not None else []
    for name in names:
        column, path = files.obs[name], None
        if folder is not None:
            keys = "".join(entry_name(d, column, i) for i, d in enumerate(identities))
            path = folder / f"{hashlib.sha256(keys.encode()).hexdigest()[:40]}.npy"
        out[name] = cached(path, column, total, lambda name=name: read_all()[name])
    return out


def _member_columns(files, i: int, names, n_obs: int) -> dict[str, np.ndarray]:
    """File `i`'s values of obs columns `names`: from its entry, else opened."""
    columns = {name: files.obs[name] for name in names}
    if any(c.present[i] for c in columns.values()):
        found = _entry_obs(files, i)
        if found is not None:
            return {name: found[name] for name in names}
    f = None
    try:
        out = {}
        for name, column in columns.items():
            values = None
            if column.present[i]:
                if f is None:
                    identity, options = files.identities[i], files.storage_options
                    f = _h5ad.open_unchanged(identity, options, "reading obs")
                values = _h5ad.read_obs_column(f, name)
            out[name] = column.file_values(i, values, n_obs)
        return out
    finally:
        if f is not None:
            f.close()


def _entry_obs(files, i: int) -> dict | None:
    """File `i`'s obs columns read by its metadata entry's byte layouts, or None."""
    try:
        found = entry_open(files, i, formats.for_path(files.infos[i].path))
    except Exception:  # the open below says why
        return None
    if found is None:
        return None
    found[1].close()
    return found[0][0]

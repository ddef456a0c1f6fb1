"""Reads of global row ranges over a file set: the data path's only reads.

`fetch_ranges` returns rows in file order as views into a reused buffer, in
output columns; `read_ranges`/`read_rows` return fresh `Cells` in the order
asked; `advise` hints the OS. Design notes: docs/reference/design.md#io-range-reads.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from grain_cells._util.ranges import expand_ranges, runs
from grain_cells.io import _direct_csr, _h5ad
from grain_cells.io._cells import Cells, gather_dense, remap_csr, take_csr
from grain_cells.io._collection import table_fds
from grain_cells.io._file_lru import default_budget
from grain_cells.io._file_set import OpenFiles
from grain_cells.io._matrix import CsrRows, RowBuffer
from grain_cells.io._obs_rows import obs_rows

# Files one read-ahead hint holds at once (closed ones: a descriptor each).
HINT_FILES = 32


@dataclasses.dataclass
class FetchedRows:
    """Rows in output columns, views into a buffer valid until the next read."""

    csr: CsrRows | None
    dense: np.ndarray | None
    row_ids: np.ndarray
    obs: dict[str, np.ndarray]


def fetch_ranges(
    handles: OpenFiles,
    cell_offsets: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    buffer: RowBuffer | None = None,
    *,
    check_indices: bool = True,
) -> FetchedRows:
    """Reads global row ranges into a reused buffer, in file order.

    See `AnnDataSource.fetch_ranges` (IndexError, ValueError: bad ranges).
    """
    starts = np.asarray(starts, np.int64).reshape(-1)
    stops = np.asarray(stops, np.int64).reshape(-1)
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    _check_ranges(starts, stops, cell_offsets, handles.files.paths)
    files = np.searchsorted(cell_offsets, starts, side="right") - 1
    buf = buffer if buffer is not None else handles.buffer()
    # A read holds a descriptor per file it touches: past the budget, in parts.
    firsts = np.flatnonzero(np.diff(files, prepend=-1))
    per = default_budget()
    if firsts.size <= per:
        return _fetch(handles, cell_offsets, starts, stops, files, buf, check_indices)
    cuts = [*firsts[per::per].tolist(), starts.size]
    parts = [
        _fetch(
            handles,
            cell_offsets,
            starts[a:b],
            stops[a:b],
            files[a:b],
            RowBuffer(),
            check_indices,
        )
        for a, b in itertools.pairwise([0, *cuts])
    ]
    return _joined(parts)


def _joined(parts: list[FetchedRows]) -> FetchedRows:
    """Parts of one fetch (rows in file order) as one, in fresh arrays."""
    row_ids = np.concatenate([p.row_ids for p in parts])
    obs = {c: np.concatenate([p.obs[c] for p in parts]) for c in parts[0].obs}
    if parts[0].csr is None:
        dense = np.concatenate([p.dense for p in parts])
        return FetchedRows(None, dense, row_ids, obs)
    csrs = [p.csr for p in parts]
    ends = np.cumsum([c.indptr[-1] for c in csrs])
    indptr = np.concatenate(
        [[0], *(c.indptr[1:] + v for c, v in zip(csrs, [0, *ends[:-1]], strict=True))]
    )
    data = np.concatenate([c.data for c in csrs])
    indices = np.concatenate([c.indices for c in csrs])
    return FetchedRows(
        CsrRows(data, indices, indptr, csrs[0].n_vars), None, row_ids, obs
    )


def _fetch(handles, cell_offsets, starts, stops, files, buf, check_indices):
    """`fetch_ranges` of sorted, checked ranges in files `files`."""
    files_ = handles.files
    pool = handles.thread_pool()
    lengths = stops - starts
    row_ids = expand_ranges(starts, lengths)
    # Ranges are in file order: each file's are one run (`group`: its index).
    bounds = [0, *(np.flatnonzero(np.diff(files)) + 1).tolist(), starts.size]
    group = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    # (nothing asked: an empty read of the first file)
    file_of = files[bounds[:-1]].tolist() if starts.size else [0]
    at = cell_offsets[files]
    starts, stops = starts - at, stops - at  # local rows
    names = files_.obs_names
    if files_.sparse and len(file_of) > 1:  # every file positional: all at once
        got = _read_table(
            handles, file_of, group, starts, stops, buf, pool, check_indices
        )
        if got is not None:
            joined = handles.joined_obs()
            obs = {c: joined[c][row_ids] for c in names}
            return FetchedRows(
                _output(files_, file_of, got, buf, check_indices), None, row_ids, obs
            )
        with handles.pinned_flats(file_of) as direct, handles.counting_reads():
            flats, fds, file_obs = direct
            if None not in flats and len({id(f.dtypes) for f in flats}) == 1:
                obs = obs_rows(names, file_obs, group, starts, stops)  # (interned)
                table = _direct_csr.Pieces.of(flats)
                got = _direct_csr.read(
                    table, None, fds, group, starts, stops, buf, pool, check_indices
                )
                if got is not None:  # in output columns
                    csr = _output(files_, file_of, got, buf, check_indices)
                    return FetchedRows(csr, None, row_ids, obs)
    # File by file (or again, to name what the direct read found wrong).
    with handles.pinned(file_of, at_read=True) as opened, handles.counting_reads():
        obs = obs_rows(names, [f.obs for f in opened], group, starts, stops)
        # Readers of files reopened from byte layouts are built only here.
        readers = [f.reader for f in opened]
        local = [(starts[a:b], stops[a:b]) for a, b in itertools.pairwise(bounds)]
        return _read(
            files_, readers, local, file_of, buf, pool, row_ids, obs, check_indices
        )


def _read_table(handles, file_of, group, starts, stops, buf, pool, check_indices):
    """`_direct_csr.read` of files `file_of` through the source's `LayoutTable`, or
    None (a file not in it, gone or changed; the obs cache off for a large source).
    """  # noqa: D205
    files_ = handles.files
    if files_.layouts is None or handles.joined_obs() is None:
        return None
    with table_fds(handles, file_of) as found, handles.counting_reads():
        if found is None:
            return None
        which, fds = found
        table = files_.layouts.pieces
        return _direct_csr.read(
            table, which, fds, group, starts, stops, buf, pool, check_indices
        )


def _output(files_, file_of, got, buf, check_indices) -> CsrRows:
    """A many-file read's `(data, indices, indptr, per_file)` in output columns."""
    *csr, per_file = got
    maps = list(map(files_.genes.maps.__getitem__, file_of))
    if maps.count(None) < len(maps):  # a file's genes mapped
        ends = np.cumsum(per_file).tolist()
        spans = list(zip([0, *ends[:-1]], ends, maps, strict=True))
        csr = remap_csr(*csr, spans, buf, check_indices)
    return CsrRows(*csr, files_.num_genes)


def _read(files_, readers, local, file_of, buf, pool, row_ids, obs, check_indices):
    """`fetch_ranges`' reads, over pinned files' readers."""
    maps = [files_.genes.maps[i] for i in file_of]
    if not files_.sparse:
        if len(readers) == 1 and maps[0] is None:  # rows as read
            dense = readers[0].read(*local[0], buf, pool)
            return FetchedRows(None, dense, row_ids, obs)
        # Each file's rows into one buffer, in output columns.
        dense = buf.get(
            "aligned_dense",
            (row_ids.size, files_.num_genes),
            np.result_type(*(_h5ad.value_dtype(r.info.dtype) for r in readers)),
        )
        r_ = 0
        for reader, (a, b), column_map in zip(readers, local, maps, strict=True):
            part = reader.read(a, b, buf, pool)
            gather_dense(part, column_map, dense[r_ : r_ + part.shape[0]])
            r_ += part.shape[0]
        return FetchedRows(None, dense, row_ids, obs)
    # Phase one per file (indptr), then every file's values straight into
    # one buffer: no per-file copy to concatenate.
    plans = [
        r.plan(a, b, buf, key=f"ptr{k}")
        for k, (r, (a, b)) in enumerate(zip(readers, local, strict=True))
    ]
    nnz = sum(p.nnz for p in plans)
    n_rows = sum(p.n_rows for p in plans)
    # Files of different dtypes: each is read as stored, then cast.
    pairs = zip(*{r.dtypes for r in readers}, strict=True)
    dtypes = data_dtype, index_dtype = tuple(np.result_type(*x) for x in pairs)
    data = buf.get("data", (nnz,), data_dtype)
    indices = buf.get("indices", (nnz,), index_dtype)
    indptr = buf.get("indptr", (n_rows + 1,), np.int64)
    indptr[0] = 0
    v = r_ = 0
    spans = []
    for reader, plan, column_map in zip(readers, plans, maps, strict=True):
        span = slice(v, v + plan.nnz)
        spans.append((v, v + plan.nnz, column_map))
        d, i = data[span], indices[span]
        if reader.dtypes != dtypes:  # read as stored, then cast
            d, i = (np.empty(plan.nnz, t) for t in reader.dtypes)
        reader.read_values(plan, d, i, pool, check_indices)
        if reader.dtypes != dtypes:
            data[span], indices[span] = d, i
        indptr[r_ + 1 : r_ + 1 + plan.n_rows] = plan.indptr[1:] + v
        v += plan.nnz
        r_ += plan.n_rows
    data, indices, indptr = remap_csr(data, indices, indptr, spans, buf, check_indices)
    csr = CsrRows(data, indices, indptr, files_.num_genes)
    return FetchedRows(csr, None, row_ids, obs)


def _check_ranges(starts, stops, cell_offsets: np.ndarray, paths) -> None:
    """Sorted ranges must lie in one file each (IndexError), disjoint (ValueError)."""
    n = int(cell_offsets[-1])
    if starts.size and (starts.min() < 0 or stops.max() > n or (stops < starts).any()):
        bad = int(np.flatnonzero((starts < 0) | (stops > n) | (stops < starts))[0])
        raise IndexError(
            f"rows [{starts[bad]}, {stops[bad]}) out of range: the source has "
            f"{n} cells ({', '.join(paths)})"
        )
    if starts.size > 1 and (starts[1:] < stops[:-1]).any():
        raise ValueError("row ranges overlap; pass disjoint ranges")
    f_start = np.searchsorted(cell_offsets, starts, side="right")
    f_last = np.searchsorted(cell_offsets, np.maximum(stops - 1, starts), side="right")
    if (f_start != f_last).any():
        bad = int(np.flatnonzero(f_start != f_last)[0])
        raise IndexError(
            f"rows [{starts[bad]}, {stops[bad]}) straddle two files; split the "
            "range at the file boundary (see cell_offsets)"
        )


def read_ranges(
    handles: OpenFiles, cell_offsets, starts, stops, *, check_indices: bool = True
) -> Cells:
    """Global row ranges as fresh `Cells`, range after range in the order given."""
    starts = np.asarray(starts, np.int64).reshape(-1)
    stops = np.asarray(stops, np.int64).reshape(-1)
    wanted = expand_ranges(starts, stops - starts)
    return _take(handles, cell_offsets, starts, stops, wanted, check_indices)


def read_rows(
    handles: OpenFiles, cell_offsets, rows, *, check_indices: bool = True
) -> Cells:
    """Rows by global id as fresh `Cells`, in the order given (repeats allowed).

    Raises TypeError (not integers) or IndexError (outside the files).
    """
    rows = np.asarray(rows).reshape(-1)
    if rows.size == 0:
        rows = rows.astype(np.int64)
    if rows.dtype.kind not in "iu":
        raise TypeError(f"rows must be integers, got dtype {rows.dtype}")
    rows = rows.astype(np.int64, copy=False)
    n = int(cell_offsets[-1])
    if rows.size and (rows.min() < 0 or rows.max() >= n):
        bad = int(rows[(rows < 0) | (rows >= n)][0])
        raise IndexError(
            f"row {bad} out of range: the source has {n} cells "
            f"({', '.join(handles.files.paths)})"
        )
    run_starts, run_stops = runs(np.unique(rows), cuts=cell_offsets[1:-1])
    return _take(handles, cell_offsets, run_starts, run_stops, rows, check_indices)


def _take(handles, cell_offsets, starts, stops, rows, check_indices) -> Cells:
    """Global rows `rows` of the ranges fetched, as fresh `Cells` (files' dtype)."""
    fetched = fetch_ranges(
        handles, cell_offsets, starts, stops, check_indices=check_indices
    )
    positions = np.searchsorted(fetched.row_ids, rows)
    files = handles.files
    obs = {c: v[positions] for c, v in fetched.obs.items()}
    row_ids = fetched.row_ids[positions]
    if fetched.csr is not None:
        import scipy.sparse as sp  # here: workers never import scipy

        data, indices, indptr = take_csr(fetched.csr, positions)
        X = sp.csr_matrix(
            (data.astype(files.dtype, copy=False), indices, indptr),
            shape=(positions.size, files.num_genes),
        )
        if files.genes.reorders:  # rows kept a file's own gene order
            X.sort_indices()
    else:
        X = fetched.dense[positions].astype(files.dtype, copy=False)
    return Cells(X, obs, row_ids)


def advise(handles: OpenFiles, cell_offsets, files, starts, stops) -> None:
    """Asks the OS to start reading ranges into the page cache (may raise).

    Only files open or of known byte layouts; nothing while the cache is warm.
    """
    if handles.cache_warm:
        return
    buf = handles.buffer("advise_buf")
    files = np.asarray(files, np.int64).reshape(-1)
    order = np.argsort(files, kind="stable")
    files = files[order]
    starts = np.asarray(starts, np.int64).reshape(-1)[order] - cell_offsets[files]
    stops = np.asarray(stops, np.int64).reshape(-1)[order] - cell_offsets[files]
    bounds = [0, *(np.flatnonzero(np.diff(files)) + 1).tolist(), files.size]
    # At most `HINT_FILES` files (descriptors of their own) at a time.
    with handles.counting_reads(hints=True):
        for k in range(0, len(bounds) - 1, HINT_FILES):
            part = bounds[k : k + HINT_FILES + 1]
            indices = files[part[:-1]].tolist()
            spans = [slice(a, b) for a, b in itertools.pairwise(part)]
            _advise_files(handles, indices, spans, starts, stops, buf)


def _advise_files(handles, indices, spans, starts, stops, buf) -> None:
    """`advise` of files `indices`' ranges `spans`: CSR byte pieces at once.

    Files open or of known byte layouts only (`OpenFiles.for_hints`).
    """
    span = slice(spans[0].start, spans[-1].stop)
    group = np.repeat(np.arange(len(indices)), [s.stop - s.start for s in spans])
    with table_fds(handles, indices) as found:
        if found is not None:  # every file through the source's table
            table, (which, fds) = handles.files.layouts.pieces, found
            _direct_csr.advise(table, which, fds, group, starts[span], stops[span], buf)
            return
    with handles.pinned_flats(indices, hint=True) as (flats, fds, _):
        for k in [k for k, flat in enumerate(flats) if flat is None]:
            with handles.for_hints(indices[k]) as f:  # by its reader, if any
                if f is not None:
                    f.reader.advise(starts[spans[k]], stops[spans[k]], buf)
        starts, stops = starts[span], stops[span]
        by_dtypes: dict = {}  # files of one dtype are hinted together
        for k, flat in enumerate(flats):
            if flat is not None:
                by_dtypes.setdefault(flat.dtypes, []).append(k)
        for ks in by_dtypes.values():
            local = np.full(len(indices), -1, np.int64)
            local[ks] = np.arange(len(ks))
            g = local[group]
            sel = g >= 0
            flats_, fds_ = [flats[k] for k in ks], [fds[k] for k in ks]
            table = _direct_csr.Pieces.of(flats_)
            _direct_csr.advise(table, None, fds_, g[sel], starts[sel], stops[sel], buf)

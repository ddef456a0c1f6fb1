"""CSR rows of many local, uncompressed files read at once, by byte pieces (`Flat`).

Anything unusual returns None: the caller reads file by file, which names the
problem. Design notes: docs/reference/design.md#io-direct-csr.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from grain_cells._util.ranges import expand_ranges
from grain_cells.formats import wait_all
from grain_cells.storage import (
    ShortReadError,
    advise_uncached,
    pread_cached,
    pread_pieces,
)
from grain_cells.storage.remote import is_url

# Below this many bytes a thread pool costs more than it saves.
_MIN_BYTES_PER_THREAD = 1 << 20
# A hint reads a range of at most this many rows' `indptr` whole (one read).
_SLICE_ROWS = 512


@dataclasses.dataclass(frozen=True, eq=False)
class Flat:
    """One file's CSR arrays (`_NAMES`) as pieces of `chunk_rows` at `offsets`.

    Read over any local descriptor of the file (each reopen's).
    """

    offsets: tuple  # (indptr, data, indices): int64 arrays
    chunk_rows: tuple
    dtypes: tuple
    nnz: int
    n_vars: int

    @functools.cached_property
    def pieces(self) -> np.ndarray:
        return np.concatenate(self.offsets)

    @functools.cached_property
    def meta(self) -> np.ndarray:
        """Pieces per array (3), rows per piece (3), nnz, n_vars: a `Pieces` row."""
        counts = [o.size for o in self.offsets]
        return np.array([*counts, *self.chunk_rows, self.nnz, self.n_vars], np.int64)


_NAMES = ("indptr", "data", "indices")
_DTYPES: dict = {}


def flat_from(layouts: dict, info) -> Flat | None:
    """A CSR matrix's `Flat` from its arrays' local `ByteLayout`s, or None.

    None for an object's: a `Flat` is read through a descriptor.
    """
    if set(layouts) != set(_NAMES) or is_url(info.path):
        return None
    ordered = [layouts[k] for k in _NAMES]
    if any(len(x.shape) != 1 for x in ordered):
        return None
    offsets, rows, dtypes = zip(
        *((x.offsets, x.chunk_rows, x.dtype) for x in ordered), strict=True
    )
    dtypes = _DTYPES.setdefault(dtypes, dtypes)  # files compare them by identity
    return Flat(offsets, rows, dtypes, info.nnz, info.n_vars)


class Pieces:
    """Every piece of every file's three arrays in one table, a row per file."""

    def __init__(self, offsets, counts, rows, nnz, n_vars, dtypes: tuple):
        self.offsets = offsets  # int64: file after file, arrays in `_NAMES` order
        self.rows, self.nnz, self.n_vars = rows, nnz, n_vars  # rows: (files, 3)
        totals = counts.sum(axis=1)
        first = np.cumsum(totals) - totals
        self.bases = first[:, None] + (np.cumsum(counts, axis=1) - counts)
        self.dtypes = dtypes
        self.itemsizes = [d.itemsize for d in dtypes]

    @classmethod
    def of(cls, flats: list[Flat]) -> Pieces:
        """The table of a fetch's `Flat`s (one dtype triple), row k: `flats[k]`."""
        offsets = np.concatenate([f.pieces for f in flats])
        meta = np.concatenate([f.meta for f in flats]).reshape(len(flats), -1)
        return cls(
            offsets, meta[:, :3], meta[:, 3:6], meta[:, 6], meta[:, 7], flats[0].dtypes
        )

    def pieces(self, k: int, ids, fds, starts, stops):
        """Array `k`'s ranges (of rows `ids`) split at chunks: fds, offsets, nbytes."""
        c = self.rows[ids, k]
        first = starts // c
        n_pieces = (stops - 1) // c - first + 1
        if int(n_pieces.sum()) == starts.size:
            chunk, p_start, p_stop, owner = first, starts, stops, slice(None)
        else:
            owner = np.repeat(np.arange(starts.size), n_pieces)
            chunk = expand_ranges(first, n_pieces)
            c = c[owner]
            p_start = np.maximum(starts[owner], chunk * c)
            p_stop = np.minimum(stops[owner], (chunk + 1) * c)
        size = self.itemsizes[k]
        base = self.bases[ids, k][owner]
        at = self.offsets[base + chunk] + (p_start - chunk * c) * size
        return fds[owner], at, (p_stop - p_start) * size


def split_indptr(ptr: np.ndarray, lengths, nnz, out: np.ndarray):
    """`(firsts, lasts)` of ranges' `indptr` slices `ptr`; rows' pointers into `out`.

    None if a slice decreases or leaves `[0, nnz]`.
    """
    heads = np.cumsum(lengths + 1) - (lengths + 1)
    firsts, lasts = ptr[heads], ptr[heads + lengths]
    step = np.diff(ptr)
    step[heads[1:] - 1] = 0  # the step from one range into the next
    if (step < 0).any() or (firsts < 0).any() or (lasts > nnz).any():
        return None
    spans = lasts - firsts
    # Row pointers relative to the values read: drop each range's head.
    body = np.ones(ptr.size, bool)
    body[heads] = False
    shift = np.repeat(firsts - (np.cumsum(spans) - spans), lengths)
    out[0] = 0
    np.subtract(ptr[body], shift, out=out[1:])
    return firsts, lasts


def read(table: Pieces, which, fds, group, starts, stops, buf, pool, check_indices):
    """The rows of ranges over a fetch's files as one CSR in `buf`, or None.

    Range j: local rows of file `group[j]`, row `which[group[j]]` of `table`
    (`which` None: row `group[j]`), read from `fds[group[j]]`. Returns
    `(data, indices, indptr, nnz_per_file)`, None if a check fails or a read is short.
    """
    keep = stops > starts
    group, starts, stops = group[keep], starts[keep], stops[keep]
    if starts.size > 1:  # merge ranges that touch, within a file
        joins = (starts[1:] == stops[:-1]) & (group[1:] == group[:-1])
        if joins.any():
            heads = np.concatenate([[0], np.flatnonzero(~joins) + 1])
            tails = np.concatenate([heads[1:] - 1, [starts.size - 1]])
            group, starts, stops = group[heads], starts[heads], stops[tails]
    ptr_t, data_t, index_t = table.dtypes
    n_files = len(fds)
    fds = np.asarray(fds, np.int64)[group]
    ids = group if which is None else which[group]
    lengths = stops - starts
    n_rows = int(lengths.sum())
    # Every range's indptr slice: one entry more than its rows.
    ptr = buf.get("ptr", (n_rows + starts.size,), ptr_t)
    try:
        _pread(None, ptr, *table.pieces(0, ids, fds, starts, stops + 1))
    except ShortReadError:
        return None
    nnz = table.nnz[ids]
    indptr = buf.get("indptr", (n_rows + 1,), np.int64)
    ends = split_indptr(ptr.astype(np.int64, copy=False), lengths, nnz, indptr)
    if ends is None:
        return None
    spans = ends[1] - ends[0]
    total = int(spans.sum())
    data = buf.get("data", (total,), data_t)
    indices = buf.get("indices", (total,), index_t)
    some = spans > 0
    g, a, b = ids[some], ends[0][some], ends[1][some]
    try:
        for k, out in ((1, data), (2, indices)):
            _pread(pool, out, *table.pieces(k, g, fds[some], a, b))
    except ShortReadError:
        return None
    per_file = np.bincount(group, spans, n_files).astype(np.int64)
    if check_indices and total:  # negative indices viewed unsigned exceed n_vars
        unsigned = indices.view(np.dtype(f"u{indices.dtype.itemsize}"))
        n_vars = table.n_vars if which is None else table.n_vars[which]
        top = int(unsigned.max())
        if top >= n_vars.min() and not (unsigned < np.repeat(n_vars, per_file)).all():
            return None
    return data, indices, indptr, per_file


def advise(table: Pieces, which, fds, group, starts, stops, buf) -> None:
    """Hints the OS to read these rows' values: `read`'s hint, all files at once.

    Reads the ranges' `indptr` ends, then advises the `data` and `indices` pieces.
    """
    keep = stops > starts
    group, starts, stops = group[keep], starts[keep], stops[keep]
    if starts.size == 0:
        return
    fds = np.asarray(fds, np.int64)[group]
    if which is not None:
        group = which[group]  # rows of `table` from here on
    lengths = stops - starts
    long = lengths > _SLICE_ROWS
    n, n_long = starts.size, int(long.sum())
    if n_long:  # short ranges first, then long ones
        order = np.argsort(long, kind="stable")
        group, fds, starts, stops, lengths, long = (
            x[order] for x in (group, fds, starts, stops, lengths, long)
        )
    # Pieces: each range's slice (a long one: its first entry), then the
    # last entries of long ranges.
    p_starts = np.concatenate([starts, stops[n - n_long :]])
    p_stops = np.concatenate([np.where(long, starts, stops), stops[n - n_long :]]) + 1
    p_group = np.concatenate([group, group[n - n_long :]])
    p_fds = np.concatenate([fds, fds[n - n_long :]])
    sizes = p_stops - p_starts
    heads = np.cumsum(sizes) - sizes
    ends = buf.get("advise_ptr", (int(sizes[-1] + heads[-1]),), table.dtypes[0])
    f, at, nbytes = table.pieces(0, p_group, p_fds, p_starts, p_stops)
    pieces = (f, at, nbytes, np.cumsum(nbytes) - nbytes)
    view = ends.reshape(-1).view(np.uint8)
    fd_, at_, n_, to_ = (x.tolist() for x in pieces)
    ok = np.array(pread_cached(fd_, view, at_, n_, to_), bool)
    if not ok.all():
        fd_, at_, n_, to_ = (x[~ok].tolist() for x in pieces)
        try:
            pread_pieces(fd_, view, at_, n_, to_)
        except (ShortReadError, OSError):
            return
    last_at = heads[:n] + lengths
    last_at[n - n_long :] = heads[n:]
    firsts = ends[heads[:n]].astype(np.int64)
    lasts = ends[last_at].astype(np.int64)
    nnz = table.nnz[group]
    some = (firsts < lasts) & (firsts >= 0) & (lasts <= nnz)
    g, a, b = group[some], firsts[some], lasts[some]
    for k in (1, 2):
        f, at, nbytes = table.pieces(k, g, fds[some], a, b)
        advise_uncached(f.tolist(), at.tolist(), nbytes.tolist())


def _pread(pool, out: np.ndarray, fds, offsets, nbytes) -> None:
    """Reads pieces into `out` back to back (threads when large)."""
    dest = out.reshape(-1).view(np.uint8)
    ends = np.cumsum(nbytes)
    total = int(ends[-1]) if ends.size else 0
    starts = ends - nbytes
    jobs = 1
    if pool is not None:
        jobs = min(
            getattr(pool, "threads", 4), nbytes.size, total // _MIN_BYTES_PER_THREAD
        )
    cuts = []
    if jobs > 1:
        cuts = np.searchsorted(ends, np.linspace(0, total, jobs + 1)[1:-1]).tolist()
    parts = [
        (fds[a:b].tolist(), dest, *(x[a:b].tolist() for x in (offsets, nbytes, starts)))
        for a, b in itertools.pairwise([0, *cuts, nbytes.size])
        if b > a
    ]
    if len(parts) == 1:
        pread_pieces(*parts[0])
    else:  # none still writes into `dest` once this returns
        wait_all([pool.submit(pread_pieces, *p) for p in parts])

"""Pre-shuffled copies of `.h5ad` files, written once, read as plain AnnData.

Block sampling reads contiguous blocks; on a plate-sorted file a block holds
cells of one plate, so minibatches are less diverse than random sampling.
`preshuffle` writes a copy of one or many files with the cells in a seeded
random order across all inputs. Afterwards contiguous blocks of any size are
random samples, so a loader can use large blocks (fast reads) at the
diversity of random sampling. The copy is ordinary `.h5ad`: anndata and
scanpy open it as usual (also backed), and `AnnDataSource` reads it on its
positional-read fast path when it is uncompressed.

**Algorithm: a windowed gather.** A seeded permutation maps each output
position to an input row. Each output part is written in windows of
consecutive output cells, sized from `memory_budget_bytes` and the exact
number of stored values of the cells in the window. For each window the
input rows it needs are sorted, split at file boundaries and read in batches
(`AnnDataSource.fetch_ranges`: positional reads of each row's values, runs of
consecutive rows coalesced), scattered into the window's arrays in output
order, and the window is appended to the output with one HDF5 write per
dataset. Every input value is read once and every output value written once,
with no temporary copy on disk.

Why not a two-pass bucket sort (stream the input, append each row to a
temporary file per output window, then shuffle one bucket at a time)? It
turns random reads into sequential ones, but doubles the disk traffic and
needs scratch space as large as the input. When the inputs fit in the page
cache (the common case for files up to a few tens of GB), random row reads
cost a few microseconds each and the gather is cheaper. Measured with
`benchmarks/preshuffle.py` on this project's shared 2-core machine, 400,000
Tahoe-shaped cells (5.2 GB, uncompressed CSR) into one part at the default
budget: about 50 s per million cells with the input in the page cache, 77 s
with it evicted, peak RSS 2.0 GB. The write is the bottleneck there: this
disk sustains about 350 MB/s once the kernel's dirty-page limit is reached,
so the 5.2 GB of output alone take about 15 s. For inputs far larger than RAM
on a slow disk, each window costs one random read per cell; give it a large
`memory_budget_bytes` (fewer, denser sweeps over the inputs). Compressed
inputs decode every chunk a read batch touches (in threads, see
`grain_cells.chunks`; through h5py for filters decoded there only): use a
large budget so that a chunk serves many cells of one batch.

**Output layout.** `X` is CSR when the inputs are sparse (`data`, `indices`
int32 when the genes allow, `indptr` int64) or dense when they are dense.
`data` and `indices` are chunked: by default about 4 MiB of values per chunk
uncompressed (about 650 Tahoe-sized cells, so a random block of 16 to 1,024
cells rarely straddles a chunk and chunks written in one call lie back to
back in the file, where the positional reader merges them into one read) and
256 KiB compressed (so a block read decompresses little beyond the block).
Uncompressed chunks carry no filter, which the positional fast path needs.
`indptr` is never compressed (8 bytes per cell; every read starts with it).
Dense `X` is chunked by whole rows for the same reason.

**Restarts.** Each part is written under a temporary name in the output
folder and renamed when complete; the finished file carries an attribute
(`grain_cells_preshuffle`, JSON) recording the inputs (path, size,
modification time, cell count), seed, layer, obs columns, compression,
chunking, part index and part count. A rerun with the same arguments skips
the parts whose file opens and carries the same record, and rewrites the rest
(a part is the unit of work lost to an interruption: choose `cells_per_file`
accordingly). Leftover temporary files are deleted at the start of a run.
Two runs must not write to one folder at once. `preshuffle.json`, written
last, lists the parts with per-part statistics.

**Overlap.** Once the kernel's dirty-page limit is reached, writing is
disk-bound; a background thread writes one window (h5py releases the GIL
while HDF5 writes) while the calling thread reads and scatters the next.

Memory: the arrays of the two windows in flight plus a read buffer, together
at most `memory_budget_bytes`; on top of that about 8 bytes per input cell
(the permutation and row lengths) and the chosen obs columns of all inputs
(held in memory while the parts are written).
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
import pathlib
import queue
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Sequence

import anndata
import h5py
import numpy as np
import pandas as pd

from grain_cells import errors, h5ad
from grain_cells.matrix import RowBuffer
from grain_cells.source import AnnDataSource

try:  # anndata >= 0.11
    from anndata.io import read_elem
except ImportError:  # pragma: no cover - anndata 0.10
    from anndata.experimental import read_elem

MANIFEST = "preshuffle.json"
"""Name of the manifest written last into the output folder."""

MARKER_ATTR = "grain_cells_preshuffle"
"""Root attribute of a complete output part (JSON: what it was made from)."""

_FORMAT = 1  # bump when the output of identical arguments changes
_COMPRESSIONS = (None, "gzip", "lzf")
_GZIP_LEVEL = 1  # "light": most of gzip's gain at a fraction of its cost
_CHUNK_BYTES = 4 << 20  # default chunk of data/indices, uncompressed
_CHUNK_BYTES_COMPRESSED = 256 << 10  # same, compressed
_INDPTR_CHUNK = 1 << 16  # elements per chunk of indptr (512 KiB)
_MAX_CHUNK_BYTES = (1 << 31) - 1  # HDF5 caps a chunk below 4 GiB; stay well under
_WINDOW_SHARE = 0.7  # of the budget: the arrays of the windows in flight
_SLOTS = 2  # windows in flight: one assembled while the other is written
_READ_SHARE = 0.1  # of the budget: one read (its buffer may double on growth)
_PROGRESS_EVERY_S = 0.5


def preshuffle(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    output_dir: str | os.PathLike,
    *,
    cells_per_file: int | None = None,
    seed: int = 0,
    layer: str | None = None,
    obs_columns: Sequence[str] | None = None,
    compression: str | None = None,
    chunk_cells: int | None = None,
    memory_budget_bytes: int = 2 << 30,
    progress: bool = True,
) -> list[pathlib.Path]:
    """Writes the cells of `inputs` in a seeded random order as new `.h5ad` files.

    The inputs are concatenated along cells (they must list the same genes in
    the same order) and shuffled together, so every output part mixes cells
    of every input. Parts are named `part-00000.h5ad`, `part-00001.h5ad`, ...
    in `output_dir`. See the module docstring for the algorithm, the layout
    and how interrupted runs resume.

    Each part holds: `X` (the chosen matrix of the inputs, CSR or dense as
    stored), `obs` (the chosen columns and the obs names; categorical columns
    keep their categories, merged over the inputs in order of first
    appearance) and `var` (copied from the first input; `raw/var` when
    `layer="raw"`). Other elements (layers, obsm, uns, ...) are not copied.

    Example:
        >>> parts = preshuffle(["plate1.h5ad", "plate2.h5ad"], "/data/shuffled",
        ...                    cells_per_file=1_000_000, seed=0)
        >>> source = grain_cells.AnnDataSource(parts, block_size=256,
        ...                                    obs_columns=["cell_line"])
        >>> anndata.read_h5ad(parts[0], backed="r")  # plain AnnData

    Args:
        inputs: One `.h5ad` path or a sequence of them, concatenated in order.
        output_dir: Folder for the parts, created if missing.
        cells_per_file: Cells per output part (the last part holds the rest);
            None writes one part.
        seed: Seed of the permutation (an int >= 0). Same seed and inputs give
            the same order.
        layer: Matrix to copy as `X`: None for `X`, `"raw"` for `raw/X`, any
            other name for `layers/<name>`.
        obs_columns: obs columns to carry; None carries every column of the
            first input (the others must have them too).
        compression: None (default, enables the positional-read fast path),
            `"gzip"` (level 1, with the shuffle filter) or `"lzf"`.
        chunk_cells: Cells per HDF5 chunk of the output matrix (for CSR, the
            chunk of `data`/`indices` holds `chunk_cells` times the mean
            stored values per cell). None: about 4 MiB of values per chunk
            uncompressed, 256 KiB compressed.
        memory_budget_bytes: Bytes of matrix values held at once: two windows
            (one being assembled while the other is written) plus the read
            buffer. A window holds at least one cell, whatever the budget.
        progress: Print a one-line progress report to stderr.

    Returns:
        The paths of the parts, in order.

    Raises:
        ValueError: `inputs` is empty, an argument is out of range, or an
            input would be overwritten by an output part.
        NotADirectoryError: `output_dir` exists and is not a folder.
        FileNotFoundError: An input does not exist.
        errors.GeneMismatchError: The inputs list different var names.
        errors.MissingColumnError: An obs column, layer or X is missing.
        errors.UnsupportedLayoutError: A matrix is CSC, or sparse in some
            inputs and dense in others.
        errors.AnnDataFormatError: An input is not readable AnnData, or an obs
            column cannot be merged over the inputs.
    """
    plan = _Plan.make(
        inputs,
        output_dir,
        cells_per_file=cells_per_file,
        seed=seed,
        layer=layer,
        obs_columns=obs_columns,
        compression=compression,
        chunk_cells=chunk_cells,
        memory_budget_bytes=memory_budget_bytes,
    )
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    _remove_temporaries(plan.output_dir)
    done = {i: _completed_marker(p, plan, i) for i, p in enumerate(plan.part_paths)}
    todo = [i for i, marker in done.items() if marker is None]
    report = _Progress(plan, todo, enabled=progress)
    try:
        if todo:
            writer = _Writer(plan)
            for i in todo:
                done[i] = writer.write_part(i, report)
        report.finish()
    finally:
        plan.source.close()
    _remove_stale_parts(plan)
    _write_manifest(plan, done)
    return list(plan.part_paths)


# --------------------------------------------------------------------------- #
# What to write.
# --------------------------------------------------------------------------- #


class _Plan:
    """Validated arguments, the inputs' metadata and the output layout."""

    @classmethod
    def make(cls, inputs, output_dir, **kwargs) -> _Plan:
        self = cls()
        try:
            paths = h5ad.resolve_paths(inputs)
        except ValueError:
            raise ValueError(
                "inputs is empty: expected one or more .h5ad files"
            ) from None
        output_dir = pathlib.Path(output_dir)
        if output_dir.exists() and not output_dir.is_dir():
            raise NotADirectoryError(
                f"{output_dir}: exists and is not a folder; output_dir must be a "
                "folder (it is created if missing)"
            )
        cells_per_file = kwargs["cells_per_file"]
        if cells_per_file is not None:
            _check_int("cells_per_file", cells_per_file, 1)
        _check_int("seed", kwargs["seed"], 0)
        chunk_cells = kwargs["chunk_cells"]
        if chunk_cells is not None:
            _check_int("chunk_cells", chunk_cells, 1)
        budget = kwargs["memory_budget_bytes"]
        _check_int("memory_budget_bytes", budget, 1)
        compression = kwargs["compression"]
        if compression not in _COMPRESSIONS:
            raise ValueError(
                "compression must be None, 'gzip' or 'lzf', got "
                f"compression={compression!r}"
            )
        layer = kwargs["layer"]
        obs_columns = kwargs["obs_columns"]
        if isinstance(obs_columns, str):
            obs_columns = [obs_columns]

        # Checks every input: AnnData, same genes, a usable matrix.
        self.source = AnnDataSource(paths, block_size=1, layer=layer, read_threads=0)
        self.paths = list(self.source.paths)
        self.element = h5ad.matrix_element(layer)
        with h5ad.open_file(self.paths[0]) as f:
            first_columns = h5ad.obs_columns(f)
        if obs_columns is None:
            obs_columns = first_columns
        obs_columns = [str(c) for c in obs_columns]
        if len(set(obs_columns)) != len(obs_columns):
            raise ValueError(f"obs_columns has duplicates: {obs_columns}")
        for path in self.paths:
            with h5ad.open_file(path) as f:
                have = h5ad.obs_columns(f)
            missing = [c for c in obs_columns if c not in have]
            if missing:
                raise errors.MissingColumnError(
                    f"{path}: obs has no column(s) {missing}; it has {have}. Pass "
                    "obs_columns=[...] naming columns every input has."
                )
        self.obs_columns = obs_columns

        self.output_dir = output_dir
        self.n_cells = self.source.num_cells
        self.n_vars = len(self.source.var_names)
        self.sparse = self.source.is_sparse
        self.dtype = np.dtype(self.source.dtype)
        self.index_dtype = np.dtype(np.int32 if self.n_vars < 2**31 else np.int64)
        self.nnz = (
            sum(self.source.file_info(i).nnz for i in range(len(self.paths)))
            if self.sparse
            else None
        )
        self.seed = int(kwargs["seed"])
        self.compression = compression
        self.chunk_cells = chunk_cells
        self.budget = int(budget)
        size = cells_per_file or max(self.n_cells, 1)
        n_parts = max(1, -(-self.n_cells // size))
        self.part_bounds = [
            (i * size, min((i + 1) * size, self.n_cells)) for i in range(n_parts)
        ]
        self.part_paths = [output_dir / f"part-{i:05d}.h5ad" for i in range(n_parts)]
        for path in self.paths:
            for part in self.part_paths:
                if part.exists() and os.path.samefile(path, part):
                    raise ValueError(
                        f"{path}: is an input and also output part {part.name} of "
                        f"{output_dir}; write the parts to another folder"
                    )
        self.fingerprint = _json_normal(
            {
                "format": _FORMAT,
                "inputs": [
                    _describe_input(p, self.source.file_info(i).n_obs)
                    for i, p in enumerate(self.paths)
                ],
                "layer": layer,
                "obs_columns": obs_columns,
                "seed": self.seed,
                "cells_per_file": cells_per_file,
                "compression": compression,
                "chunk_cells": chunk_cells,
            }
        )
        return self

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value of a CSR matrix (data plus index)."""
        return self.dtype.itemsize + self.index_dtype.itemsize

    def chunk_elements(self) -> int:
        """Elements per HDF5 chunk of `data`/`indices` (CSR)."""
        mean = self.nnz / max(self.n_cells, 1)
        if self.chunk_cells is not None:
            n = math.ceil(self.chunk_cells * max(mean, 1.0))
        else:
            target = (
                _CHUNK_BYTES if self.compression is None else _CHUNK_BYTES_COMPRESSED
            )
            n = target // self.dtype.itemsize
        return int(min(max(n, 1), _MAX_CHUNK_BYTES // 8))

    def chunk_rows(self) -> int:
        """Rows per HDF5 chunk of a dense X."""
        row_bytes = max(self.n_vars * self.dtype.itemsize, 1)
        if self.chunk_cells is not None:
            n = self.chunk_cells
        else:
            target = (
                _CHUNK_BYTES if self.compression is None else _CHUNK_BYTES_COMPRESSED
            )
            n = target // row_bytes
        return int(min(max(n, 1), max(_MAX_CHUNK_BYTES // row_bytes, 1)))


def _describe_input(path: str, n_obs: int) -> dict:
    st = os.stat(path)
    return {
        "path": os.path.abspath(path),
        "cells": n_obs,
        "bytes": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def _json_normal(value):
    return json.loads(json.dumps(value))


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {name}={value!r}")
    if value < low:
        what = "positive" if low == 1 else f">= {low}"
        raise ValueError(f"{name} must be {what}, got {name}={value!r}")


# --------------------------------------------------------------------------- #
# Completion, temporaries, manifest.
# --------------------------------------------------------------------------- #


def _completed_marker(path: pathlib.Path, plan: _Plan, index: int) -> dict | None:
    """The part's marker if `path` is a complete part of this run, else None."""
    if not path.is_file():
        return None
    try:
        with h5ad.open_file(path) as f:
            raw = f.attrs.get(MARKER_ATTR)
            if raw is None:
                return None
            marker = json.loads(raw)
            if (
                marker.get("fingerprint") != plan.fingerprint
                or marker.get("part") != index
                or marker.get("parts") != len(plan.part_paths)
            ):
                return None
            info = h5ad.inspect_matrix(f, "X")
            if info.n_obs != marker.get("cells") or info.nnz != marker.get("nnz"):
                return None
            return marker
    except Exception:  # unreadable, truncated, foreign: not complete
        return None


def _create_temporary(directory: pathlib.Path, name: str):
    """Creates `.<name>.<random>.tmp` in `directory`: `(fd, path)`.

    Unlike `tempfile.mkstemp` (mode 0600), the file gets the permissions of
    any new file (0666 less the umask), which the renamed output keeps.
    """
    while True:
        path = directory / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        return fd, path


def _remove_temporaries(output_dir: pathlib.Path) -> None:
    """Deletes temporaries left by an interrupted run (see `_create_temporary`)."""
    for pattern in (".part-*.h5ad.*.tmp", f".{MANIFEST}.*.tmp"):
        for path in output_dir.glob(pattern):
            path.unlink(missing_ok=True)


def _remove_stale_parts(plan: _Plan) -> None:
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


def _write_manifest(plan: _Plan, markers: dict[int, dict]) -> None:
    manifest = {
        "format": _FORMAT,
        "fingerprint": plan.fingerprint,
        "cells": plan.n_cells,
        "parts": [
            {"file": plan.part_paths[i].name, **markers[i]["stats"]}
            for i in range(len(plan.part_paths))
        ],
    }
    final = plan.output_dir / MANIFEST
    fd, tmp = _create_temporary(plan.output_dir, MANIFEST)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- #
# Writing.
# --------------------------------------------------------------------------- #


class _Writer:
    """Writes the parts of a plan; holds the permutation and obs in memory."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        n = plan.n_cells
        # Generator.permutation(n) is arange(n) shuffled; shuffling int32 in
        # place gives the same order with half the memory.
        self.perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
        np.random.default_rng(plan.seed).shuffle(self.perm)
        self.offsets = plan.source.cell_offsets
        self.lengths = _row_lengths(plan) if plan.sparse else None
        self.obs = _read_obs(plan.paths, plan.obs_columns)
        self.var = _read_var(plan.paths[0], plan.element)
        self.buffer = RowBuffer()

    def write_part(self, index: int, report: _Progress) -> dict:
        """Writes part `index` under a temporary name, then renames it."""
        plan = self.plan
        final = plan.part_paths[index]
        start, stop = plan.part_bounds[index]
        rows = self.perm[start:stop]
        t0 = time.perf_counter()
        fd, tmp = _create_temporary(plan.output_dir, final.name)
        os.close(fd)
        try:
            _write_frames(tmp, self.obs.iloc[rows], self.var)
            with h5py.File(tmp, "a") as f:
                if plan.sparse:
                    nnz, windows, largest = self._write_csr(f, rows, report)
                else:
                    nnz, windows, largest = self._write_dense(f, rows, report)
                marker = {
                    "fingerprint": plan.fingerprint,
                    "part": index,
                    "parts": len(plan.part_paths),
                    "cells": int(rows.size),
                    "nnz": nnz,
                    "stats": {
                        "cells": int(rows.size),
                        "nnz": nnz,
                        "windows": windows,
                        "largest_window_bytes": largest,
                        "seconds": round(time.perf_counter() - t0, 3),
                    },
                }
                f.attrs[MARKER_ATTR] = json.dumps(marker)
            _fsync_path(tmp)
            os.replace(tmp, final)
            _fsync_path(plan.output_dir)
        finally:
            tmp.unlink(missing_ok=True)
        return marker

    # -- CSR ---------------------------------------------------------------

    def _write_csr(self, f: h5py.File, rows: np.ndarray, report: _Progress):
        plan = self.plan
        n = rows.size
        lengths = self.lengths[rows]
        indptr = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=indptr[1:])
        nnz = int(indptr[-1])
        group = f.create_group("X")
        group.attrs["encoding-type"] = h5ad.CSR
        group.attrs["encoding-version"] = "0.1.0"
        group.attrs["shape"] = np.array([n, plan.n_vars], np.int64)
        opts = _filter_options(plan.compression)
        chunk = plan.chunk_elements()
        data = group.create_dataset(
            "data", (nnz,), plan.dtype, maxshape=(None,), chunks=(chunk,), **opts
        )
        indices = group.create_dataset(
            "indices",
            (nnz,),
            plan.index_dtype,
            maxshape=(None,),
            chunks=(chunk,),
            **opts,
        )
        group.create_dataset(
            "indptr",
            data=indptr,
            maxshape=(None,),
            chunks=(min(_INDPTR_CHUNK, n + 1),),
        )
        # Bytes through each cell: its values plus its indptr entry.
        through = indptr[1:] * plan.value_bytes + np.arange(1, n + 1) * 8
        bounds = self._windows(through)
        most = max(
            (int(indptr[b] - indptr[a]) for a, b in itertools.pairwise(bounds)),
            default=0,
        )

        def assemble(slot: _Slot, a: int, b: int):
            lo, hi = int(indptr[a]), int(indptr[b])
            out_data = slot.array("data", most, plan.dtype)[: hi - lo]
            out_indices = slot.array("indices", most, plan.index_dtype)[: hi - lo]
            out_ptr = (indptr[a : b + 1] - lo).tolist()
            for sub_rows, dest in self._reads(rows[a:b]):
                starts, stops = _runs(sub_rows)
                got = plan.source.fetch_ranges(starts, stops, buffer=self.buffer)
                _check_rows(got.row_ids, sub_rows)
                _scatter_csr(got.csr, dest, out_ptr, out_data, out_indices)

            def write():
                data[lo:hi] = out_data
                indices[lo:hi] = out_indices

            return write

        self._run_windows(bounds, assemble, report)
        return nnz, len(bounds) - 1, most * plan.value_bytes

    # -- dense -------------------------------------------------------------

    def _write_dense(self, f: h5py.File, rows: np.ndarray, report: _Progress):
        plan = self.plan
        n = rows.size
        chunk_rows = min(plan.chunk_rows(), max(n, 1))
        x = f.create_dataset(
            "X",
            (n, plan.n_vars),
            plan.dtype,
            chunks=(chunk_rows, plan.n_vars) if n and plan.n_vars else None,
            **(_filter_options(plan.compression) if n and plan.n_vars else {}),
        )
        x.attrs["encoding-type"] = h5ad.DENSE
        x.attrs["encoding-version"] = "0.2.0"
        row_bytes = max(plan.n_vars * plan.dtype.itemsize, 1)
        through = np.arange(1, n + 1, dtype=np.int64) * row_bytes
        bounds = self._windows(through)
        most = max((b - a for a, b in itertools.pairwise(bounds)), default=0)

        def assemble(slot: _Slot, a: int, b: int):
            out = slot.array("X", most * plan.n_vars, plan.dtype)
            out = out[: (b - a) * plan.n_vars].reshape(b - a, plan.n_vars)
            for sub_rows, dest in self._reads(rows[a:b]):
                starts, stops = _runs(sub_rows)
                got = plan.source.fetch_ranges(starts, stops, buffer=self.buffer)
                _check_rows(got.row_ids, sub_rows)
                out[dest] = got.dense[: sub_rows.size]

            def write():
                x[a:b] = out

            return write

        self._run_windows(bounds, assemble, report)
        return None, len(bounds) - 1, most * row_bytes

    # -- windows -----------------------------------------------------------

    def _windows(self, through: np.ndarray) -> list[int]:
        """Window boundaries: each window's arrays fit one slot of the budget."""
        return _cuts(through, int(self.plan.budget * _WINDOW_SHARE / _SLOTS))

    def _run_windows(self, bounds: list[int], assemble, report: _Progress) -> None:
        """Assembles window after window; a second thread writes the last one.

        Writing is disk-bound once the kernel's dirty-page limit is reached,
        and h5py releases the GIL while HDF5 writes, so the next window's
        reads and scatter run meanwhile. `_SLOTS` windows exist at once.
        """
        with _WritePipeline(_SLOTS) as pipeline:
            for a, b in itertools.pairwise(bounds):
                slot = pipeline.free_slot()
                pipeline.submit(
                    slot, assemble(slot, a, b), lambda n=b - a: report.advance(n)
                )

    # -- reads -------------------------------------------------------------

    def _reads(self, window_rows: np.ndarray):
        """Yields `(sorted input rows, their positions in the window)` batches.

        Batches hold rows of one file, sorted, at most about
        `_READ_SHARE * budget` bytes each.
        """
        plan = self.plan
        order = np.argsort(window_rows, kind="stable")
        rows = window_rows[order].astype(np.int64)
        if plan.sparse:
            sizes = self.lengths[rows].astype(np.int64) * plan.value_bytes + 8
        else:
            sizes = np.full(rows.size, plan.n_vars * plan.dtype.itemsize + 1)
        cap = int(plan.budget * _READ_SHARE)
        file_bounds = np.searchsorted(rows, self.offsets[1:-1], side="left")
        edges = [0, *file_bounds.tolist(), rows.size]
        for fa, fb in itertools.pairwise(edges):
            if fb <= fa:
                continue
            cuts = _cuts(np.cumsum(sizes[fa:fb]), cap)
            for a, b in itertools.pairwise(cuts):
                yield rows[fa + a : fa + b], order[fa + a : fa + b]


class _Slot:
    """Arrays of one window, allocated once at the largest window's size."""

    def __init__(self):
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, name: str, size: int, dtype) -> np.ndarray:
        arr = self._arrays.get(name)
        if arr is None or arr.size < size or arr.dtype != dtype:
            arr = self._arrays[name] = np.empty(size, dtype)
        return arr


class _WritePipeline:
    """Runs write jobs in one background thread, `slots` windows at a time.

    `free_slot()` blocks until a window's arrays are free (written); a failed
    write is raised in the calling thread at its next call or on exit.
    """

    def __init__(self, slots: int):
        self._free: queue.Queue = queue.Queue()
        for _ in range(slots):
            self._free.put(_Slot())
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name="grain_cells_preshuffle_write", daemon=True
        )
        self._thread.start()

    def free_slot(self) -> _Slot:
        while True:
            self._raise_if_failed()
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue

    def submit(self, slot: _Slot, write, done) -> None:
        self._raise_if_failed()
        self._jobs.put((slot, write, done))

    def __enter__(self) -> _WritePipeline:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._jobs.put(None)
        self._thread.join()
        if exc_type is None:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            slot, write, done = job
            if self._error is None:
                try:
                    write()
                    done()
                except BaseException as e:  # re-raised in the caller's thread
                    self._error = e
            self._free.put(slot)


def _filter_options(compression: str | None) -> dict:
    if compression is None:
        return {}
    if compression == "gzip":
        return {"compression": "gzip", "compression_opts": _GZIP_LEVEL, "shuffle": True}
    return {"compression": compression, "shuffle": True}


def _cuts(through: np.ndarray, cap: int) -> list[int]:
    """Splits items into consecutive groups of at most `cap` bytes each.

    Args:
        through: Cumulative bytes through each item (non-decreasing).
        cap: Bytes per group; a single larger item makes a group of its own.

    Returns:
        Group boundaries `[0, ..., len(through)]`.
    """
    n = int(through.size)
    bounds = [0]
    while bounds[-1] < n:
        a = bounds[-1]
        base = int(through[a - 1]) if a else 0
        b = int(np.searchsorted(through, base + cap, side="right"))
        bounds.append(max(b, a + 1))
    return bounds


def _runs(sorted_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranges `[starts, stops)` of consecutive ids in sorted distinct rows."""
    breaks = np.flatnonzero(np.diff(sorted_rows) != 1) + 1
    starts = sorted_rows[np.concatenate([[0], breaks])]
    stops = sorted_rows[np.concatenate([breaks - 1, [sorted_rows.size - 1]])] + 1
    return starts, stops


def _check_rows(got: np.ndarray, wanted: np.ndarray) -> None:
    if got.shape != wanted.shape or not np.array_equal(got, wanted):
        raise RuntimeError(
            "AnnDataSource.fetch_ranges returned rows in an unexpected order; "
            "preshuffle relies on it returning sorted ranges of one file in order"
        )


def _scatter_csr(src, dest: np.ndarray, out_ptr: list, out_data, out_indices):
    """Copies each buffered row `k` to window row `dest[k]`."""
    ptr = src.indptr.tolist()
    data, indices = src.data, src.indices
    for s0, s1, r in zip(ptr[:-1], ptr[1:], dest.tolist(), strict=True):
        if s1 > s0:
            o = out_ptr[r]
            out_data[o : o + s1 - s0] = data[s0:s1]
            out_indices[o : o + s1 - s0] = indices[s0:s1]


def _row_lengths(plan: _Plan) -> np.ndarray:
    """Stored values per input row, over all inputs (int32)."""
    out = np.empty(plan.n_cells, np.int32)
    pos = 0
    step = 1 << 22
    for path in plan.paths:
        with h5ad.open_file(path) as f:
            ptr = f[plan.element]["indptr"]
            n = ptr.shape[0] - 1
            for a in range(0, n, step):
                b = min(a + step, n)
                piece = ptr[a : b + 1].astype(np.int64)
                out[pos + a : pos + b] = np.diff(piece)
            pos += n
    return out


# --------------------------------------------------------------------------- #
# obs and var.
# --------------------------------------------------------------------------- #


def _read_obs(paths: list[str], columns: list[str]) -> pd.DataFrame:
    """The chosen obs columns of all inputs, concatenated, with obs names."""
    names, per_column = [], {c: [] for c in columns}
    for path in paths:
        with h5ad.open_file(path) as f:
            group = f["obs"]
            index_key = group.attrs.get("_index", "_index")
            if isinstance(index_key, bytes):
                index_key = index_key.decode()
            legacy = None
            try:
                names.append(np.asarray(read_elem(group[index_key]), dtype=object))
                for c in columns:
                    elem = group[c]
                    if isinstance(elem, h5py.Dataset) and "categories" in elem.attrs:
                        # anndata < 0.8: codes here, categories in __categories;
                        # only the whole-dataframe reader resolves them.
                        if legacy is None:
                            with warnings.catch_warnings():
                                warnings.simplefilter(
                                    "ignore", anndata.OldFormatWarning
                                )
                                legacy = read_elem(group)
                        per_column[c].append(pd.Series(legacy[c].array))
                    else:
                        per_column[c].append(pd.Series(read_elem(elem)))
            except Exception as e:
                raise errors.AnnDataFormatError(
                    f"{path}: obs cannot be read as an anndata dataframe "
                    f"({type(e).__name__}: {e}); the file may be corrupt"
                ) from e
    index = pd.Index(np.concatenate(names) if names else [], dtype=object)
    frame = {c: _concat_column(c, per_column[c], paths) for c in columns}
    return pd.DataFrame(frame, index=index)


def _concat_column(name: str, parts: list[pd.Series], paths: list[str]):
    categorical = [isinstance(p.dtype, pd.CategoricalDtype) for p in parts]
    if all(categorical):
        if len(parts) == 1:
            return parts[0].array
        try:
            return pd.api.types.union_categoricals(
                [p.array for p in parts], sort_categories=False
            )
        except TypeError as e:
            raise errors.AnnDataFormatError(
                f"obs column {name!r}: its categories cannot be merged over "
                f"{paths} ({e}); expected unordered categoricals, or ordered ones "
                "with the same categories"
            ) from e
    if any(categorical):
        which = [p for p, c in zip(paths, categorical, strict=True) if c]
        other = [p for p, c in zip(paths, categorical, strict=True) if not c]
        raise errors.AnnDataFormatError(
            f"obs column {name!r} is categorical in {which} but "
            f"{parts[categorical.index(False)].dtype} in {other}; expected the "
            "same kind in every input (leave it out with obs_columns=[...])"
        )
    if len(parts) == 1:
        return parts[0].array
    return pd.concat(parts, ignore_index=True).array


def _read_var(path: str, element: str) -> pd.DataFrame:
    with h5ad.open_file(path) as f:
        group = f["raw/var"] if element == "raw/X" else f["var"]
        try:
            var = read_elem(group)
        except Exception as e:
            raise errors.AnnDataFormatError(
                f"{path}: {group.name} cannot be read as an anndata dataframe "
                f"({type(e).__name__}: {e}); the file may be corrupt"
            ) from e
    return var


def _write_frames(path: pathlib.Path, obs: pd.DataFrame, var: pd.DataFrame) -> None:
    """Writes an AnnData skeleton (obs, var, no X) through anndata."""
    adata = anndata.AnnData(obs=obs, var=var)
    adata.write_h5ad(path, convert_strings_to_categoricals=False)


# --------------------------------------------------------------------------- #
# Progress.
# --------------------------------------------------------------------------- #


class _Progress:
    """A one-line progress report on stderr, updated at most twice a second."""

    def __init__(self, plan: _Plan, todo: list[int], enabled: bool):
        self.enabled = enabled
        self.total = sum(plan.part_bounds[i][1] - plan.part_bounds[i][0] for i in todo)
        self.skipped = len(plan.part_paths) - len(todo)
        self.parts = len(plan.part_paths)
        self.done = 0
        self.start = time.perf_counter()
        self.last = 0.0
        self.printed = False
        if enabled and self.skipped:
            print(
                f"preshuffle: {self.skipped} of {self.parts} part(s) already "
                f"complete in {plan.output_dir}",
                file=sys.stderr,
            )

    def advance(self, cells: int) -> None:
        self.done += cells
        now = time.perf_counter()
        if self.enabled and now - self.last >= _PROGRESS_EVERY_S:
            self.last = now
            self._print(now)

    def finish(self) -> None:
        if self.enabled and self.total:
            self._print(time.perf_counter())
            print(file=sys.stderr, flush=True)

    def _print(self, now: float) -> None:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        print(
            f"\rpreshuffle: {self.done:,}/{self.total:,} cells "
            f"({100 * self.done / max(self.total, 1):.0f}%) in {elapsed:.1f} s, "
            f"{rate:,.0f} cells/s",
            end="",
            file=sys.stderr,
            flush=True,
        )
        self.printed = True

"""`AnnDataSource`: one or many `.h5ad` files as a Grain random-access source.

**What a record is.** Grain's `DataLoader` reads one record at a time and
stripes records over its worker processes, so a record that held one cell
would scatter a block's cells over workers and lose the contiguous reads that
make block sampling fast. Each record of an `AnnDataSource` is therefore a
*block*: `block_size` contiguous cells of one file (blocks never straddle
files; the last block of a file may be short). `len(source)` is the number of
blocks and `source[k]` returns a `Block`, a small descriptor of which cells
block `k` holds.

Reading is deferred: the batched-fetch transform (`grain_cells.fetch`) groups
the blocks of a fetch and reads them all in one batched pass, straight into a
reused buffer. Grain pays about 25 µs per record even with no reader threads,
so a record must stand for many cells, and a batched read beats per-block
reads by several times. To read data directly, use `read(rows)`,
`read_ranges(starts, stops)` or `read_blocks(keys)`.

Each process opens each file lazily, once, under a lock (Grain's reader
threads race on first use); the source pickles without any open handle.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import h5py
import numpy as np
import scipy.sparse as sp

from grain_cells import arguments, errors, h5ad, object_store, remote_h5, selection
from grain_cells.byte_readers import ByteReader
from grain_cells.cells import Cells, take_csr
from grain_cells.genes import JOINS, align_genes, gather_dense, remap_csr
from grain_cells.identity import FileIdentity
from grain_cells.matrix import CsrReader, CsrRows, DenseReader, RowBuffer
from grain_cells.obs import OBS_MISSING, ColumnKind, harmonise

_log = logging.getLogger("grain_cells")


class Block(NamedTuple):
    """One record of an `AnnDataSource`: cells `[start, stop)` of the source.

    Attributes:
        index: The block's record key.
        file: Index of the file that holds it.
        start: First global row id (over the concatenated files).
        stop: One past the last global row id.
    """

    index: int
    file: int
    start: int
    stop: int


@dataclasses.dataclass
class _OpenFile:
    """A file's handles in one process."""

    h5: h5py.File
    fd: ByteReader | None
    reader: CsrReader | DenseReader
    obs: dict[str, np.ndarray]

    def close(self) -> None:
        if self.fd is not None:
            self.fd.close()
            self.fd = None
        self.h5.close()


@dataclasses.dataclass
class FetchedRows:
    """Rows of several ranges read into a reused buffer (unordered).

    Views stay valid until the same thread reads again. The rows are in
    output columns: genes aligned over files and the gene selection applied.

    Attributes:
        csr: The rows when the files are sparse, else None.
        dense: The rows when the files are dense, else None.
        row_ids: Global row id of each buffered row.
        obs: obs column name to one value per buffered row.
    """

    csr: CsrRows | None
    dense: np.ndarray | None
    row_ids: np.ndarray
    obs: dict[str, np.ndarray]


class AnnDataSource:
    """Cells of one or many `.h5ad` files, concatenated, as blocks.

    Implements Grain's `RandomAccessDataSource` protocol over *blocks* of
    `block_size` contiguous cells (see the module docstring for why). It is
    thread-safe, picklable without open handles, and its `repr` is stable
    (Grain compares it when restoring a checkpoint).

    Example:
        >>> source = AnnDataSource(["plate1.h5ad", "plate2.h5ad"],
        ...                        obs_columns=["cell_line"], block_size=16)
        >>> len(source)                      # blocks
        >>> cells = source.read([5, 3, 1000])  # any rows, in this order
        >>> cells.X                            # scipy.sparse.csr_matrix
        >>> cells.obs["cell_line"]             # integer codes
        >>> source.categories["cell_line"]     # their labels

    **Genes over several files.** `join` decides the genes a source outputs
    when files list different var names (`source.var_names`):

    * `"exact"` (default): every file must list the same var names in the
      same order; else `GeneMismatchError` names the first difference.
    * `"inner"`: the genes every file has, in the first file's order.
    * `"outer"`: every gene of any file: the first file's genes in order, then
      each later file's new genes in order of first appearance. A file reads
      0 for the genes it lacks (as `anndata.concat(join="outer")` does for
      sparse matrices).

    `genes` then selects and orders output genes within those: with
    `join="outer"`, `genes=[...]` gives a fixed gene list in which genes a
    file lacks read as 0 (each must be in some file). Genes are matched by
    name for `"inner"` and `"outer"` (var names must then be unique within
    each file), by position for `"exact"`.

        >>> source = AnnDataSource(paths, join="outer", genes=hvg_names)

    Alignment is applied as rows are read (one gather over the fetched
    values per file whose columns are not the output's; none when they are),
    so every read and output format sees output columns. Where a file stores
    its genes in another order than the output, a row's values keep the
    file's order: `Cells.X` from `read` is sorted (canonical CSR), but
    minibatches' `indices` may be unsorted within a row.

    **obs over several files.** A categorical column's codes index one shared
    category list (the first file's categories, then new ones in order of
    appearance), so a label has the same code in every file. A column some
    files lack raises `MissingColumnError` (`obs_missing="error"`, the
    default) or, with `obs_missing="fill"`, reads as missing in those files:
    code -1 for categorical columns, NaN for numeric ones, which then come
    back as floats (float64 for int32 and int64 columns). See
    `grain_cells.obs`.

    **Views over a subset of cells.** `source.select(cells, where=...)`
    returns a source over the matching cells only, its records blocks over
    runs of selected cells (never across a file or a gap);
    `grain_cells.split_by_fraction` and `split_by_obs` return such views,
    and `with_blocks(starts, stops)` builds one from any block table. A view
    keeps its block table (16 bytes per block) and its `repr` names a hash of
    it; row ids stay global. See `grain_cells.selection`.

        >>> b_cells = source.select(where={"cell_type": ["B"]})

    Memory per process: the chosen obs columns of the files read so far
    (one value per cell and column, in the smallest integer type that holds
    the codes), the column maps of files whose genes differ from the output
    (4 bytes per stored gene, shared by files with equal var names), plus the
    read buffers (about 2x the largest batch read).
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        block_size: int = 16,
        layer: str | None = None,
        obs_columns: Sequence[str] = (),
        genes: Sequence[str] | np.ndarray | None = None,
        join: str = "exact",
        obs_missing: str = "error",
        check_indices: bool = True,
        read_threads: int = 4,
        storage_options: dict | None = None,
    ):
        """Opens every file once to check it and read its metadata.

        Args:
            paths: One path or a sequence of paths, concatenated along cells in
                this order.
            block_size: Cells per record (block). Blocks never straddle files.
            layer: The matrix to read: None for `X`, `"raw"` for `raw/X`, any
                other name for `layers/<name>`.
            obs_columns: obs columns returned with every cell. Categorical,
                string and boolean columns come back as integer codes into
                `categories[name]` (shared by all files); numeric columns as
                numbers.
            genes: Optional gene selection applied at read time, within the
                genes `join` aligns: names (output in this order), a boolean
                mask or integer positions over the aligned genes.
            join: `"exact"`, `"inner"` or `"outer"`: how genes of files with
                different var names are aligned (see the class docstring).
            obs_missing: `"error"` or `"fill"`: what a file that lacks one of
                `obs_columns` gives (see the class docstring).
            check_indices: Check at every read that column indices are inside
                the matrix (one pass over the indices, a few percent of a read).
            read_threads: Threads per process that issue positional reads
                concurrently on large batches (cold cache). 0 reads inline.
            storage_options: For URLs (`s3://`, `gs://`, `https://`): obstore
                configuration (credentials, `endpoint_url`, `anon`, ...); see
                `grain_cells.object_store`. Pickled with the source.

        Raises:
            ValueError: `paths` is empty or an argument is out of range.
            FileNotFoundError: A path does not exist.
            errors.AnnDataFormatError: A file is not AnnData or is malformed,
                or an obs column is categorical in one file, numeric in another.
            errors.UnsupportedLayoutError: A matrix is CSC or otherwise unusable.
            errors.MissingColumnError: An obs column, gene or layer is missing.
            errors.GeneMismatchError: With `join="exact"`, files have different
                var names; with `"inner"`, no gene is in every file; with
                `"inner"` or `"outer"`, a file repeats a var name.
        """
        block_size = arguments.check_int("block_size", block_size, minimum=1)
        read_threads = arguments.check_int("read_threads", read_threads, minimum=0)
        genes = arguments.check_genes(genes)
        paths = arguments.paths_of(paths)  # a backed AnnData: its file
        if join not in JOINS:
            raise ValueError(f"join must be one of {list(JOINS)}, got join={join!r}")
        if obs_missing not in OBS_MISSING:
            raise ValueError(
                f"obs_missing must be one of {list(OBS_MISSING)}, got "
                f"obs_missing={obs_missing!r}"
            )
        self._paths = tuple(h5ad.resolve_paths(paths))
        self._block_size = int(block_size)
        self._layer = layer
        self._element = h5ad.matrix_element(layer)
        if isinstance(obs_columns, str):
            obs_columns = [obs_columns]
        self._obs_names = tuple(obs_columns)
        if len(set(self._obs_names)) != len(self._obs_names):
            raise ValueError(f"obs_columns has duplicates: {list(obs_columns)}")
        self._obs_missing = obs_missing
        self._check_indices = bool(check_indices)
        self._read_threads = int(read_threads)
        self._storage_options = dict(storage_options or {})

        infos: list[h5ad.MatrixInfo] = []
        var_names: list[np.ndarray] = []
        obs_kinds: list[dict[str, ColumnKind | None]] = []
        identities: list[FileIdentity] = []
        for path in self._paths:
            with remote_h5.open_h5(path, self._storage_options) as f:
                info = h5ad.inspect_matrix(f, self._element)
                stat = remote_h5.stat_of(f, path)
                identities.append(FileIdentity.take(f, path, info.element, stat))
                var_names.append(h5ad.read_var_names(f, self._element))
                have = h5ad.obs_columns(f)
                missing = [c for c in self._obs_names if c not in have]
                if missing and obs_missing == "error":
                    raise errors.MissingColumnError(
                        f"{path}: obs has no column(s) {missing}; it has {have}. "
                        "Pass obs_missing='fill' to read them as missing in "
                        "files that lack them."
                    )
                obs_kinds.append(
                    {
                        c: None
                        if c in missing
                        else ColumnKind.of(h5ad.read_obs_column(f, c))
                        for c in self._obs_names
                    }
                )
            infos.append(info)
        encodings = {i.encoding for i in infos}
        if len(encodings) > 1:
            raise errors.UnsupportedLayoutError(
                f"{self._element} is sparse in some files and dense in others "
                f"({', '.join(f'{i.path}: {i.encoding}' for i in infos)}); "
                "all files of one source must share an encoding"
            )
        self._infos = tuple(infos)
        self._identities = tuple(identities)
        self._sparse = infos[0].encoding == h5ad.CSR
        self._dtype = np.result_type(*(h5ad.value_dtype(i.dtype) for i in infos))
        self._genes = align_genes(self._paths, var_names, join, genes)
        self._obs = harmonise(self._paths, self._obs_names, obs_kinds, obs_missing)

        n_obs = np.array([i.n_obs for i in infos], np.int64)
        self._cell_offsets = np.concatenate([[0], np.cumsum(n_obs)])
        n_blocks = -(-n_obs // self._block_size)
        self._block_offsets = np.concatenate([[0], np.cumsum(n_blocks)])
        # A view (`select`, `with_blocks`) lists its blocks' rows; None: the
        # regular grid of block_size cells per file.
        self._block_starts: np.ndarray | None = None
        self._block_stops: np.ndarray | None = None
        self._blocks_id = ""
        self._init_process_state()
        for i, path in enumerate(self._paths):  # metadata of objects read once
            if object_store.is_url(path):
                self._file(i)

    # -- per-process state -------------------------------------------------

    def _init_process_state(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, _OpenFile] = {}
        self._local = threading.local()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = os.getpid()

    def __getstate__(self):
        state = self.__dict__.copy()
        for key in ("_lock", "_open", "_local", "_pool", "_pid"):
            del state[key]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_process_state()

    def close(self) -> None:
        """Closes this process's file handles; the source reopens on next use."""
        with self._lock:
            for handle in self._open.values():
                handle.close()
            self._open.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None

    def __del__(self):
        try:
            if os.getpid() == self._pid:
                self.close()
        except Exception:
            pass

    def _file(self, i: int) -> _OpenFile:
        if self._pid != os.getpid():  # forked: handles belong to the parent
            self._init_process_state()
        handle = self._open.get(i)
        if handle is not None:
            return handle
        with self._lock:
            handle = self._open.get(i)
            if handle is None:
                handle = self._open_file(i)
                self._open[i] = handle
        return handle

    def _open_file(self, i: int) -> _OpenFile:
        expected = self._infos[i]
        path = expected.path
        identity = self._identities[i]
        f = remote_h5.open_h5(path, self._storage_options, identity.stat)
        try:
            info = h5ad.inspect_matrix(f, self._element)
            if info.describe() != expected.describe():
                raise errors.SourceChangedError(
                    f"{path}: changed since the AnnDataSource was built: "
                    f"{expected.describe()} then, {info.describe()} now. Build a "
                    "new source (and do not restore iterator state saved for the "
                    "old one)."
                )
            identity.check_stat(remote_h5.stat_of(f, path), "when a process opened it")
            identity.check_layout(f, "when a process opened it")
            fd = remote_h5.open_bytes(path, self._storage_options, identity.stat)
        except BaseException:
            f.close()
            raise
        try:
            identity.check_stat(fd.stat(), "when a process opened it")
            element = f[info.element]
            if info.encoding == h5ad.CSR:
                reader = CsrReader(element, info, fd)
            else:
                reader = DenseReader(element, info, fd)
            obs = {}
            for c in self._obs_names:
                spec = self._obs[c]
                column = h5ad.read_obs_column(f, c) if spec.present[i] else None
                obs[c] = spec.file_values(i, column, info.n_obs)
            remote_h5.opened(f)
            return _OpenFile(f, fd, reader, obs)
        except BaseException:
            fd.close()
            f.close()
            raise

    def _buffer(self) -> RowBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = RowBuffer()
        return buf

    def _thread_pool(self):
        if self._read_threads == 0:
            return None
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(
                        self._read_threads, thread_name_prefix="grain_cells_read"
                    )
        return self._pool

    # -- Grain's RandomAccessDataSource protocol ---------------------------

    def __len__(self) -> int:
        return int(self._block_offsets[-1])

    def __getitem__(self, record_key: int) -> Block:
        """Returns the descriptor of block `record_key` (no I/O)."""
        k = int(record_key)
        n = len(self)
        if not 0 <= k < n:
            raise IndexError(
                f"block {record_key} out of range: this source has {n} blocks of "
                f"up to {self._block_size} cells"
            )
        f = int(np.searchsorted(self._block_offsets, k, side="right")) - 1
        if self._block_starts is not None:
            return Block(k, f, int(self._block_starts[k]), int(self._block_stops[k]))
        start = int(self._cell_offsets[f]) + (k - int(self._block_offsets[f])) * (
            self._block_size
        )
        stop = min(start + self._block_size, int(self._cell_offsets[f + 1]))
        return Block(k, f, start, stop)

    def __repr__(self) -> str:
        files = ", ".join(
            f"{p!r} ({i.n_obs} cells)"
            for p, i in zip(self._paths, self._infos, strict=True)
        )
        # Defaults print as before alignment existed, so saved reprs still match.
        obs_missing = (
            ""
            if self._obs_missing == "error"
            else f", obs_missing={self._obs_missing!r}"
        )
        # A view adds its block table's identity; the full source prints as
        # before views existed.
        blocks = f", blocks={self._blocks_id}" if self._blocks_id else ""
        if self._blocks_id and selection.fragmented(
            self._block_stops - self._block_starts, self._block_size
        ):
            blocks += " (fragmented)"
        return (
            f"AnnDataSource(files=[{files}], layer={self._layer!r}, "
            f"block_size={self._block_size}, obs_columns={list(self._obs_names)}, "
            f"{self._genes.describe()}{obs_missing}{blocks})"
        )

    # -- views over a subset of cells --------------------------------------

    def select(self, cells=None, *, where=None) -> AnnDataSource:
        """A view of this source over the cells that match; see `selection`.

        Records of the view are blocks over *runs* of selected cells: up to
        `block_size` consecutive selected cells of one file, so a block never
        straddles a file or a gap in the selection (a run shorter than
        `block_size`, or a run's tail, makes a short block). Row ids stay
        global (`num_cells`, `read`, `obs_values` and minibatch `row_ids`
        refer to all cells of the files). On a view, only cells already in it
        can be selected.

        Example:
            >>> immune = source.select(where={"cell_type": ["B", "T"]})
            >>> fresh = source.select(where={"n_genes": lambda v: v > 200})
            >>> some = source.select(row_ids)          # or a boolean mask

        Args:
            cells: A boolean mask over `num_cells`, or global row ids, or None.
            where: obs column name to the labels to keep, or to an elementwise
                predicate (see `grain_cells.selection.where_mask`). Columns
                must be among `obs_columns`.

        Returns:
            A new `AnnDataSource` (its own file handles) whose records are the
            selected blocks. Its `repr` names a hash of its block table.

        Raises:
            ValueError: The selection is empty or malformed.
            errors.MissingColumnError: A `where` column is not an obs column.
        """
        mask = selection.selection_mask(self, cells, where)
        starts, stops = selection.blocks_over_runs(
            mask, self._cell_offsets, self._block_size
        )
        return self.with_blocks(starts, stops)

    def with_blocks(self, starts, stops) -> AnnDataSource:
        """A view of this source whose records are the given row ranges.

        The low-level constructor behind `select` and the splits: record `k`
        of the view is global rows `[starts[k], stops[k])`. The view keeps a
        block table of 16 bytes per block (two int64 arrays), pickled to
        every worker with the source.

        Args:
            starts: Global first rows, strictly increasing.
            stops: Exclusive ends; each range holds 1 to `block_size` rows of
                one file, and ranges do not overlap.

        Returns:
            A new `AnnDataSource` with its own file handles.

        Raises:
            ValueError: No range, or ranges out of order, overlapping, empty,
                longer than `block_size` or straddling two files.
        """
        starts = np.asarray(starts).reshape(-1)
        stops = np.asarray(stops).reshape(-1)
        if starts.dtype.kind not in "iu" or stops.dtype.kind not in "iu":
            raise TypeError(
                f"block starts and stops must be integers, got dtypes "
                f"{starts.dtype} and {stops.dtype}"
            )
        starts = starts.astype(np.int64)
        stops = stops.astype(np.int64)
        if starts.shape != stops.shape or starts.size == 0:
            raise ValueError(
                f"with_blocks needs as many stops as starts, at least one: got "
                f"{starts.size} starts and {stops.size} stops"
            )
        lengths = stops - starts
        bad = (lengths < 1) | (lengths > self._block_size)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"block {k} is rows [{starts[k]}, {stops[k]}): a block holds 1 to "
                f"block_size={self._block_size} rows"
            )
        if starts[0] < 0 or stops[-1] > self.num_cells:
            raise ValueError(
                f"blocks span rows [{starts.min()}, {stops.max()}); the source has "
                f"{self.num_cells} cells"
            )
        if (starts[1:] < stops[:-1]).any():
            k = int(np.flatnonzero(starts[1:] < stops[:-1])[0]) + 1
            raise ValueError(
                f"block {k} (rows [{starts[k]}, {stops[k]})) starts before block "
                f"{k - 1} ends ({stops[k - 1]}): blocks must be sorted and disjoint"
            )
        first_file = np.searchsorted(self._cell_offsets, starts, side="right")
        last_file = np.searchsorted(self._cell_offsets, stops - 1, side="right")
        if (first_file != last_file).any():
            k = int(np.flatnonzero(first_file != last_file)[0])
            raise ValueError(
                f"block {k} (rows [{starts[k]}, {stops[k]})) straddles two files; "
                f"file boundaries are at {self._cell_offsets[1:-1].tolist()}"
            )
        view = copy.copy(self)  # through __getstate__: fresh handles and locks
        view._block_starts = starts
        view._block_stops = stops
        view._block_offsets = np.searchsorted(starts, self._cell_offsets, "left")
        digest = hashlib.sha256(starts.astype("<i8").tobytes())
        digest.update(stops.astype("<i8").tobytes())
        view._blocks_id = (
            f"{starts.size} blocks of {int(lengths.sum())} cells "
            f"sha256:{digest.hexdigest()[:16]}"
        )
        if selection.fragmented(lengths, self._block_size):
            _log.warning(
                "%s: %s",
                view._blocks_id,
                selection.fragment_note(lengths, self._block_size),
            )
        return view

    # -- metadata ----------------------------------------------------------

    @property
    def paths(self) -> tuple[str, ...]:
        """The files, in concatenation order."""
        return self._paths

    @property
    def block_size(self) -> int:
        """Cells per block (record)."""
        return self._block_size

    @property
    def num_cells(self) -> int:
        """Cells over all files (a view's row ids still range over these)."""
        return int(self._cell_offsets[-1])

    @property
    def num_selected_cells(self) -> int:
        """Cells the blocks hold: `num_cells`, or fewer for a view."""
        if self._block_starts is None:
            return self.num_cells
        return int((self._block_stops - self._block_starts).sum())

    @property
    def num_genes(self) -> int:
        """Columns of the output (aligned genes, after the `genes` selection)."""
        return len(self._genes.var_names)

    @property
    def num_genes_stored(self) -> int:
        """Aligned genes before the `genes` selection.

        With `join="exact"`, the columns every file stores.
        """
        return self._genes.num_aligned

    @property
    def var_names(self) -> np.ndarray:
        """Gene ids of the output columns, in output order."""
        return self._genes.var_names

    @property
    def join(self) -> str:
        """How genes are aligned over files: `"exact"`, `"inner"`, `"outer"`."""
        return self._genes.join

    @property
    def obs_missing(self) -> str:
        """What files lacking an obs column give: `"error"` or `"fill"`."""
        return self._obs_missing

    def file_column_map(self, i: int) -> np.ndarray | None:
        """Output column of each column file `i` stores (-1: not output).

        None when the file's columns are the output columns (no remapping).
        """
        column_map = self._genes.maps[i]
        return None if column_map is None else column_map.out.copy()

    @property
    def is_sparse(self) -> bool:
        """Whether the matrix is stored as CSR (else dense)."""
        return self._sparse

    @property
    def dtype(self) -> np.dtype:
        """Dtype of values read: the files' common type (native, float16 as float32)."""
        return self._dtype

    @property
    def cell_offsets(self) -> np.ndarray:
        """Global row id of each file's first cell, plus the total at the end."""
        return self._cell_offsets.copy()

    @property
    def block_offsets(self) -> np.ndarray:
        """Index of each file's first block, plus the block count at the end."""
        return self._block_offsets.copy()

    @property
    def obs_columns(self) -> tuple[str, ...]:
        """The obs columns returned with each cell."""
        return self._obs_names

    @property
    def categories(self) -> dict[str, np.ndarray | None]:
        """Per obs column, the labels that codes index (None for numeric)."""
        return {c: spec.categories for c, spec in self._obs.items()}

    def obs_values(self, column: str) -> np.ndarray:
        """One obs column for every cell of the source, in row-id order.

        Categorical columns come back as codes into `categories[column]`
        (harmonised across files). Loads the column of every file into this
        process.

        Raises:
            errors.MissingColumnError: `column` is not one of `obs_columns`.
        """
        if column not in self._obs_names:
            raise errors.MissingColumnError(
                f"obs column {column!r} was not requested; this source has "
                f"obs_columns={list(self._obs_names)}"
            )
        parts = [self._file(i).obs[column] for i in range(len(self._paths))]
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    def chunk_starts(self) -> np.ndarray:
        """Global rows where an HDF5 chunk of the matrix begins, per file.

        For CSR, a row belongs to the chunk of `data` that holds its first
        value; for dense, chunks are runs of rows. Each file's first row is
        included; a contiguous matrix contributes only that. Opens every file
        in this process (and, for CSR, reads each `indptr` once).
        """
        parts = [
            self._file(i).reader.chunk_starts() + self._cell_offsets[i]
            for i in range(len(self._paths))
        ]
        return np.unique(np.concatenate(parts))

    def file_info(self, i: int) -> h5ad.MatrixInfo:
        """What file `i`'s matrix holds."""
        return self._infos[i]

    @property
    def blocks_id(self) -> str:
        """A view's block table, summarised and hashed; "" for the full grid."""
        return self._blocks_id

    def file_identity(self, i: int) -> FileIdentity:
        """File `i`'s identity, taken when the source was built."""
        return self._identities[i]

    def verify_files(self, when: str = "on request") -> None:
        """Checks that every file is still the one the source was built on.

        One `stat` per file (see `grain_cells.identity` for what that detects).

        Raises:
            errors.SourceChangedError: A file was written, replaced or removed.
        """
        for identity in self._identities:
            try:
                now = remote_h5.stat_path(identity.path, self._storage_options)
            except FileNotFoundError:
                raise errors.SourceChangedError(
                    f"{identity.path}: removed since the AnnDataSource was built "
                    f"(detected {when}). Build a new source."
                ) from None
            identity.check_stat(now, when)

    # -- batched reads -----------------------------------------------------

    def block_ranges(self, keys) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised `source[k]`: `(files, starts, stops)` of many blocks."""
        keys = np.asarray(keys, np.int64).reshape(-1)
        if keys.size and (keys.min() < 0 or keys.max() >= len(self)):
            raise IndexError(
                f"block keys must lie in [0, {len(self)}); got {keys.min()}.."
                f"{keys.max()}"
            )
        files = np.searchsorted(self._block_offsets, keys, side="right") - 1
        if self._block_starts is not None:
            return files, self._block_starts[keys], self._block_stops[keys]
        starts = (
            self._cell_offsets[files]
            + (keys - self._block_offsets[files]) * self._block_size
        )
        stops = np.minimum(starts + self._block_size, self._cell_offsets[files + 1])
        return files, starts, stops

    def will_need(self, keys) -> None:
        """Asks the OS to start reading these blocks into the page cache.

        Returns quickly: the reads run in the background, so a later batched
        read of the blocks finds them cached. Advisory only: it never raises
        (a bad file is reported by the read itself) and does nothing for
        compressed data, which h5py reads.

        Args:
            keys: Block record keys.
        """
        try:
            files, starts, stops = self.block_ranges(np.unique(keys))
            buf = getattr(self._local, "advise_buf", None)
            if buf is None:
                buf = self._local.advise_buf = RowBuffer()
            for i in np.unique(files).tolist():
                sel = files == i
                offset = self._cell_offsets[i]
                self._file(i).reader.advise(
                    starts[sel] - offset, stops[sel] - offset, buf
                )
        except Exception:  # a hint must never fail the pipeline
            return

    def fetch_ranges(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        buffer: RowBuffer | None = None,
    ) -> FetchedRows:
        """Reads global row ranges into this thread's reused buffer.

        The lowest-level read: ranges are grouped by file and sorted, read with
        one batched call per file and dataset, and returned in *file order*
        (not the order given) as views into a buffer that the calling thread's
        next read overwrites. `row_ids` says which row is where. Rows are in
        output columns (`var_names`): each file's genes aligned and selected.

        Args:
            starts: Global first rows; ranges must not overlap or straddle files.
            stops: Matching exclusive ends.
            buffer: Buffer to read into; defaults to the calling thread's.

        Raises:
            IndexError: A range is outside the source or straddles two files.
        """
        starts = np.asarray(starts, np.int64).reshape(-1)
        stops = np.asarray(stops, np.int64).reshape(-1)
        order = np.argsort(starts, kind="stable")
        starts, stops = starts[order], stops[order]
        self._check_ranges(starts, stops)
        files = np.searchsorted(self._cell_offsets, starts, side="right") - 1
        buf = buffer if buffer is not None else self._buffer()
        pool = self._thread_pool()
        bounds = np.flatnonzero(np.diff(files)) + 1
        groups = [g for g in np.split(np.arange(starts.size), bounds) if g.size]
        lengths = stops - starts
        row_ids = _expand_ranges(starts, lengths)
        if not groups:  # nothing asked: an empty read of the first file
            groups = [np.zeros(0, np.int64)]
            files = np.zeros(0, np.int64)
        file_of = [int(files[g[0]]) if g.size else 0 for g in groups]
        local = [
            (starts[g] - self._cell_offsets[i], stops[g] - self._cell_offsets[i])
            for g, i in zip(groups, file_of, strict=True)
        ]
        handles = [self._file(i) for i in file_of]
        for i, handle in zip(file_of, handles, strict=True):
            if handle.fd is not None:  # one fstat per file and fetch (~10 us)
                self._identities[i].check_stat(handle.fd.stat(), "at a read")
        readers = [handle.reader for handle in handles]
        obs = self._obs_for(files, starts, lengths, row_ids)
        maps = [self._genes.maps[i] for i in file_of]
        if not self._sparse:
            if len(readers) == 1 and maps[0] is None:  # rows as read
                dense = readers[0].read(*local[0], buf, pool)
                return FetchedRows(None, dense, row_ids, obs)
            # Each file's rows into one buffer, in output columns.
            dense = buf.get(
                "aligned_dense",
                (row_ids.size, self.num_genes),
                np.result_type(*(h5ad.value_dtype(r.info.dtype) for r in readers)),
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
        dtypes = {r.dtypes for r in readers}
        nnz = sum(p.nnz for p in plans)
        n_rows = sum(p.n_rows for p in plans)
        if len(dtypes) == 1:
            data_dtype, index_dtype = dtypes.pop()
        else:  # files store different dtypes: read each as is, then cast
            data_dtype = np.result_type(*(d for d, _ in dtypes))
            index_dtype = np.result_type(*(i for _, i in dtypes))
        data = buf.get("data", (nnz,), data_dtype)
        indices = buf.get("indices", (nnz,), index_dtype)
        indptr = buf.get("indptr", (n_rows + 1,), np.int64)
        indptr[0] = 0
        v = r_ = 0
        spans = []
        for reader, plan, column_map in zip(readers, plans, maps, strict=True):
            span = slice(v, v + plan.nnz)
            spans.append((v, v + plan.nnz, column_map))
            if reader.dtypes == (data_dtype, index_dtype):
                reader.read_values(
                    plan, data[span], indices[span], pool, self._check_indices
                )
            else:
                d = np.empty(plan.nnz, reader.dtypes[0])
                i = np.empty(plan.nnz, reader.dtypes[1])
                reader.read_values(plan, d, i, pool, self._check_indices)
                data[span] = d
                indices[span] = i
            indptr[r_ + 1 : r_ + 1 + plan.n_rows] = plan.indptr[1:] + v
            v += plan.nnz
            r_ += plan.n_rows
        data, indices, indptr = remap_csr(
            data, indices, indptr, spans, buf, self._check_indices
        )
        csr = CsrRows(data, indices, indptr, self.num_genes)
        return FetchedRows(csr, None, row_ids, obs)

    def _check_ranges(self, starts, stops) -> None:
        n = self.num_cells
        if starts.size and (
            starts.min() < 0 or stops.max() > n or (stops < starts).any()
        ):
            bad = int(np.flatnonzero((starts < 0) | (stops > n) | (stops < starts))[0])
            raise IndexError(
                f"rows [{starts[bad]}, {stops[bad]}) out of range: the source has "
                f"{n} cells ({', '.join(self._paths)})"
            )
        if starts.size > 1 and (starts[1:] < stops[:-1]).any():
            raise ValueError("row ranges overlap; pass disjoint ranges")
        f_start = np.searchsorted(self._cell_offsets, starts, side="right")
        f_last = np.searchsorted(
            self._cell_offsets, np.maximum(stops - 1, starts), side="right"
        )
        if (f_start != f_last).any():
            bad = int(np.flatnonzero(f_start != f_last)[0])
            raise IndexError(
                f"rows [{starts[bad]}, {stops[bad]}) straddle two files; split the "
                "range at the file boundary (see cell_offsets)"
            )

    def _obs_for(self, files, starts, lengths, row_ids) -> dict[str, np.ndarray]:
        if not self._obs_names:
            return {}
        file_of_row = np.repeat(files, lengths)
        local = row_ids - self._cell_offsets[file_of_row]
        out = {}
        present = np.unique(files) if files.size else np.zeros(1, np.int64)
        for c in self._obs_names:
            arrays = {int(i): self._file(int(i)).obs[c] for i in present}
            if len(arrays) == 1:
                out[c] = next(iter(arrays.values()))[local]
                continue
            dtype = np.result_type(*arrays.values())
            values = np.empty(row_ids.size, dtype)
            for i, arr in arrays.items():
                mask = file_of_row == i
                values[mask] = arr[local[mask]]
            out[c] = values
        return out

    def read_ranges(self, starts, stops) -> Cells:
        """Reads global row ranges `[starts[i], stops[i])`, in the order given.

        Args:
            starts: First rows (global ids).
            stops: Exclusive ends. Ranges must not overlap or straddle files.

        Returns:
            The rows, range after range, as fresh arrays owned by the caller.
        """
        starts = np.asarray(starts, np.int64).reshape(-1)
        stops = np.asarray(stops, np.int64).reshape(-1)
        fetched = self.fetch_ranges(starts, stops)
        wanted = _expand_ranges(starts, stops - starts)
        return self._take(fetched, np.searchsorted(fetched.row_ids, wanted))

    def read(self, rows) -> Cells:
        """Reads rows by global id, in the order given (repeats allowed).

        Rows are coalesced into runs of consecutive ids, read with one batched
        call per file and dataset, then gathered into the order asked.

        Args:
            rows: Global row ids (ints).

        Returns:
            The rows as fresh arrays owned by the caller.

        Raises:
            IndexError: A row is outside `[0, num_cells)`.
        """
        rows = np.asarray(rows).reshape(-1)
        if rows.size == 0:
            rows = rows.astype(np.int64)
        if rows.dtype.kind not in "iu":
            raise TypeError(f"rows must be integers, got dtype {rows.dtype}")
        rows = rows.astype(np.int64, copy=False)
        n = self.num_cells
        if rows.size and (rows.min() < 0 or rows.max() >= n):
            bad = int(rows[(rows < 0) | (rows >= n)][0])
            raise IndexError(
                f"row {bad} out of range: the source has {n} cells "
                f"({', '.join(self._paths)})"
            )
        uniq = np.unique(rows)
        # Runs of consecutive ids, split at file boundaries.
        breaks = (
            np.flatnonzero(
                (np.diff(uniq) != 1) | np.isin(uniq[1:], self._cell_offsets[1:-1])
            )
            + 1
        )
        run_starts = uniq[np.concatenate([[0], breaks])] if uniq.size else uniq
        run_stops = (
            uniq[np.concatenate([breaks - 1, [uniq.size - 1]])] + 1
            if uniq.size
            else uniq
        )
        fetched = self.fetch_ranges(run_starts, run_stops)
        return self._take(fetched, np.searchsorted(fetched.row_ids, rows))

    def read_blocks(self, keys) -> Cells:
        """Reads whole blocks (records), in the order given."""
        blocks = [self[int(k)] for k in np.asarray(keys).reshape(-1)]
        return self.read_ranges([b.start for b in blocks], [b.stop for b in blocks])

    def _take(self, fetched: FetchedRows, positions: np.ndarray) -> Cells:
        obs = {c: v[positions] for c, v in fetched.obs.items()}
        row_ids = fetched.row_ids[positions]
        if fetched.csr is not None:
            data, indices, indptr = take_csr(fetched.csr, positions)
            X = sp.csr_matrix(
                (data.astype(self._dtype, copy=False), indices, indptr),
                shape=(positions.size, self.num_genes),
            )
            if self._genes.reorders:  # rows kept a file's own gene order
                X.sort_indices()
        else:
            X = fetched.dense[positions].astype(self._dtype, copy=False)
        return Cells(X, obs, row_ids)


def _expand_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    total = int(lengths.sum())
    out = np.arange(total, dtype=np.int64)
    out += np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return out

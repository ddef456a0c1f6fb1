"""The files of a source as checked when it was built, and a process's handles.

`FileSet`: an immutable value that pickles to workers (`element_files`: of
another element); `OpenFiles`: one process's open files, buffers and threads.

Design notes: docs/reference/design.md#io-file-set, #io-element-files.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from grain_cells import errors, formats
from grain_cells._util import cores, fork
from grain_cells.io import _file_lru, _h5ad
from grain_cells.io._build import file_metas
from grain_cells.io._collection import LayoutTable, joined_columns
from grain_cells.io._frames import var_group_name
from grain_cells.io._genes import (
    GeneAlignment,
    align_genes,
    read_gene_keys,
    shared_keys,
)
from grain_cells.io._h5ad import OBSM, inspect_element
from grain_cells.io._identity import FileIdentity
from grain_cells.io._matrix import RowBuffer
from grain_cells.io._meta_cache import MetaCache
from grain_cells.io._obs import HarmonisedColumn, harmonise
from grain_cells.io._obs_cache import MIN_CELLS
from grain_cells.io._open_file import OpenFile, open_member, pinned_flats, reopen
from grain_cells.io._records import FileRecords
from grain_cells.storage import read_counts
from grain_cells.storage.remote import is_url

# Read-ahead hints stop while at most `WARM_MISSES` of each `WARM_PIECES`
# pieces of a source's local reads (once cold: hints' asks) missed the page
# cache (`cache_warm`).
WARM_PIECES = 1024
WARM_MISSES = 10


@dataclasses.dataclass(frozen=True, eq=False)
class FileSet:
    """AnnData files or stores (formats may mix) along cells, checked at build.

    `element`: the matrix read; `genes`: each file's genes in output columns.
    """

    paths: tuple[str, ...]
    element: str
    records: FileRecords  # each file's `infos` and `identities`, as columns
    genes: GeneAlignment
    obs_names: tuple[str, ...]
    obs: dict[str, HarmonisedColumn]
    sparse: bool
    dtype: np.dtype
    storage_options: dict = dataclasses.field(default_factory=dict)
    layouts: LayoutTable | None = None  # a many-file fetch's byte pieces

    @classmethod
    def inspect(
        cls,
        paths: Sequence[str],
        *,
        element: str,
        obs_names: tuple[str, ...],
        genes,
        join: str,
        obs_missing: str,
        storage_options: dict | None = None,
        genes_from: str | None = None,
    ) -> FileSet:
        """Opens every file once (or takes its cached entry) to check it."""
        paths, options = tuple(paths), dict(storage_options or {})
        cache = MetaCache(element, genes_from)
        seen: dict = {}  # one array per distinct gene list (shared_keys)
        infos, identities, keys, kinds, matrices = [], [], [], [], []
        metas = file_metas(paths, cache, obs_names, options)
        for path, meta in zip(paths, metas, strict=True):
            missing = [c for c in obs_names if c not in meta.have]
            if missing and obs_missing == "error":
                raise errors.MissingColumnError(
                    f"{path}: obs has no column(s) {missing}; it has {meta.have}. "
                    "Pass obs_missing='fill' to read them as missing in "
                    "files that lack them."
                )
            infos.append(meta.info)  # (the rest of `meta` goes: a build's peak)
            identities.append(meta.identity)
            keys.append(shared_keys(meta.keys, seen))
            kinds.append({c: meta.kinds.get(c) for c in obs_names})
            matrices.append((meta.layouts or {}).get("matrix"))
        kind = _kind(element, infos, "of one source must share an encoding")
        records, table = FileRecords(paths, infos, identities), None
        if len(paths) > 1:
            table = LayoutTable.build(infos, identities, matrices, records.stat_keys)
        return cls(
            paths,
            element,
            records,
            align_genes(paths, keys, join, genes, genes_from),
            obs_names,
            harmonise(paths, obs_names, kinds, obs_missing),
            **kind,
            storage_options=options,
            layouts=table,
        )

    @property
    def infos(self) -> Sequence[_h5ad.MatrixInfo]:
        """Each file's matrix as the build inspected it."""
        return self.records.infos

    @property
    def identities(self) -> Sequence[FileIdentity]:
        """Each file's identity, taken at build."""
        return self.records.identities

    @property
    def n_obs(self) -> np.ndarray:
        """Cells per file."""
        return np.array(self.records.column("n_obs"), np.int64)

    @property
    def num_genes(self) -> int:
        """Output columns (aligned genes, after the `genes` selection)."""
        return len(self.genes.var_names)

    def verify(self, when: str) -> None:
        """Raises `SourceChangedError` unless every file's `stat` is unchanged."""
        for identity in self.identities:
            try:
                path, options = identity.path, self.storage_options
                now = formats.for_path(path).stat_path(path, options)
            except FileNotFoundError:
                raise errors.SourceChangedError(
                    f"{identity.path}: removed since the AnnDataSource was built "
                    f"(detected {when}). Build a new source."
                ) from None
            identity.check_stat(now, when)


def element_files(files: FileSet, element: str) -> FileSet:
    """The file set of the same files that reads `element` (no obs columns).

    Raises `SourceChangedError`, `MissingColumnError`, `AnnDataFormatError`
    (other rows or obsm widths) or `UnsupportedLayoutError`.
    """
    infos: list[_h5ad.MatrixInfo] = []
    var_names: list[np.ndarray] = []
    seen_keys: dict = {}
    obsm = element.startswith(OBSM)
    own_var = not obsm and var_group_name(element) != var_group_name(files.element)
    for identity, expected in zip(files.identities, files.infos, strict=True):
        path = identity.path
        when = f"when {element} was opened beside it"
        with _h5ad.open_unchanged(identity, files.storage_options, when) as f:
            info = inspect_element(f, element)
            if own_var:
                keys = read_gene_keys(f, element, files.genes.genes_from)
                var_names.append(shared_keys(keys, seen_keys))
        if info.n_obs != expected.n_obs:
            raise errors.AnnDataFormatError(
                f"{path}: {info.element} has {info.n_obs} rows but "
                f"{expected.element} has {expected.n_obs}; expected one row per "
                "cell"
            )
        infos.append(info)
    kind = _kind(element, infos, "must share an encoding to read it")
    genes = files.genes
    if obsm:
        widths = [i.n_vars for i in infos]
        if len(set(widths)) > 1:
            raise errors.AnnDataFormatError(
                f"{infos[0].element} has {widths} columns in files "
                f"{[i.path for i in infos]}; every file must have the same width"
            )
        names = np.arange(widths[0]).astype(str)
        genes = GeneAlignment("exact", names, widths[0], (None,) * len(infos), None)
    elif own_var:
        genes = align_genes(files.paths, var_names, genes.join, None, genes.genes_from)
    return dataclasses.replace(
        files,
        element=element,
        records=files.records.with_infos(infos),
        genes=genes,
        obs_names=(),
        obs={},
        **kind,
        layouts=None,  # another element's pieces: through each file's record
    )


def _kind(element: str, infos: list, must: str) -> dict:
    """`sparse` and `dtype` of files that must share one encoding."""
    if len({i.encoding for i in infos}) > 1:
        raise errors.UnsupportedLayoutError(
            f"{element} is sparse in some files and dense in others "
            f"({', '.join(f'{i.path}: {i.encoding}' for i in infos)}); "
            f"all files {must}"
        )
    return {
        "sparse": infos[0].encoding == _h5ad.CSR,
        "dtype": np.result_type(*(_h5ad.value_dtype(i.dtype) for i in infos)),
    }


def _weight(handle: OpenFile) -> int:
    return 1 if handle.h5 is None else _file_lru.FORMAT_WEIGHT


class OpenFiles(_file_lru.FileLru):
    """One process's open files of a `FileSet`, read buffers and read threads.

    Thread-safe; pickles without handles; a forked child opens its own.
    """

    def __init__(
        self,
        files: FileSet,
        read_threads: int | str,
        max_open_files: int | str = "auto",
    ):
        """Opens nothing yet; `read_threads=0` reads inline."""
        self.files = files
        self.read_threads = (
            read_threads if read_threads == "auto" else int(read_threads)
        )
        self.max_open_files = _file_lru.check_max_open(max_open_files)
        self._reset()
        fork.in_child_of(self, OpenFiles._reset)

    def _reset(self) -> None:
        self._checked = _file_lru.Checked()
        max_open, max_weight = _file_lru.resolve_max_open(self.max_open_files)
        opener = functools.partial(open_member, self.files, checked=self._checked)
        super().__init__(opener, max_open, max_weight, _weight)
        self._pool_lock = threading.Lock()
        self._local = threading.local()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Pieces read and missed since the last verdict (`counting_reads`).
        self._window = [0, 0]
        self._warm: bool | None = None  # no verdict yet
        self._all_local = not any(is_url(p) for p in self.files.paths)
        self._joined: dict | bool | None = None  # `joined_obs`: not asked yet

    def __reduce__(self):
        return OpenFiles, (self.files, self.read_threads, self.max_open_files)

    def pinned(self, indices: Sequence[int], *, at_read: bool = False):
        """Files `indices`' handles, open until the block ends (`at_read`: checked)."""
        return super().pinned(indices, self.check_at_read if at_read else None)

    @contextlib.contextmanager
    def for_hints(self, i: int) -> Iterator[OpenFile | None]:
        """File `i`'s handles for a hint (open, or reopened from layouts), or None."""
        (entry,) = self.pin_if_open([i], touch=False)
        if entry is not None:
            try:
                yield entry.handle
            finally:
                self.release([entry])
            return
        known = self._checked.peek(i)
        if known is None or known.layouts is None:
            yield None
            return
        handle = reopen(self.files, i, known)
        try:
            yield handle
        finally:
            handle.close()

    def joined_obs(self) -> dict[str, np.ndarray] | None:
        """The obs columns over all files (shared maps), built or mapped once; None
        where each process would hold a large source's own copy (obs cache off).
        """  # noqa: D205
        if self._joined is None:
            with self._pool_lock:
                if self._joined is None:
                    files = self.files
                    joined = joined_columns(files, files.obs_names)
                    small = int(files.n_obs.sum()) < MIN_CELLS
                    mapped = (isinstance(v.base, np.memmap) for v in joined.values())
                    self._joined = joined if small or all(mapped) else False
        return None if self._joined is False else self._joined

    pinned_flats = pinned_flats  # a many-file fetch's files for one vectorised read

    def file(self, i: int) -> OpenFile:
        """File `i`'s handles, not pinned (one thread: tests, a build)."""
        with self.pinned([i]) as (handle,):
            return handle

    def check_at_read(self, i: int, handle: OpenFile) -> None:
        """Checks file `i` is unchanged: its descriptor's `fstat`, else its format's."""
        if handle.fd is not None:
            self.files.records.check_stat(i, handle.fd.stat(), "at a read")
        else:
            handle.format.check_unchanged(handle.h5, "at a read")

    @contextlib.contextmanager
    def counting_reads(self, *, hints: bool = False) -> Iterator[None]:
        """Counts the block's local reads (`storage.read_counts`) for `cache_warm`.

        A fetch's reads are judged until they miss; then only hints' asks
        (`hints`), made before advising pages, so hints stop once cached.
        """
        if hints != (self._warm is False):
            yield
            return
        pieces, missed = read_counts.snapshot(hints)
        read_counts.probe = not hints
        try:
            yield
        finally:
            read_counts.probe = False
        now_pieces, now_missed = read_counts.snapshot(hints)
        window = self._window
        window[0] += now_pieces - pieces
        window[1] += now_missed - missed
        if window[1] > WARM_MISSES:  # cold: hint from the next window on
            self._warm = False
        elif window[0] >= WARM_PIECES:
            self._warm = True
        else:
            return
        window[:] = [0, 0]

    @property
    def cache_warm(self) -> bool:
        """Whether the page cache held the recent reads (or, once not, hints)."""
        return self._all_local and self._warm is True

    def buffer(self, name: str = "buf") -> RowBuffer:
        """The calling thread's reused buffer `name` (a read's, a hint's)."""
        buf = getattr(self._local, name, None)
        if buf is None:
            buf = RowBuffer()
            setattr(self._local, name, buf)
        return buf

    def thread_pool(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """The read threads (started on first use; `.threads`), or None: inline."""
        if self._pool is None:
            threads = cores.read_threads(self.read_threads)
            if threads == 0 or (threads == 1 and self.read_threads == "auto"):
                return None
            with self._pool_lock:
                if self._pool is None:
                    pool = concurrent.futures.ThreadPoolExecutor(
                        threads, thread_name_prefix="grain_cells_read"
                    )
                    pool.threads = threads
                    self._pool = pool
        return self._pool

    def close(self) -> None:
        """Closes this process's handles (a pinned one as its read ends)."""
        self.close_all()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None

    def __del__(self):
        try:  # noqa: SIM105 (`contextlib` may be gone at interpreter shutdown)
            self.close()
        except Exception:
            pass

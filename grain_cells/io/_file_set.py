"""The files of a source: what was checked when it was built, and open handles.

`FileSet` is an immutable value: the files' paths, matrix metadata,
identities (`grain_cells.io._identity`), gene alignment and harmonised obs
columns, taken by `FileSet.inspect` when an `AnnDataSource` is built (every
file is opened once, checked and closed). It pickles to workers as is.

Design notes: docs/reference/design.md#io-file-set.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from grain_cells import errors
from grain_cells._util import cores, fork
from grain_cells.io import _file_lru, _h5ad, _nodes
from grain_cells.io._genes import GeneAlignment, align_genes, shared_keys
from grain_cells.io._identity import FileIdentity
from grain_cells.io._matrix import RowBuffer
from grain_cells.io._meta_cache import MetaCache, inspect_file
from grain_cells.io._obs import ColumnKind, HarmonisedColumn, harmonise
from grain_cells.io._open_file import (
    OpenFile,
    hint_flats,
    open_member,
    pinned_flats,
    reopen,
    weight_of,
)
from grain_cells.storage import read_counts
from grain_cells.storage.remote import is_url

# Read-ahead hints stop while at most `WARM_MISSES` of each `WARM_PIECES`
# pieces of a source's local reads missed the page cache
# (`OpenFiles.cache_warm`; why a miss is for good: design.md#io-direct-open).
WARM_PIECES = 1024
WARM_MISSES = 10


class ReadPool(concurrent.futures.ThreadPoolExecutor):
    """A process's read threads, with their count public (`threads`)."""

    def __init__(self, threads: int, **kwargs):
        super().__init__(threads, **kwargs)
        self.threads = threads


@dataclasses.dataclass(frozen=True, eq=False)
class FileSet:
    """One or many AnnData files or stores along cells, checked at build.

    A list may mix formats. `paths` are resolved, in concatenation order;
    `element` is the matrix read (`X`, `raw/X`, `layers/<name>`; beside a
    source, `obsm/<name>`: `grain_cells.io._element_files`); `genes` maps
    each file's genes (an obsm array's columns) to the output columns; `obs`
    holds each column's harmonised categories and per-file presence; `dtype`
    is the files' common value type; `storage_options` (for URLs) pickle
    with the set, so each worker builds its own client.
    """

    paths: tuple[str, ...]
    element: str
    infos: tuple[_h5ad.MatrixInfo, ...]
    identities: tuple[FileIdentity, ...]
    genes: GeneAlignment
    obs_names: tuple[str, ...]
    obs: dict[str, HarmonisedColumn]
    sparse: bool
    dtype: np.dtype
    storage_options: dict = dataclasses.field(default_factory=dict)

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
        """Opens every file once to check it and read its metadata.

        A file unchanged since a build over it is not opened: its entry in
        the metadata cache stands in (`grain_cells.io._meta_cache`).
        Arguments and errors are `AnnDataSource`'s, resolved (`element`:
        `_h5ad.matrix_element(layer)`; `genes`: `arguments.check_genes`'s).
        """
        paths = tuple(paths)
        storage_options = dict(storage_options or {})
        infos: list[_h5ad.MatrixInfo] = []
        var_names: list[np.ndarray] = []
        seen_keys: dict = {}  # one array per distinct gene list (shared_keys)
        obs_kinds: list[dict[str, ColumnKind | None]] = []
        identities: list[FileIdentity] = []
        cache = MetaCache(element, genes_from)
        for path in paths:
            meta = cache.lookup(path, obs_names)
            if meta is None:
                meta = inspect_file(
                    path, element, obs_names, genes_from, storage_options
                )
                cache.store(meta)
            missing = [c for c in obs_names if c not in meta.have]
            if missing and obs_missing == "error":
                raise errors.MissingColumnError(
                    f"{path}: obs has no column(s) {missing}; it has {meta.have}. "
                    "Pass obs_missing='fill' to read them as missing in "
                    "files that lack them."
                )
            identities.append(meta.identity)
            var_names.append(shared_keys(meta.keys, seen_keys))
            obs_kinds.append(
                {c: None if c in missing else meta.kinds[c] for c in obs_names}
            )
            infos.append(meta.info)
        encodings = {i.encoding for i in infos}
        if len(encodings) > 1:
            raise errors.UnsupportedLayoutError(
                f"{element} is sparse in some files and dense in others "
                f"({', '.join(f'{i.path}: {i.encoding}' for i in infos)}); "
                "all files of one source must share an encoding"
            )
        return cls(
            paths=paths,
            element=element,
            infos=tuple(infos),
            identities=tuple(identities),
            genes=align_genes(paths, var_names, join, genes, genes_from),
            obs_names=obs_names,
            obs=harmonise(paths, obs_names, obs_kinds, obs_missing),
            sparse=infos[0].encoding == _h5ad.CSR,
            dtype=np.result_type(*(_h5ad.value_dtype(i.dtype) for i in infos)),
            storage_options=storage_options,
        )

    @property
    def n_obs(self) -> np.ndarray:
        """Cells per file."""
        return np.array([i.n_obs for i in self.infos], np.int64)

    @property
    def num_genes(self) -> int:
        """Output columns (aligned genes, after the `genes` selection)."""
        return len(self.genes.var_names)

    def verify(self, when: str) -> None:
        """Checks with one `stat` per file that every file is unchanged.

        Raises:
            errors.SourceChangedError: A file was written, replaced or removed.
        """
        for identity in self.identities:
            try:
                now = _nodes.stat_path(identity.path, self.storage_options)
            except FileNotFoundError:
                raise errors.SourceChangedError(
                    f"{identity.path}: removed since the AnnDataSource was built "
                    f"(detected {when}). Build a new source."
                ) from None
            identity.check_stat(now, when)


class OpenFiles:
    """One process's open files of a `FileSet`, read buffers and read threads.

    At most `max_open_files` files stay open (`grain_cells.io._file_lru`):
    a read pins the files it uses (`pinned`), and opening another closes
    the least recently used unpinned file; it reopens, checked again by
    `open_member`, on next use. Thread-safe. Pickles without any handle
    (as its file set and options); a forked child drops its parent's
    handles at the fork and opens its own on first use.
    """

    def __init__(
        self,
        files: FileSet,
        read_threads: int | str,
        max_open_files: int | str = "auto",
    ):
        """Opens nothing yet.

        `read_threads`: threads that read and decode large batches; 0 reads
        inline; `"auto"` is sized per process (`grain_cells._util.cores`).
        `max_open_files="auto"`: up to `_file_lru.default_budget()` files
        read through one descriptor, a third as many held through their
        format.
        """
        self.files = files
        self.read_threads = (
            read_threads if read_threads == "auto" else int(read_threads)
        )
        self.max_open_files = _file_lru.check_max_open(max_open_files)
        self._reset()
        fork.in_child_of(self, OpenFiles._reset)

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._checked = _file_lru.Checked()
        max_open, max_weight = _file_lru.resolve_max_open(self.max_open_files)
        self._lru = _file_lru.FileLru(
            functools.partial(open_member, self.files, checked=self._checked),
            max_open,
            max_weight,
            weight_of,
        )
        self._local = threading.local()
        self._pool: ReadPool | None = None
        # Pieces read and missed since the last verdict (`counting_reads`).
        self._window = [0, 0]
        self._warm: bool | None = None  # no verdict yet; False for good
        self._all_local = not any(is_url(p) for p in self.files.paths)

    def __reduce__(self):
        return OpenFiles, (self.files, self.read_threads, self.max_open_files)

    @contextlib.contextmanager
    def pinned(
        self, indices: Sequence[int], *, at_read: bool = False
    ) -> Iterator[list[OpenFile]]:
        """Files `indices`' handles (repeats allowed), open until the block ends.

        `at_read`: each is checked unchanged first (`check_at_read`), but
        for files opened by this call: their open checked them just now.
        """
        opened: list[bool] = []
        with self._lru.pinned(indices, opened) as handles:
            if at_read:
                for i, handle, new in zip(indices, handles, opened, strict=True):
                    if not new:
                        self.check_at_read(int(i), handle)
            yield handles

    @contextlib.contextmanager
    def for_hints(self, i: int) -> Iterator[OpenFile | None]:
        """File `i`'s handles for a read-ahead hint, or None: never a format open.

        An open file as it is (pinned, its place in the bound unchanged); a
        closed one whose byte layouts this process holds (`_layouts`)
        reopened from them for the hint's duration; any other file None
        (hinting it would cost an HDF5 open: its reads are hinted once it is
        open). CSR files whose pieces are known are hinted all at once
        (`hint_flats`) instead.
        """
        with self._lru.pinned_if_open(i) as handle:
            if handle is not None:
                yield handle
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

    def pinned_flats(self, indices: Sequence[int]):
        """A many-file fetch's files for one vectorised read (`_direct_open`)."""
        return pinned_flats(self, self._lru, self._checked, indices)

    def hint_flats(self, indices: Sequence[int]):
        """A hint's files' `Flat`s over descriptors (`_direct_open.hint_flats`)."""
        return hint_flats(self._lru, self._checked, self.files, indices)

    def file(self, i: int) -> OpenFile:
        """File `i`'s handles, not pinned: for one thread (tests, a build).

        Beside other readers they may close at any time; reads use `pinned`.
        """
        with self.pinned([i]) as (handle,):
            return handle

    def check_at_read(self, i: int, handle: OpenFile) -> None:
        """Checks file `i` is unchanged: one `fstat` of its descriptor.

        A file without a byte reader: its format's `check_unchanged` (a
        local store: its root metadata files' `stat`s, which anndata
        rewrites whenever it writes a store).
        """
        if handle.fd is not None:
            self.files.identities[i].check_stat(handle.fd.stat(), "at a read")
        else:
            handle.format.check_unchanged(handle.h5, "at a read")

    @contextlib.contextmanager
    def counting_reads(self) -> Iterator[None]:
        """Counts the block's local reads (`storage.read_counts`) for `cache_warm`.

        Blocks ask while the reads are warm or unjudged; once they missed,
        never again (see `WARM_MISSES`). Reads of other threads during the
        block count too (a heuristic).
        """
        if self._warm is False:
            yield
            return
        pieces, missed = read_counts.snapshot()
        read_counts.probe = True
        try:
            yield
        finally:
            read_counts.probe = False
        now_pieces, now_missed = read_counts.snapshot()
        window = self._window
        window[0] += now_pieces - pieces
        window[1] += now_missed - missed
        if window[1] > WARM_MISSES:  # cold: hint from the next window on, for good
            self._warm = False
        elif window[0] >= WARM_PIECES:
            self._warm = True
        else:
            return
        window[:] = [0, 0]

    @property
    def cache_warm(self) -> bool:
        """Whether read-ahead hints would be wasted: the page cache holds the reads.

        True once `WARM_PIECES` pieces read (`counting_reads`) had at most
        `WARM_MISSES` not in memory, until more than that many miss (then
        False for good); a source with an object in a bucket, or whose reads
        are not counted (a store's, a format library's own), is never warm.
        """
        return self._all_local and self._warm is True

    @property
    def open_count(self) -> int:
        """Files open in this process now."""
        return self._lru.open_count

    def buffer(self, name: str = "buf") -> RowBuffer:
        """The calling thread's reused buffer `name` (a read's, a hint's)."""
        buf = getattr(self._local, name, None)
        if buf is None:
            buf = RowBuffer()
            setattr(self._local, name, buf)
        return buf

    def thread_pool(self) -> ReadPool | None:
        """The read threads (started on first use), or None to read inline.

        `read_threads="auto"` is sized here, in the process that reads, from
        its cores and worker count (`grain_cells._util.cores`); one thread
        reads inline.
        """
        if self._pool is None:
            threads = cores.read_threads(self.read_threads)
            if threads == 0 or (threads == 1 and self.read_threads == "auto"):
                return None
            with self._lock:
                if self._pool is None:
                    self._pool = ReadPool(
                        threads, thread_name_prefix="grain_cells_read"
                    )
        return self._pool

    def close(self) -> None:
        """Closes this process's handles (a pinned one as its read ends)."""
        self._lru.close_all()
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


__all__ = ["FileSet", "OpenFile", "OpenFiles", "ReadPool", "open_member"]

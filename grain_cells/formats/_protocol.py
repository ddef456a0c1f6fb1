"""What a storage format gives the AnnData schema layer (`grain_cells.io`).

AnnData writes one tree of groups and arrays with attributes (`encoding-type`,
`shape`, `_index`, ...) to several on-disk formats. The schema layer reads that
tree and nothing else; a `Format` opens it and answers what only the format
knows. Design notes: docs/reference/design.md#formats-protocol.
"""

from __future__ import annotations

import abc
import concurrent.futures
import itertools
import os
from typing import Any, Protocol, runtime_checkable

import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import merge_touching, nonempty
from grain_cells.storage import FileStat


class ChunkDecodeError(Exception):
    """A chunk's bytes do not decode; its reader raises `errors.CorruptChunkError`."""


def value_dtype(dtype: np.dtype) -> np.dtype:
    """What stored values are read into: native byte order, float16 as float32."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype.newbyteorder("=")


def wait_all(futures: list[concurrent.futures.Future]) -> None:
    """Waits for every future (none still writes a buffer), then raises the first."""
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()


def run_parts(
    pool,
    n: int,
    task,
    pending: list | None = None,
    *,
    max_tasks: int = 16,
    sizes: np.ndarray | None = None,
    min_bytes: int = 1,
) -> list[tuple[int, int]]:
    """Splits `task(a, b)` over `[0, n)` into at most `max_tasks` parts run in `pool`.

    Parts of equal count, or of equal `sizes` (bytes per item, `min_bytes` each at
    least); futures go to `pending` (the caller waits) or are waited for here. Returns
    what the caller runs itself: `[(0, n)]` without a pool or work enough, else `[]`.
    """
    total = 0 if sizes is None else int(sizes.sum())
    n_tasks = (
        min(n, max_tasks) if sizes is None else min(max_tasks, n, total // min_bytes)
    )
    if pool is None or n_tasks < 2:
        return [(0, n)] if n else []
    if sizes is None:
        bounds = np.linspace(0, n, n_tasks + 1).astype(int).tolist()
    else:
        targets = np.linspace(0, total, n_tasks + 1)[1:-1]
        bounds = [0, *np.searchsorted(np.cumsum(sizes), targets).tolist(), n]
    futures = [pool.submit(task, a, b) for a, b in itertools.pairwise(bounds) if b > a]
    if pending is not None:
        pending.extend(futures)
    else:
        wait_all(futures)
    return []


def checked_ranges(reader, starts, stops) -> tuple[np.ndarray, np.ndarray]:
    """`reader`'s non-empty ranges, touching ones merged (empty arrays: none left).

    Raises:
        errors.CorruptDataError: A range reaches outside `reader.shape[0]`.
    """
    starts, stops = nonempty(starts, stops)
    if starts.size == 0:
        return starts, stops
    if stops[-1] > reader.shape[0] or starts[0] < 0:
        raise errors.CorruptDataError(
            f"{reader.path}: {reader.name} has {reader.shape[0]} elements but rows "
            f"[{starts.min()}, {stops.max()}) were asked for."
        )
    return merge_touching(starts, stops)


def missing_path(path: str) -> FileNotFoundError:
    """The error of a path that does not exist (any format)."""
    if os.path.islink(path):
        return FileNotFoundError(
            f"{path}: a symbolic link to {os.readlink(path)}, which does not exist"
        )
    return FileNotFoundError(f"{path}: no such file")


@runtime_checkable
class RangeReader(Protocol):
    """Reads sorted, disjoint ranges of one array's first axis, batched.

    The one read of the fetch path (one `read` per array per fetch). Thread-safe;
    made in the process that reads (`Format.range_reader`), never pickled.

    Attributes:
        name: The array's path inside the file; `path`: the file's path or URL.
        dtype: What values are read into (`value_dtype` of the stored one).
        shape: The array's shape; `row_shape`: `shape[1:]`.
        direct: Reads bypass the format's library (positional, or decoded here).
        remote: Each read is a round trip to an object store.
        chunk_length: Rows per stored chunk; None when not chunked.
        decoded: Compressed chunks are decoded here, in threads.

    `pin()` keeps an array every fetch touches (`indptr`) at hand, once, within the
    reader's bounds. `advise(starts, stops)` hints ranges read soon: returns at once,
    never raises, never changes what is read. `read(starts, stops, out, pool=None,
    pending=None)` reads rows `[starts[i], stops[i])` (sorted, disjoint, int64),
    concatenated, into `out` (contiguous, at least `sum(stops - starts)` rows); with
    a `pool` it may read and decode in threads, and with `pending` hand the futures
    still decoding to the caller, who waits (`wait_all`; `out` is complete only
    then). `read` raises `errors.CorruptDataError` for rows outside the array or a
    file ending early, `errors.CorruptChunkError` (file, array, chunk, rows) for a
    chunk that is missing, truncated, fails its checksum or does not decode.
    """

    name: str
    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    row_shape: tuple[int, ...]
    direct: bool
    remote: bool
    chunk_length: int | None
    decoded: bool

    def pin(self) -> None: ...

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None: ...

    def read(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        out: np.ndarray,
        pool: concurrent.futures.Executor | None = None,
        pending: list[concurrent.futures.Future] | None = None,
    ) -> None: ...


class Format(abc.ABC):
    """A storage format of AnnData's tree: `.h5ad` (HDF5), zarr, ... .

    Implementations are stateless singletons registered once (`formats.register`),
    found by the paths they open (`can_open`) and the nodes they own (`owns`). Every
    method is thread-safe and callable from any process; nothing is pickled (a
    `FileSet` pickles paths and each process asks the registry again). What a format
    opens (files, nodes, readers) belongs to the process that opened it. Missing
    paths raise `FileNotFoundError`; files that are not this format after all, or
    malformed, raise `errors.AnnDataFormatError` naming the path and why; chunks that
    do not decode raise `errors.CorruptChunkError` naming file, array and chunk.
    Each member's one line says its contract; defaults suit h5py-like libraries.

    Attributes:
        name: Short name (`"hdf5"`, `"zarr"`), for messages and repr.
        description: What an open file is, in a message ("HDF5", "a zarr store").
        fallback: Asked after every other format (claims what no other does).

    Example (a format of one's own; `tests/io/toy_format.py` is a whole one):
        >>> class MyFormat(Format):
        ...     name = description = "mine"
        ...     def can_open(self, path): return path.endswith(".mine")
        ...     ...
        >>> grain_cells.formats.register(MyFormat())
    """

    name: str = ""
    description: str = ""
    fallback: bool = False

    @abc.abstractmethod
    def can_open(self, path: str) -> bool:
        """Whether `path` (unopened) is this format's: cheap, no network round trip."""

    @abc.abstractmethod
    def open(self, path: str, storage_options: dict | None, stat: FileStat | None):
        """The root group of `path`, read-only, a context manager (`stat`: expected)."""

    @abc.abstractmethod
    def stat_path(self, path: str, storage_options: dict | None = None) -> FileStat:
        """The `FileStat` of `path` now (one `stat`, HEAD or store listing)."""

    @abc.abstractmethod
    def stat_of(self, f, path: str) -> FileStat:
        """The `FileStat` of an open file (of the very bytes it reads)."""

    def file_name(self, f) -> str:
        """The path or URL an open file was opened from."""
        return f.filename

    @abc.abstractmethod
    def owns(self, node) -> bool:
        """Whether `node` (a group, an array or an open file) is this format's."""

    @abc.abstractmethod
    def is_group(self, node) -> bool:
        """Whether a node this format owns is a group (an open file is one)."""

    @abc.abstractmethod
    def is_array(self, node) -> bool:
        """Whether a node this format owns is an array."""

    def child(self, group, name: str):
        """`group[name]` or None when absent (`KeyError`/`OSError`: a dangling link)."""
        return group.get(name)

    def is_string_array(self, node) -> bool:
        """Whether an array holds strings."""
        return np.dtype(node.dtype).kind in "OUST"

    def attr(self, node, name: str, default=None):
        """The attribute `name` of `node` as its library gives it, or `default`."""
        return node.attrs.get(name, default)

    def strings(self, node) -> np.ndarray:
        """A string array as an object array of `str` (may be shared: never written)."""
        values = np.asarray(node[...])
        if values.dtype.kind == "S":
            return np.char.decode(values, "utf-8").astype(object)
        return values.astype(object)

    def read(self, array, index, path: str, rows: tuple[int, int]) -> np.ndarray:
        """`array[index]` outside the batched path (`rows`: first-axis rows touched)."""
        del path, rows  # default: the array's own errors say enough
        return np.asarray(array[index])

    def checked(self, node, path: str):
        """`node`, checked against the format's own metadata (default: as is)."""
        return node

    def element_problem(self, f, element: str) -> str | None:
        """Why `element` is absent although named (a dangling link), or None."""
        return None

    def check_array(self, path: str, array) -> None:
        """Raises `errors.UnsupportedLayoutError` if a filter or codec is missing."""
        del path, array

    def chunk_bytes(self, array) -> int | None:
        """Decoded bytes of one compressed chunk; None when not compressed."""
        return None

    def open_bytes(self, f, path: str, storage_options: dict | None, stat: FileStat):
        """The `storage.ByteReader` of an open file, or None (then `check_unchanged`).

        `f` is None when a process reopens a file whose readers gave `byte_layout`s.
        """
        return None

    def opened(self, f) -> None:
        """Called once a process has opened and inspected `f` (caches)."""
        del f

    def check_unchanged(self, f, when: str) -> None:
        """Raises `errors.SourceChangedError` (naming `when`) if `f` was rewritten."""
        del f, when

    @abc.abstractmethod
    def range_reader(
        self,
        array,
        path: str,
        fd,
        *,
        cache_bytes: int = 0,
        fill_missing: bool | str = False,
    ) -> RangeReader:
        """The `RangeReader` of an array (`fd`: what `open_bytes` returned).

        `cache_bytes`: decoded bytes to cache; `fill_missing`: which never-written
        chunks read as the fill value (`True`, `"leading"`, `False`).
        """

    def byte_layout(self, array, path: str, fd):
        """Where `array`'s bytes lie (a `ByteLayout`, positional reads), or None."""
        return getattr(self.range_reader(array, path, fd), "byte_layout", None)

    def recorded_format(self) -> str | None:
        """What checkpoints record as a file's format; never change it once saved."""
        return self.name

    @abc.abstractmethod
    def array_layout(self, array) -> list[Any]:
        """Plain values that change with the array's storage, for the layout digest.

        Stable across library versions for the same file: saved states compare it.
        """

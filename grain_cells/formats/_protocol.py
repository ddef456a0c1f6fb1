"""What a storage format gives the AnnData schema layer, and the formats known.

AnnData writes one tree of groups and arrays with attributes to several on-disk
formats; a `Format` opens it and answers what only the format knows. The newest
registered format whose `can_open` accepts a path opens it; `fallback` formats
are asked last. Design notes: docs/reference/design.md#formats-protocol.
"""

from __future__ import annotations

import abc
import concurrent.futures
import itertools
import os
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import merge_touching, nonempty
from grain_cells.storage import FileStat


class ChunkDecodeError(Exception):
    """A chunk's bytes do not decode (its reader raises `errors.CorruptChunkError`)."""


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

    Parts of equal count, or of equal `sizes` (`min_bytes` each at least); futures go
    to `pending` or are waited for here. Returns what the caller runs itself.
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
    """Reads sorted, disjoint ranges of one array's first axis, batched; thread-safe.

    Made in the process that reads, never pickled. `direct`: reads bypass the
    format's library; `remote`: each read is a round trip; `decoded`: chunks are
    decoded here. `pin()` keeps an array every fetch touches at hand; `advise`
    hints ranges (never raises). `read` fills `out` with the ranges concatenated;
    with `pending` it hands still-decoding futures to the caller (`wait_all`). It
    raises `errors.CorruptDataError` (rows outside, file short) or
    `errors.CorruptChunkError` (file, array, chunk, rows).
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

    A stateless, thread-safe singleton, registered once and found by the paths it
    opens (`can_open`) and the nodes it owns (`owns`); never pickled. Missing paths
    raise `FileNotFoundError`, malformed files `errors.AnnDataFormatError` naming
    path and why. Defaults suit h5py-like libraries; `tests/io/toy_format.py` is a
    whole one. `name` is for messages, `description` says what an open file is,
    and a `fallback` format is asked after every other.
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

        `fill_missing`: which never-written chunks read as the fill value.
        """

    def byte_layout(self, array, path: str, fd):
        """Where `array`'s bytes lie (a `ByteLayout`, positional reads), or None."""
        return getattr(self.range_reader(array, path, fd), "byte_layout", None)

    def recorded_format(self) -> str | None:
        """What checkpoints record as a file's format; never change it once saved."""
        return self.name

    @abc.abstractmethod
    def array_layout(self, array) -> list[Any]:
        """Plain values that change with the array's storage (the layout digest).

        Stable across library versions for the same file: saved states compare it.
        """


_lock = threading.Lock()
_asked: tuple[Format, ...] = ()  # newest first, fallbacks last


def _set(newest_first: list[Format]) -> None:
    global _asked
    fallbacks = [f for f in newest_first if f.fallback]
    _asked = (*(f for f in newest_first if not f.fallback), *fallbacks)


def register(fmt: Format) -> Format:
    """Adds `fmt` (or moves it) to the formats asked first; returns it."""
    if not isinstance(fmt, Format):
        raise TypeError(
            f"register expects a grain_cells.formats.Format, got {type(fmt).__name__}"
        )
    with _lock:
        _set([fmt, *(f for f in _asked if f.name != fmt.name)])
    return fmt


def unregister(fmt: Format) -> None:
    """Removes `fmt` (tests register a format for their own duration)."""
    with _lock:
        _set([f for f in _asked if f is not fmt])


def registered() -> tuple[Format, ...]:
    """The formats, in the order they are asked (newest first, fallbacks last)."""
    return _asked


def for_path(path: str | os.PathLike) -> Format:
    """The format that opens `path` (a local path or URL); ValueError if none."""
    path = os.fspath(path)
    for fmt in _asked:
        if fmt.can_open(path):
            return fmt
    raise ValueError(
        f"{path}: no registered format opens it (formats: "
        f"{[f.name for f in _asked]}); import grain_cells to register "
        "the built-in ones"
    )


def of(node) -> Format | None:
    """The format that owns `node` (a group, an array, an open file), or None."""
    for fmt in _asked:
        if fmt.owns(node):
            return fmt
    return None

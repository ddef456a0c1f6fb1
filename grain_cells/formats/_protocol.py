"""`Format`: what a storage format gives the AnnData schema layer; the registry.

Design notes: docs/reference/design.md#formats-protocol.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
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
    """Runs `task(a, b)` over `[0, n)` in parts in `pool`; returns the caller's part."""
    total = 0 if sizes is None else int(sizes.sum())
    n_tasks = min(n, max_tasks, n if sizes is None else total // min_bytes)
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


@contextlib.contextmanager
def naming_errors(reader):
    """A failed read or pin of `reader` (an `OSError`: a GET's names the object,
    not the array) carries a note naming the array and file.
    """  # noqa: D205
    try:
        yield
    except OSError as e:
        note = f"grain_cells: reading {reader.name} of {reader.path}"
        if note not in getattr(e, "__notes__", ()):  # (a task's, then the caller's)
            e.add_note(note)
        raise


def checked_ranges(reader, starts, stops) -> tuple[np.ndarray, np.ndarray]:
    """Non-empty ranges, touching ones merged; `CorruptDataError` past `shape[0]`."""
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
    hint = ""
    if any(c in path for c in "*?["):
        hint = f"; paths are not globs: pass sorted(glob.glob({path!r}))"
    elif path.startswith("~"):
        hint = f"; '~' is not expanded: pass os.path.expanduser({path!r})"
    elif path != path.strip():
        hint = " (it begins or ends with white space)"
    return FileNotFoundError(f"{path}: no such file{hint}")


@runtime_checkable
class RangeReader(Protocol):
    """Reads sorted, disjoint ranges of one array's first axis into `out`; thread-safe.

    Never pickled. `direct`: bypasses the format's library; `remote`: a read is a
    round trip; `decoded`: chunks decoded here. `advise` never raises; with
    `pending`, `read` hands still-decoding futures to the caller (`wait_all`).
    Raises `errors.CorruptDataError` or `errors.CorruptChunkError`.
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

    def read(self, starts, stops, out, pool=None, pending=None) -> None: ...


class Format(abc.ABC):
    """A storage format of AnnData's tree: a stateless, thread-safe singleton.

    Found by the paths it opens (`can_open`) and the nodes it `owns`. Missing
    paths raise `FileNotFoundError`, malformed files `errors.AnnDataFormatError`.
    Defaults suit h5py-like libraries; `tests/io/toy_format.py` is a whole one.
    """

    name: str = ""  # for messages
    description: str = ""  # what an open file is
    fallback: bool = False  # asked after every other format

    @abc.abstractmethod
    def can_open(self, path: str) -> bool:
        """Whether `path` is this format's (cheap, no round trip)."""

    @abc.abstractmethod
    def open(self, path: str, storage_options: dict | None, stat: FileStat | None):
        """The root group of `path`, read-only, a context manager (`stat`: expected)."""

    @abc.abstractmethod
    def stat_path(self, path: str, storage_options: dict | None = None) -> FileStat:
        """The `FileStat` of `path` now."""

    @abc.abstractmethod
    def stat_of(self, f, path: str) -> FileStat:
        """The `FileStat` of the very bytes an open file reads."""

    def file_name(self, f) -> str:
        return f.filename

    @abc.abstractmethod
    def owns(self, node) -> bool:
        """Whether `node` (group, array or open file) is this format's.

        Decided by the node's type alone: `of` remembers the answer per type.
        """

    @abc.abstractmethod
    def is_group(self, node) -> bool: ...

    @abc.abstractmethod
    def is_array(self, node) -> bool: ...

    def child(self, group, name: str):
        """`group[name]`, or None when absent."""
        return group.get(name)

    def is_string_array(self, node) -> bool:
        return np.dtype(node.dtype).kind in "OUST"

    def attr(self, node, name: str, default=None):
        return node.attrs.get(name, default)

    def strings(self, node) -> np.ndarray:
        """A string array as an object array of `str` (may be shared: never written)."""
        values = np.asarray(node[...])
        if values.dtype.kind == "S":
            return np.char.decode(values, "utf-8").astype(object)
        return values.astype(object)

    def read(self, array, index, path: str, rows: tuple[int, int]) -> np.ndarray:
        """`array[index]` outside the batched path (`rows`: first-axis rows touched)."""
        return np.asarray(array[index])

    def checked(self, node, path: str):
        """`node`, checked against the format's own metadata."""
        return node

    def element_problem(self, f, element: str) -> str | None:
        """Why `element` is absent although named (a dangling link), or None."""
        return None

    def check_array(self, path: str, array) -> None:
        """Raises `errors.UnsupportedLayoutError` if a filter or codec is missing."""
        return None

    def chunk_bytes(self, array) -> int | None:
        """Decoded bytes of one compressed chunk; None when not compressed."""
        return None

    def open_bytes(self, f, path: str, storage_options: dict | None, stat: FileStat):
        """The file's `storage.ByteReader` (`f` None on a reopen), or None."""
        return None

    def opened(self, f) -> None:
        """Called once a process has opened and inspected `f`."""
        return None

    def check_unchanged(self, f, when: str) -> None:
        """Raises `errors.SourceChangedError` (naming `when`) if `f` was rewritten."""
        return None

    @abc.abstractmethod
    def range_reader(
        self, array, path: str, fd, *, cache_bytes: int = 0, fill_missing=False
    ) -> RangeReader:
        """The `RangeReader` of an array (`fd`: what `open_bytes` returned)."""

    def byte_layout(self, array, path: str, fd):
        """Where `array`'s bytes lie (a `ByteLayout`), or None."""
        return getattr(self.range_reader(array, path, fd), "byte_layout", None)

    def recorded_format(self) -> str | None:
        """What checkpoints record as a file's format (never changed once saved)."""
        return self.name

    @abc.abstractmethod
    def array_layout(self, array) -> list[Any]:
        """Plain values, stable across library versions, that change with storage."""


_lock = threading.Lock()
_asked: tuple[Format, ...] = ()  # newest first, fallbacks last
_owners: dict[type, Format] = {}  # `of`'s answers, by node type


def _set(formats) -> None:
    global _asked, _owners
    _asked = tuple(sorted(formats, key=lambda f: f.fallback))  # stable
    _owners = {}


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
    with _lock:
        _set([f for f in _asked if f is not fmt])


def registered() -> tuple[Format, ...]:
    """The formats in the order they are asked (newest first, fallbacks last)."""
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
    """The format that owns `node` (a group, an array, an open file), or None.

    Remembered by the node's type until the registered formats change (a
    build asks ~100 times a file).
    """
    owners = _owners
    fmt = owners.get(type(node))
    if fmt is not None:
        return fmt
    for fmt in _asked:  # (a loop: no generator to make per node asked)
        if fmt.owns(node):
            owners[type(node)] = fmt
            return fmt
    return None

"""What a storage format gives the AnnData schema layer (`grain_cells.io`).

AnnData writes one tree of groups and arrays, each with attributes
(`encoding-type`, `shape`, `_index`, ...), to several on-disk formats. The
schema layer reads that tree and nothing else; a `Format` opens it and
answers what only the format knows: what a node is, how to read many row
ranges of an array at once (`RangeReader`), what locates an array's bytes
(for `grain_cells.io._identity`), and a file's stat.

Design notes: docs/reference/design.md#formats-protocol.
"""

from __future__ import annotations

import abc
import concurrent.futures
import os
from typing import Any, Protocol, runtime_checkable

import numpy as np

from grain_cells import errors
from grain_cells._util.ranges import merge_touching, nonempty
from grain_cells.storage import FileStat


class ChunkDecodeError(Exception):
    """A chunk's stored bytes do not decode (any format's codec).

    Raised by a format's codecs with what failed (a bad stream, a checksum
    mismatch, a short chunk); the format's reader, which knows the file,
    array, chunk and rows, turns it into `errors.CorruptChunkError`.
    """


def value_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype stored values are read into: native byte order, at least 32 bits.

    Big-endian values are read in native byte order, and float16 as float32
    (exactly; SciPy's sparse matrices have no float16), so every read and
    output format sees the same values whatever the file stores.
    """
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype.newbyteorder("=")


def wait_all(futures: list[concurrent.futures.Future]) -> None:
    """Waits for every future, then raises the first one's error, if any.

    Waiting for all before raising keeps no task writing into a buffer that
    the caller reuses after the error.
    """
    concurrent.futures.wait(futures)
    for f in futures:
        f.result()


def checked_ranges(reader, starts, stops) -> tuple[np.ndarray, np.ndarray]:
    """`reader`'s non-empty ranges, touching ones merged: `RangeReader.read`'s start.

    Empty arrays when no range is left.

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

    The one read of the fetch path: every row read of a matrix is one
    `read` per array per fetch. Thread-safe (a process's read threads share
    it); made in the process that reads (`Format.range_reader`), never
    pickled.

    Attributes:
        name: The array's path inside the file, for messages.
        path: The file's path or URL, for messages.
        dtype: What values are read into (`value_dtype` of the stored one).
        shape: The array's shape.
        row_shape: `shape[1:]`.
        direct: Whether reads bypass the format's own library (positional
            reads or chunks decoded here).
        remote: Whether each read is a round trip to an object store.
        chunk_length: Rows per stored chunk; None when not chunked.
        decoded: Whether compressed chunks are decoded here, in threads.
    """

    name: str
    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    row_shape: tuple[int, ...]

    @property
    def direct(self) -> bool: ...

    @property
    def remote(self) -> bool: ...

    @property
    def chunk_length(self) -> int | None: ...

    @property
    def decoded(self) -> bool: ...

    def pin(self) -> None:
        """Keeps an array every fetch touches (such as `indptr`) at hand.

        Once, when the array is opened: in the page cache (local files) or
        in memory (decoded chunks, remote pieces), within the reader's
        bounds. `advise` is the per-fetch hint.
        """

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Hints that these ranges will be read soon; returns at once.

        A hint only: it never raises and never changes what is read.
        """

    def read(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        out: np.ndarray,
        pool: concurrent.futures.Executor | None = None,
        pending: list[concurrent.futures.Future] | None = None,
    ) -> None:
        """Reads rows `[starts[i], stops[i])` for all i, concatenated, into `out`.

        Every implementation (`hdf5`, `zarr`) documents only what it adds.

        Args:
            starts: Sorted first rows of each range (int64).
            stops: Matching ends, exclusive; ranges must not overlap.
            out: Contiguous destination with at least `sum(stops - starts)`
                rows of the array's dtype and row shape.
            pool: Optional thread pool that reads and decodes concurrently.
            pending: With a pool, a list that receives the futures still
                decoding instead of waiting for them; the caller waits
                (`wait_all`), e.g. after starting another array's read, so
                both decode in one wave. `out` is complete only then. Reads
                that complete before returning add nothing.

        Raises:
            errors.CorruptDataError: Rows outside the array were asked for,
                or the file ends before the data does.
            errors.CorruptChunkError: A chunk is missing, truncated, fails
                its checksum or does not decode; names the file, the array,
                the chunk and its rows.
        """


class Format(abc.ABC):
    """A storage format of AnnData's tree: `.h5ad` (HDF5), zarr, ... .

    Implementations are stateless singletons registered once
    (`grain_cells.formats.register`), found by the paths they open
    (`can_open`) and by the nodes they own (`owns`). Every method is
    thread-safe and may be called from any process; nothing here is
    pickled (a `FileSet` pickles paths, and each process asks the registry
    again). What the format opens (files, nodes, readers) belongs to the
    process that opened it.

    Attributes:
        name: Short name (`"hdf5"`, `"zarr"`), for messages and repr.
        description: What an open file is, in a message ("HDF5",
            "a zarr store").
        fallback: Asked after every other format (`can_open` then claims
            what no other format does).

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

    # -- paths -----------------------------------------------------------

    @abc.abstractmethod
    def can_open(self, path: str) -> bool:
        """Whether `path` (a local path or URL, unopened) is this format's.

        Cheap (suffixes, a `stat`, a few bytes); no network round trip.
        """

    @abc.abstractmethod
    def open(self, path: str, storage_options: dict | None, stat: FileStat | None):
        """Opens `path` read-only: the root group, a context manager.

        Args:
            path: A path or URL `can_open` accepted.
            storage_options: For URLs: the object-store configuration.
            stat: The version expected (a `FileStat` taken before), or None.

        Raises:
            FileNotFoundError: No such file, object or store.
            errors.AnnDataFormatError: It is not this format after all, or
                cannot be opened, naming the path and why.
        """

    @abc.abstractmethod
    def stat_path(self, path: str, storage_options: dict | None = None) -> FileStat:
        """The `FileStat` of `path` now (one `stat`, HEAD or store listing).

        Raises:
            FileNotFoundError: No such file, object or store.
        """

    @abc.abstractmethod
    def stat_of(self, f, path: str) -> FileStat:
        """The `FileStat` of an open file (of the very bytes it reads)."""

    def file_name(self, f) -> str:
        """The path or URL an open file was opened from."""
        return f.filename

    # -- nodes -----------------------------------------------------------

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
        """`group[name]` (a relative path), or None when it is absent.

        May raise `KeyError` or `OSError` for a link that dangles.
        """
        return group.get(name)

    def is_string_array(self, node) -> bool:
        """Whether an array holds strings."""
        return np.dtype(node.dtype).kind in "OUST"

    def attr(self, node, name: str, default=None):
        """The attribute `name` of `node` as its library gives it, or `default`."""
        return node.attrs.get(name, default)

    def strings(self, node) -> np.ndarray:
        """All of a string array as an object array of `str`.

        Callers never write to it: a format may give one shared, read-only
        array for equal lists.
        """
        values = np.asarray(node[...])
        if values.dtype.kind == "S":
            return np.char.decode(values, "utf-8").astype(object)
        return values.astype(object)

    def read(self, array, index, path: str, rows: tuple[int, int]) -> np.ndarray:
        """`array[index]`: a few values read outside the batched path.

        Args:
            array: An array node of this format.
            index: A slice (or tuple of slices) or sorted, distinct int64
                indices along the first axis.
            path: The file the array is in, for messages.
            rows: First-axis rows `[start, stop)` that `index` touches.

        Raises:
            errors.CorruptChunkError: The bytes holding those rows do not
                decode (the format names the file, the array and its chunk).
        """
        del path, rows  # default: the array's own errors say enough
        return np.asarray(array[index])

    def checked(self, node, path: str):
        """`node`, checked against the format's own metadata (default: as is).

        Raises:
            errors.AnnDataFormatError: The metadata contradicts itself.
        """
        return node

    def element_problem(self, f, element: str) -> str | None:
        """Why `element` is absent although named (a dangling link), or None."""
        return None

    def check_array(self, path: str, array) -> None:
        """Raises if the format cannot return the array's true values.

        Raises:
            errors.UnsupportedLayoutError: A filter or codec is unavailable.
        """
        del path, array  # default: every stored array reads as it is

    def chunk_bytes(self, array) -> int | None:
        """Decoded bytes of one compressed chunk; None when not compressed."""
        return None

    # -- reads and identity ----------------------------------------------

    def open_bytes(self, f, path: str, storage_options: dict | None, stat: FileStat):
        """The `storage` `ByteReader` of an open file's bytes, or None.

        Formats whose arrays read through their own store return None; the
        file set then checks the file with `check_unchanged` at each read
        instead of the reader's `stat`. `f` is None when a process reopens
        a file whose range readers gave `byte_layout`s (positional reads
        only, `grain_cells.io._layouts`): the format is not opened then.
        """
        return None

    def opened(self, f) -> None:
        """Called once a process has opened and inspected `f` (caches)."""
        del f  # default: nothing to save

    def check_unchanged(self, f, when: str) -> None:
        """Cheap per-read check that an open file was not rewritten.

        Raises:
            errors.SourceChangedError: It was, naming it and `when`.
        """
        del f, when  # default: the byte reader's stat is checked instead

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
        """The reader of element ranges of one array.

        Args:
            array: An array this format owns.
            path: The file, for messages.
            fd: What `open_bytes` returned for the file.
            cache_bytes: Decoded bytes to cache (arrays read every fetch).
            fill_missing: Which never-written chunks read as the fill value
                (`True`, `"leading"`, `False`); formats without unwritten
                chunks ignore it.
        """

    def byte_layout(self, array, path: str, fd):
        """Where `array`'s bytes lie in the file (a `ByteLayout`), or None.

        What `range_reader(array, path, fd).byte_layout` gives (positional
        reads only); a build takes it for every file it inspects
        (`grain_cells.io._layout_cache`), so a format may answer it without
        building the reader.
        """
        return getattr(self.range_reader(array, path, fd), "byte_layout", None)

    def recorded_format(self) -> str | None:
        """What checkpoints record as a file's format (default: `name`).

        Part of `grain_cells.io._identity.FileIdentity.content`, so a state
        saved on one format is refused on a copy of the same cells in
        another. Never change it for an existing format: saved states
        compare it.
        """
        return self.name

    @abc.abstractmethod
    def array_layout(self, array) -> list[Any]:
        """What locates an array's bytes, for the layout digest.

        A list of plain values (a `repr` is hashed) that changes when the
        array's storage does: addresses, shape, dtype, chunking, filters,
        sampled chunk offsets. Must not change across library versions for
        the same file: saved states compare it.
        """

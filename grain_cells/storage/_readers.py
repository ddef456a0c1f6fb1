"""Byte readers: where the positional reads of a fetch get their bytes.

The readers of uncompressed and compressed datasets
(`grain_cells.hdf5._reads`, `grain_cells.hdf5._chunks`) know the byte offset of
every piece a fetch needs; a `ByteReader` turns a list of pieces into bytes
in a destination buffer. Two implementations:

* `LocalByteReader`: `os.preadv` on a file descriptor (releases the GIL),
  read-ahead hints through `posix_fadvise`.
* `RemoteByteReader` (`grain_cells.storage.remote._reader`): range GETs of
  an object, in batches
  (`grain_cells.storage.remote._range_gets.get_ranges`: one call into obstore per batch,
  `PARALLEL` of its GETs in flight at once, then a HEAD that checks the
  object's version). Pieces less than `MERGE_GAP` apart are merged into one
  request of at most `MAX_REQUEST_BYTES`; up to `max_in_flight` requests (a
  storage option, `object_store.DEFAULT_MAX_IN_FLIGHT` by default) run at
  once per process for the fetch being read (`max_in_flight // PARALLEL`
  threads, one call each; below `PARALLEL`, one thread whose calls hold
  `max_in_flight` requests), and as many for read-ahead, whose calls hold
  up to `BATCH` requests. `will_need` (used for each CSR file's `indptr`,
  which every fetch reads) fetches the ranges into memory once, up to
  `PIN_BYTES` per reader; `advise` (the fetch stage's read-ahead of future
  fetches) starts their GETs in background threads (`grain_cells.
  read_ahead`, up to `READAHEAD_BYTES` per reader held at once, in flight
  included).

Memory per process and remote file: up to `PIN_BYTES` pinned, up to
`READAHEAD_BYTES` read ahead, plus the requests of the fetch being read
(the fetch's own bytes, at most `max_in_flight` requests of at most
`MAX_REQUEST_BYTES` at once).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from grain_cells.storage._identity import FileStat

# `preadv` flag: fail with EAGAIN instead of waiting for the disk (Linux).
_NOWAIT = getattr(os, "RWF_NOWAIT", None)


class TruncatedError(EOFError):
    """The file ends at byte `end_of_file`, before a piece that ends at `needed`."""

    def __init__(self, end_of_file: int, needed: int):
        super().__init__(f"file ends at byte {end_of_file}, data up to {needed}")
        self.end_of_file = end_of_file
        self.needed = needed


class ByteReader(Protocol):
    """Reads pieces of one file or object; thread-safe.

    Attributes:
        name: The path or URL, for messages.
        remote: Whether each read is a round trip to a store (callers then
            `advise` what they will read next before reading).
    """

    name: str
    remote: bool

    def read_into(
        self,
        dest: np.ndarray,
        offsets: Sequence[int],
        nbytes: Sequence[int],
        dest_starts: Sequence[int],
    ) -> None:
        """Reads `nbytes[i]` bytes at `offsets[i]` into `dest[dest_starts[i]:]`.

        Raises:
            TruncatedError: The file ends before a piece does.
        """

    def read_groups(
        self,
        dest: np.ndarray,
        offsets: Sequence[int],
        nbytes: Sequence[int],
        dest_starts: Sequence[int],
        ends: Sequence[int],
        *,
        nowait: bool = False,
    ) -> int:
        """Optional: `read_into`, each group of pieces by one call.

        Group `g` is pieces `ends[g - 1]` (0 for the first) to `ends[g] - 1`,
        which follow each other in the file (their places in `dest` need
        not). Callers look the method up with `getattr` and use `read_into`
        where it is absent.

        Args:
            dest: Destination bytes (a uint8 array).
            offsets: File offset of each piece.
            nbytes: Size of each piece.
            dest_starts: Place of each piece in `dest`.
            ends: End (exclusive) of each group, in pieces.
            nowait: Stop at the first group whose bytes are not at hand (not
                in the page cache) instead of waiting for them.

        Returns:
            Groups read whole, from the first (all of them unless `nowait`).

        Raises:
            TruncatedError: The file ends before a piece does.
        """

    def advise(self, offsets: Sequence[int], nbytes: Sequence[int]) -> None:
        """Hints that these pieces will be read soon (never raises)."""

    def will_need(self, offsets: Sequence[int], nbytes: Sequence[int]) -> None:
        """Hints that these pieces will be read by every fetch."""

    def stat(self) -> FileStat:
        """The file's stat now (local) or as the source was built (remote)."""

    def close(self) -> None:
        """Releases the descriptor (if owned)."""


def as_byte_reader(fd, name: str) -> ByteReader | None:
    """`fd` as a `ByteReader`: an int descriptor is wrapped, not owned."""
    if fd is None or not isinstance(fd, int):
        return fd
    return LocalByteReader(fd, name, owned=False)


class LocalByteReader:
    """Positional reads (`os.preadv`) of a local file."""

    remote = False

    def __init__(self, fd: int, name: str, *, owned: bool = True):
        """Wraps an open descriptor; closes it on `close` if `owned`."""
        self.fd = fd
        self.name = name
        self._owned = owned
        self._nowait = _NOWAIT is not None

    @classmethod
    def open(cls, path: str) -> LocalByteReader:
        """Opens `path` read-only."""
        return cls(os.open(path, os.O_RDONLY), path)

    def read_into(self, dest, offsets, nbytes, dest_starts) -> None:
        """See `ByteReader.read_into`."""
        view = memoryview(dest)
        fd = self.fd
        for off, n, d in zip(offsets, nbytes, dest_starts, strict=True):
            got = os.preadv(fd, [view[d : d + n]], off)
            while got < n:  # short reads are legal; zero means end of file
                more = os.preadv(fd, [view[d + got : d + n]], off + got)
                if more == 0:
                    raise TruncatedError(off + got, off + n)
                got += more

    def read_groups(self, dest, offsets, nbytes, dest_starts, ends, *, nowait=False):
        """See `ByteReader.read_groups`: one `preadv` per group.

        With `nowait`, `preadv` gets `RWF_NOWAIT` (Linux), which fails at
        once when the bytes are not in the page cache; where the flag is
        missing or the file system refuses it, nothing is read.
        """
        if nowait and not self._nowait:
            return 0
        flags = _NOWAIT if nowait else 0
        view = memoryview(dest)
        fd = self.fd
        a = 0
        for g, b in enumerate(ends):
            if b - a == 1:
                d, n = dest_starts[a], nbytes[a]
                buffers = [view[d : d + n]]
            else:
                places = zip(dest_starts[a:b], nbytes[a:b], strict=True)
                buffers = [view[d : d + n] for d, n in places]
                n = sum(nbytes[a:b])
            try:
                got = os.preadv(fd, buffers, offsets[a], flags)
            except BlockingIOError:  # not in the page cache
                return g
            except OSError:
                if not nowait:
                    raise
                self._nowait = False  # RWF_NOWAIT unsupported (EOPNOTSUPP)
                return g
            if got < n:  # a short read, or the end of the file
                if nowait:
                    return g
                pieces = slice(a, b)
                self.read_into(
                    dest, offsets[pieces], nbytes[pieces], dest_starts[pieces]
                )
            a = b
        return len(ends)

    def advise(self, offsets, nbytes) -> None:
        """`posix_fadvise(WILLNEED)` of each piece (asynchronous)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for off, n in zip(offsets, nbytes, strict=True):
            os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_WILLNEED)

    will_need = advise

    def stat(self) -> FileStat:
        """`fstat` of the descriptor."""
        return FileStat.of(os.fstat(self.fd))

    def close(self) -> None:
        """Closes the descriptor if this reader opened it."""
        if self._owned and self.fd is not None:
            os.close(self.fd)
            self.fd = None

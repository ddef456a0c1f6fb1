"""Byte readers: where the positional reads of a fetch get their bytes.

`LocalByteReader` (`os.preadv`) and `RemoteByteReader` (batched range GETs).

Design notes: docs/reference/design.md#storage-readers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from grain_cells.storage._identity import FileStat


class ShortReadError(EOFError):
    """A read came back short: the file ends (`end_of_file`) before a piece (`needed`).

    Callers name the element. Not `errors.TruncationError` (a cell wider than a
    fixed-width output).
    """

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
            ShortReadError: The file ends before a piece does.
        """

    def advise(self, offsets: Sequence[int], nbytes: Sequence[int]) -> None:
        """Hints that these pieces will be read soon (never raises)."""

    def pin(self, offsets: Sequence[int], nbytes: Sequence[int]) -> None:
        """Keeps these pieces at hand: every fetch reads them (e.g. `indptr`).

        Locally the page cache holds them (the same as `advise`); a remote
        reader holds their bytes in memory, within `PIN_BYTES`.
        """

    def stat(self) -> FileStat:
        """The file's stat now (local) or as the source was built (remote)."""

    def close(self) -> None:
        """Releases the descriptor (if owned)."""


# `preadv` flag: hand over only bytes already in memory (Linux >= 4.14).
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


class ReadCounts:
    """Local pieces read in this process, and how many missed the page cache.

    While `probe` is set (by a reader, for the reads it counts:
    `grain_cells.io._file_set.OpenFiles.counting_reads`), each local
    positional read asks first without waiting (`preadv` with
    `RWF_NOWAIT`): a piece the kernel cannot hand over from memory comes
    back short (or `EAGAIN`), is read on waiting, and counts as `missed`;
    the rest of that call's pieces are read waiting, uncounted. A reader
    that finds every piece cached needs no read-ahead hints
    (`grain_cells.io._range_reads.advise`); a reader whose reads missed
    stops asking (`OpenFiles.counting_reads`). Both counts only grow;
    threads may race an increment (a heuristic, never a check). Where
    `RWF_NOWAIT` is refused (another OS, a file system without it)
    nothing is counted again (`supported`): hints are kept.
    """

    def __init__(self):
        self.pieces = 0
        self.missed = 0
        self.supported = bool(_NOWAIT)
        self.probe = False

    def snapshot(self) -> tuple[int, int]:
        """`(pieces, missed)` now."""
        return self.pieces, self.missed


read_counts = ReadCounts()


def pread_pieces(
    fds: Sequence[int],
    dest: np.ndarray,
    offsets: Sequence[int],
    nbytes: Sequence[int],
    dest_starts: Sequence[int],
) -> None:
    """Reads `nbytes[i]` bytes at `offsets[i]` of local descriptor `fds[i]`.

    Into `dest[dest_starts[i]:]` (a uint8 array): many files' pieces in one
    loop (`LocalByteReader.read_into` for each piece's descriptor). Counted
    in `read_counts` while it probes.

    Raises:
        ShortReadError: A file ends before its piece does.
    """
    view = memoryview(dest)
    preadv = os.preadv
    counts = read_counts
    probing = counts.probe and counts.supported
    pieces = missed = 0
    for fd, off, n, d in zip(fds, offsets, nbytes, dest_starts, strict=True):
        got = 0
        if probing:  # asked without waiting: counted
            try:
                got = preadv(fd, [view[d : d + n]], off, _NOWAIT)
            except BlockingIOError:  # nothing of it in memory
                got = -1
            except OSError:  # RWF_NOWAIT refused here: never asked again
                counts.supported = probing = False
                got = 0
            if probing:
                pieces += 1
                if got < n:  # the rest of this call waits, uncounted
                    missed += 1
                    probing = False
                    got = max(got, 0)
        while got < n:  # short reads are legal; zero means end of file
            more = preadv(fd, [view[d + got : d + n]], off + got)
            if more == 0:
                raise ShortReadError(off + got, off + n)
            got += more
    counts.pieces += pieces
    counts.missed += missed


def pread_cached(
    fds: Sequence[int],
    dest: np.ndarray,
    offsets: Sequence[int],
    nbytes: Sequence[int],
    dest_starts: Sequence[int],
) -> list[bool]:
    """`pread_pieces` of the pieces the page cache holds, never waiting.

    Each piece is asked with `RWF_NOWAIT`; one the kernel cannot hand over
    whole from memory (or that the file ends before) is not read but
    hinted (`posix_fadvise(WILLNEED)`), and its entry is False. For a
    read-ahead hint: the pieces missing are fetched together, not waited
    for one by one. Where
    `RWF_NOWAIT` is refused, pieces are read waiting (True; a short file
    False). Never raises for a piece.
    """
    view = memoryview(dest)
    preadv, nowait = os.preadv, _NOWAIT if read_counts.supported else 0
    out = []
    for fd, off, n, d in zip(fds, offsets, nbytes, dest_starts, strict=True):
        try:
            got = preadv(fd, [view[d : d + n]], off, nowait) if nowait else -1
        except BlockingIOError:  # nothing of it in memory
            got = 0
        except OSError:  # RWF_NOWAIT refused here: the rest read waiting
            got, nowait = -1, 0
        if got < 0:
            try:
                pread_pieces([fd], dest, [off], [n], [d])
                got = n
            except (OSError, ShortReadError):
                got = 0
        if got < n:
            advise_pieces([fd], [off], [n])
        out.append(got >= n)
    return out


def advise_pieces(
    fds: Sequence[int], offsets: Sequence[int], nbytes: Sequence[int]
) -> None:
    """`posix_fadvise(WILLNEED)` of many local files' pieces (never raises)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fadvise, willneed = os.posix_fadvise, os.POSIX_FADV_WILLNEED
    for fd, off, n in zip(fds, offsets, nbytes, strict=True):
        try:
            fadvise(fd, off, n, willneed)
        except OSError:  # a hint only
            continue


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

    @classmethod
    def open(cls, path: str) -> LocalByteReader:
        """Opens `path` read-only."""
        return cls(os.open(path, os.O_RDONLY), path)

    def read_into(self, dest, offsets, nbytes, dest_starts) -> None:
        """See `ByteReader.read_into` (counted in `read_counts`)."""
        pread_pieces([self.fd] * len(offsets), dest, offsets, nbytes, dest_starts)

    def advise(self, offsets, nbytes) -> None:
        """`posix_fadvise(WILLNEED)` of each piece (asynchronous)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for off, n in zip(offsets, nbytes, strict=True):
            os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_WILLNEED)

    pin = advise  # the page cache is where a local file's pieces stay at hand

    def stat(self) -> FileStat:
        """`fstat` of the descriptor."""
        return FileStat.of(os.fstat(self.fd))

    def close(self) -> None:
        """Closes the descriptor if this reader opened it."""
        if self._owned and self.fd is not None:
            os.close(self.fd)
            self.fd = None

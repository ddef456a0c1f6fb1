"""`ByteReader`s of files by position (`os.preadv`) and `FileStat`.

Design notes: docs/reference/design.md#storage-readers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Protocol


@dataclasses.dataclass(frozen=True, slots=True)
class FileStat:
    """`os.stat` fields; objects add `etag` and `content`, zarr stores `store`."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    etag: str = ""
    content: str = ""
    store: str = ""

    @classmethod
    def of(cls, st: os.stat_result) -> FileStat:
        """The fields of a `stat` result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def matches(self, st: os.stat_result) -> bool:
        """Whether a local file's `stat` result is this (no `FileStat` built)."""
        now = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        then = (self.ino, self.dev, self.size, self.mtime_ns, self.ctime_ns)
        return now == then and not (self.etag or self.content or self.store)

    def changes(self, now: FileStat) -> list[str]:
        """What differs between this (then) and `now`, in words."""
        out = []
        if self.store != now.store:
            return [
                "the zarr store's keys, sizes or modification times differ "
                f"(store digest {self.store[:16] or 'none'} then, "
                f"{now.store[:16] or 'none'} now): a chunk or metadata file was "
                "written, added or removed"
            ]
        if self.etag != now.etag:
            out.append(f"ETag {self.etag or 'none'} then, {now.etag or 'none'} now")
        if (self.dev, self.ino) != (now.dev, now.ino):
            out.append(
                f"the path now names another file (inode {self.ino} on device "
                f"{self.dev} then, {now.ino} on {now.dev} now)"
            )
        if self.size != now.size:
            out.append(f"size {self.size} bytes then, {now.size} now")
        if self.mtime_ns != now.mtime_ns:
            out.append(f"modified (mtime {self.mtime_ns} ns then, {now.mtime_ns} now)")
        if self.content != now.content and not out:
            what = (  # "blocks:" digests cover every byte (verify_reads)
                "digest of every block (verify_reads)"
                if (self.content or "").startswith("blocks:")
                else "digest of sampled bytes"
            )
            out.append(
                f"its bytes differ ({what} {self.content or 'none'} "
                f"then, {now.content or 'none'} now) while its size, ETag and "
                "Last-Modified are unchanged: rewritten in place with its "
                "modification time kept (rsync -t, cp -p) on a server whose ETag "
                "follows size and modification time, not content (nginx, Apache)"
            )
        if self.ctime_ns != now.ctime_ns and not out:
            out.append(
                f"inode changed (ctime {self.ctime_ns} ns then, {now.ctime_ns} "
                "now): written with its mtime restored, or its permissions changed"
            )
        return out


class ShortReadError(EOFError):
    """The file ends (`end_of_file`) before a piece does (`needed`)."""

    def __init__(self, end_of_file: int, needed: int):
        super().__init__(f"file ends at byte {end_of_file}, data up to {needed}")
        self.end_of_file = end_of_file
        self.needed = needed


class ByteReader(Protocol):
    """Reads `nbytes[i]` at `offsets[i]` into `dest[dest_starts[i]:]`; thread-safe.

    Raises `ShortReadError`. `remote`: a read is a round trip; `advise` (never
    raises) and `pin` are hints; `stat` is the file's now (remote: as built).
    """

    name: str
    remote: bool

    def read_into(self, dest, offsets, nbytes, dest_starts) -> None: ...

    def advise(self, offsets: Sequence[int], nbytes: Sequence[int]) -> None: ...

    def pin(self, offsets: Sequence[int], nbytes: Sequence[int]) -> None: ...

    def stat(self) -> FileStat: ...

    def close(self) -> None: ...


# `preadv` flag: hand over only bytes already in memory (Linux >= 4.14).
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
# A read-ahead hint asks for at most this many bytes of a piece first, and
# stops asking in a call after this many missed (then cold: hinted unasked).
PROBE_BYTES = 1 << 16
PROBE_MISSES = 4


class ReadCounts:
    """Local pieces read and `missed` (not in the page cache) while `probe` is set.

    `hinted`, `hinted_missed`: the same of read-ahead hints' asks (always).
    """

    pieces = missed = hinted = hinted_missed = 0
    supported = bool(_NOWAIT)  # False once `RWF_NOWAIT` is refused
    probe = False

    def snapshot(self, hints: bool = False) -> tuple[int, int]:
        """`(pieces, missed)` now (`hints`: of hints' asks)."""
        if hints:
            return self.hinted, self.hinted_missed
        return self.pieces, self.missed


read_counts = ReadCounts()


def _nowait(fd: int, buf, off: int) -> int | None:
    """Bytes read into `buf` from the page cache alone (0: none of it held).

    None where `RWF_NOWAIT` is refused: then it is never asked again.
    """
    try:
        return os.preadv(fd, [buf], off, _NOWAIT)
    except BlockingIOError:  # nothing of it in memory
        return 0
    except OSError:
        read_counts.supported = False
        return None


def pread_pieces(fds, dest, offsets, nbytes, dest_starts) -> None:
    """`LocalByteReader.read_into` of pieces of `fds[i]`, counted while probing."""
    view = memoryview(dest)
    counts = read_counts
    probing = counts.probe and counts.supported
    pieces = missed = 0
    for fd, off, n, d in zip(fds, offsets, nbytes, dest_starts, strict=True):
        got = _nowait(fd, view[d : d + n], off) if probing else 0
        if got is None:
            got, probing = 0, False
        elif probing:  # asked without waiting: counted
            pieces += 1
            missed += got < n
            probing = got >= n  # else the rest of this call waits, uncounted
        while got < n:  # short reads are legal; zero means end of file
            more = os.preadv(fd, [view[d + got : d + n]], off + got)
            if more == 0:
                raise ShortReadError(off + got, off + n)
            got += more
    counts.pieces += pieces
    counts.missed += missed


def pread_cached(fds, dest, offsets, nbytes, dest_starts) -> list[bool]:
    """`pread_pieces` of the pieces the page cache holds (True), the others hinted."""
    view = memoryview(dest)
    out = []
    for fd, off, n, d in zip(fds, offsets, nbytes, dest_starts, strict=True):
        got = _nowait(fd, view[d : d + n], off) if read_counts.supported else None
        if got is None:  # no asking here: read waiting
            try:
                pread_pieces([fd], dest, [off], [n], [d])
                got = n
            except (OSError, ShortReadError):
                got = 0
        if got < n:
            advise_pieces([fd], [off], [n])
        out.append(got >= n)
    return out


def advise_uncached(fds, offsets, nbytes) -> None:
    """`advise_pieces` of the pieces whose first `PROBE_BYTES` are not in memory.

    Each is asked first without waiting (`RWF_NOWAIT`, counted in
    `read_counts.hinted`) until `PROBE_MISSES` missed; the rest are advised
    unasked. A hint that finds its pages cached is evidence that hints are
    not needed (`OpenFiles.counting_reads`). Never raises.
    """
    if not read_counts.supported or not fds:
        return advise_pieces(fds, offsets, nbytes)
    view = memoryview(bytearray(min(max(nbytes), PROBE_BYTES)))
    cold = []
    for j, (fd, off, n) in enumerate(zip(fds, offsets, nbytes, strict=True)):
        k = min(n, PROBE_BYTES)
        if (_nowait(fd, view[:k], off) or 0) >= k:
            continue
        cold.append(j)
        if len(cold) == PROBE_MISSES:
            break
    read_counts.hinted += j + 1
    read_counts.hinted_missed += len(cold)
    cold += range(j + 1, len(fds))
    advise_pieces(*([x[i] for i in cold] for x in (fds, offsets, nbytes)))


def advise_pieces(fds, offsets, nbytes) -> None:
    """`posix_fadvise(WILLNEED)` of many local files' pieces (never raises)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fadvise, willneed = os.posix_fadvise, os.POSIX_FADV_WILLNEED
    for fd, off, n in zip(fds, offsets, nbytes, strict=True):
        try:
            fadvise(fd, off, n, willneed)
        except OSError:  # a hint only
            continue


def plan_requests(offsets, nbytes, gap: int, max_bytes: int) -> list[tuple]:
    """Sorted pieces `gap` apart as requests `(start, end, first, stop piece)`."""
    requests = []
    if offsets.size == 0:
        return requests
    ends = offsets + nbytes
    start, end, first = int(offsets[0]), int(ends[0]), 0
    for i in range(1, offsets.size):
        o, e = int(offsets[i]), int(ends[i])
        if o <= end + gap and max(end, e) - start <= max_bytes:
            end = max(end, e)
            continue
        requests.append((start, end, first, i))
        start, end, first = o, e, i
    requests.append((start, end, first, int(offsets.size)))
    return requests


def as_byte_reader(fd, name: str) -> ByteReader | None:
    """`fd` as a `ByteReader`: an int descriptor is wrapped, not owned."""
    if fd is None or not isinstance(fd, int):
        return fd
    return LocalByteReader(fd, name, owned=False)


class LocalByteReader:
    """Positional reads (`os.preadv`) of a local file; closes it if `owned`."""

    remote = False

    def __init__(self, fd: int, name: str, *, owned: bool = True):
        self.fd, self.name, self._owned = fd, name, owned

    @classmethod
    def open(cls, path: str) -> LocalByteReader:
        """Opens `path` read-only."""
        return cls(os.open(path, os.O_RDONLY), path)

    def read_into(self, dest, offsets, nbytes, dest_starts) -> None:
        pread_pieces([self.fd] * len(offsets), dest, offsets, nbytes, dest_starts)

    def advise(self, offsets, nbytes) -> None:
        advise_pieces([self.fd] * len(offsets), offsets, nbytes)

    pin = advise  # the page cache is where a local file's pieces stay at hand

    def stat(self) -> FileStat:
        return FileStat.of(os.fstat(self.fd))

    def close(self) -> None:
        if self._owned and self.fd is not None:
            os.close(self.fd)
            self.fd = None

"""`.h5ad` files by path or URL alike: opened, stat'ed, read as bytes.

A URL opens on a `RangeFile`, whose HDF5 metadata is read once per version.

Design notes: docs/reference/design.md#hdf5-remote.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import contextlib
import hashlib
import io
import logging
import os
import pathlib
import threading
import weakref

import h5py
import numpy as np

from grain_cells import errors
from grain_cells._util import fork
from grain_cells._util.cache_files import cache_root
from grain_cells.storage import FileStat, LocalByteReader
from grain_cells.storage.remote import RemoteByteReader, is_url, version_of

_log = logging.getLogger("grain_cells")

BLOCK_BYTES = 64 << 10
CACHE_BLOCKS = 256  # 16 MiB of blocks per open remote file

_range_files: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# A forked child loads its own metadata caches (their locks are the parent's).
_metadata = fork.ProcessCache()


def _close_at_exit() -> None:
    """Closes remote files still open while Python runs (not in HDF5's exit handler).

    That handler runs after the interpreter is gone and calls h5py's file-object
    driver, which takes the GIL.
    """
    for f in list(_range_files.keys()):
        with contextlib.suppress(Exception):  # exiting: nothing to report to
            f.close()


atexit.register(_close_at_exit)


def cache_dir() -> pathlib.Path:
    """Where metadata of remote files is cached: `remote/` in the cache folder."""
    return pathlib.Path(cache_root(xdg=False)) / "remote"


class _Metadata:
    """Bytes of one object version read by h5py, kept in memory and on disk."""

    def __init__(self, url: str, stat: FileStat):
        key = f"{url}\0{stat.etag}\0{stat.size}\0{stat.mtime_ns}\0{stat.content}"
        digest = hashlib.sha256(key.encode())
        self.path = cache_dir() / f"{digest.hexdigest()[:32]}.npz"
        self.starts: list[int] = []
        self.pieces: list[bytes] = []
        self.dirty = False
        self.lock = threading.Lock()
        try:
            with np.load(self.path) as saved:
                offsets, sizes, data = saved["offsets"], saved["sizes"], saved["data"]
            ends = np.cumsum(sizes)
            for o, s, e in zip(
                offsets.tolist(), sizes.tolist(), ends.tolist(), strict=True
            ):
                self.starts.append(o)
                self.pieces.append(data[e - s : e].tobytes())
        except FileNotFoundError:
            pass
        except Exception as e:  # a damaged cache file: read the object again
            _log.warning("%s: ignoring the metadata cache %s (%s)", url, self.path, e)

    def find(self, off: int, n: int):
        with self.lock:
            k = bisect.bisect_right(self.starts, off) - 1
            if k >= 0 and off + n <= self.starts[k] + len(self.pieces[k]):
                lo = off - self.starts[k]
                return memoryview(self.pieces[k])[lo : lo + n]
        return None

    def add(self, off: int, data: bytes) -> None:
        # Kept unmerged until `save` (merging at every add is quadratic); a
        # read spanning two pieces misses here and hits the block cache.
        with self.lock:
            k = bisect.bisect_right(self.starts, off)
            self.starts.insert(k, off)
            self.pieces.insert(k, bytes(data))
            self.dirty = True

    def _merge(self) -> None:
        """Joins overlapping or touching pieces (sorted by start), in one pass."""
        starts, pieces = [], []
        run: list[bytes] = []
        run_start = run_end = 0
        for s, p in zip(self.starts, self.pieces, strict=True):
            if run and s <= run_end:
                if s + len(p) > run_end:
                    run.append(p[run_end - s :])
                    run_end = s + len(p)
                continue
            if run:
                starts.append(run_start)
                pieces.append(b"".join(run))
            run, run_start, run_end = [p], s, s + len(p)
        if run:
            starts.append(run_start)
            pieces.append(b"".join(run))
        self.starts, self.pieces = starts, pieces

    def save(self) -> None:
        with self.lock:
            if not self.dirty:
                return
            self._merge()
            offsets = np.array(self.starts, np.int64)
            sizes = np.array([len(p) for p in self.pieces], np.int64)
            data = np.frombuffer(b"".join(self.pieces), np.uint8)
            self.dirty = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(tmp, offsets=offsets, sizes=sizes, data=data)
            os.replace(tmp, self.path)
        except OSError as e:
            _log.warning("cannot write the metadata cache %s (%s)", self.path, e)


def _bare(e: Exception) -> Exception:
    """A copy of `e` without traceback, cause or context (else an OSError)."""
    try:
        copy = type(e)(*e.args)
        copy.__dict__.update(getattr(e, "__dict__", {}))
    except Exception:
        copy = OSError(f"{type(e).__name__}: {e}")
    return copy


def _metadata_of(url: str, stat: FileStat) -> _Metadata:
    key = (url, stat.etag, stat.size, stat.mtime_ns, stat.content)
    return _metadata.get_or_make(key, lambda: _Metadata(url, stat))


class RangeFile(io.RawIOBase):
    """A read-only file-like view of one object version, for h5py.

    Reads: the metadata cache, an LRU of blocks, then range GETs. Once a read
    finds the version gone, every later read fails with that `failure` (HDF5's
    error paths read on), and `open_remote` raises it rather than HDF5's.
    """

    def __init__(self, url: str, storage_options: dict | None, stat: FileStat):
        super().__init__()
        self.url = url
        self.stat = stat
        self.recording = True
        self._bytes = RemoteByteReader(url, storage_options, stat)
        self._meta = _metadata_of(url, stat)
        self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._pos = 0
        self.failure: Exception | None = None

    def __repr__(self) -> str:  # h5py names the file by it, in ASCII
        return self.url.encode("ascii", "backslashreplace").decode()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.stat.size}
        self._pos = base[whence] + int(offset)
        return self._pos

    def readinto(self, b) -> int:
        """Reads at the position into `b` (HDF5's buffer, from C)."""
        n = max(0, min(len(b), self.stat.size - self._pos))
        if not n:
            return 0
        if self.failure is None:
            try:
                data = self._read(self._pos, n)
            except errors.SourceChangedError as e:
                self.failure = _bare(e)
            except Exception as e:  # e.g. a request that failed: not kept
                del b
                raise _bare(e) from None
        if self.failure is not None:
            # A copy each time, and `b` dropped first: an error kept by this
            # file (or a frame of ours holding HDF5's buffer) in a traceback
            # made a cycle freed only at exit, where the process died of
            # SIGSEGV (tests/storage/test_http_rewrites.py, mid-open rewrite).
            del b
            raise _bare(self.failure)
        memoryview(b).cast("B")[:n] = data
        self._pos += n
        return n

    def _read(self, off: int, n: int):
        hit = self._meta.find(off, n)
        if hit is not None:
            return hit
        if n >= BLOCK_BYTES:
            out = np.empty(n, np.uint8)
            self._bytes.read_into(out, [off], [n], [0])
            data = out.tobytes()
        else:
            first, last = off // BLOCK_BYTES, (off + n - 1) // BLOCK_BYTES
            data = b"".join(self._block(k) for k in range(first, last + 1))
            lo = off - first * BLOCK_BYTES
            data = data[lo : lo + n]
        if self.recording:
            self._meta.add(off, data)
        return data

    def _block(self, k: int) -> bytes:
        block = self._blocks.get(k)
        if block is not None:
            self._blocks.move_to_end(k)
            return block
        start = k * BLOCK_BYTES
        n = min(BLOCK_BYTES, self.stat.size - start)
        out = np.empty(n, np.uint8)
        self._bytes.read_into(out, [start], [n], [0])
        block = self._blocks[k] = out.tobytes()
        while len(self._blocks) > CACHE_BLOCKS:
            self._blocks.popitem(last=False)
        return block

    def save_metadata(self) -> None:
        """Writes what was recorded to the disk cache and stops recording."""
        self.recording = False
        self._meta.save()


def open_remote(
    url: str, storage_options: dict | None = None, stat: FileStat | None = None
) -> h5py.File:
    """Opens an HDF5 object read-only through `RangeFile` (no AnnData check).

    `stat`: the version to read (None: one HEAD now).

    Raises:
        FileNotFoundError: No such object.
        errors.AnnDataFormatError: HDF5 cannot open it.
    """
    if stat is None:
        stat = version_of(url, storage_options)
    rf = RangeFile(url, storage_options, stat)
    f = None
    try:
        f = h5py.File(rf, "r")
    except OSError as e:
        if rf.failure is None:
            raise errors.AnnDataFormatError(
                f"{url}: HDF5 cannot open it ({e}); the object is probably "
                "truncated or not HDF5"
            ) from e
    except Exception:
        if rf.failure is None:
            raise
    if rf.failure is not None:
        # A read found the version gone: its error, not HDF5's, raised out
        # of the except clause (whose frame, kept by the error, would hold
        # HDF5's error in a cycle).
        if f is not None:
            f.close()
        raise _bare(rf.failure)
    _range_files[f] = rf
    return f


def opened(f: h5py.File) -> None:
    """Marks the end of opening `f`: saves remote metadata read so far."""
    rf = _range_files.get(f)
    if rf is not None:
        rf.save_metadata()


def file_name(f: h5py.File) -> str:
    """The path or URL `f` was opened from (h5py's `filename` is ASCII-squeezed)."""
    rf = _range_files.get(f)
    return rf.url if rf is not None else f.filename


def stat_of(f: h5py.File, path: str) -> FileStat:
    """The stat of an open file (for a URL: the version it reads, no request)."""
    rf = _range_files.get(f)
    if rf is not None:
        return rf.stat
    return stat_of_h5(f, path)


def stat_of_h5(f: h5py.File, path: str) -> FileStat:
    """The stat of the descriptor behind an open h5py file (else of `path`)."""
    try:
        fd = f.id.get_vfd_handle()
    except Exception:  # a driver without a POSIX descriptor
        fd = None
    if isinstance(fd, int) and fd >= 0:
        try:
            return FileStat.of(os.fstat(fd))
        except OSError:
            pass
    return FileStat.of(os.stat(path))


def stat_path(path: str, storage_options: dict | None = None) -> FileStat:
    """The stat of a path (`os.stat`) or of an object now (one HEAD)."""
    if is_url(path):
        return version_of(path, storage_options)
    return FileStat.of(os.stat(path))


def open_bytes(path: str, storage_options: dict | None, stat: FileStat):
    """A `ByteReader` of the file, or of the object version `stat` names."""
    if is_url(path):
        return RemoteByteReader(path, storage_options, stat)
    return LocalByteReader.open(path)

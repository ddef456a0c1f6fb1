"""HDF5 files opened read-only by path or URL, failures named.

A URL opens on a `RangeFile` (HDF5 metadata read once per object version).
Design notes: docs/reference/design.md#hdf5-open and #hdf5-remote.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import hashlib
import io
import logging
import os
import pathlib
import re
import weakref

import h5py
import numpy as np

from grain_cells import errors
from grain_cells._util import fork
from grain_cells._util.cache_files import cache_root
from grain_cells.formats import missing_path
from grain_cells.hdf5 import _reads
from grain_cells.storage import FileStat
from grain_cells.storage.remote import Pieces, RemoteByteReader, is_url, version_of

_log = logging.getLogger("grain_cells")

BLOCK_BYTES = 64 << 10
CACHE_BLOCKS = 256  # 16 MiB of blocks per open remote file

# The `RangeFile` of each remote file open.
range_files: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Each object version's metadata while a file of it is open (design notes).
_metadata = fork.WeakProcessCache()


def open_h5(
    path: str, storage_options: dict | None = None, stat: FileStat | None = None
) -> h5py.File:
    """An HDF5 file, or object version `stat` (None: now), read-only; errors named."""
    if is_url(path):
        return open_remote(path, storage_options, stat)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        # Asked only now: a file that opens is there and has the signature.
        try:
            os.stat(path)
        except FileNotFoundError:
            raise missing_path(path) from None
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise errors.AnnDataFormatError(
                    f"{path}: a loop of symbolic links ({path} -> "
                    f"{os.readlink(path)} -> ...); point it at the real file"
                ) from err
            raise errors.AnnDataFormatError(
                f"{path}: cannot be opened ({err})"
            ) from err
        if not h5py.is_hdf5(path):
            raise errors.AnnDataFormatError(
                f"{path}: not an HDF5 file (no HDF5 signature), expected an .h5ad "
                "file written by anndata"
            ) from None
        raise errors.AnnDataFormatError(f"{path}: {_open_failure(e)}") from e
    _reads.opened(f, path)
    return f


_TRUNCATED = re.compile(
    r"truncated file: eof = (\d+), sblock->base_addr = (\d+), stored_eof = (\d+)"
)
_LOCKED = re.compile(r"\block(ed|ing)?\b|unable to lock", re.IGNORECASE)


def _open_failure(e: OSError) -> str:
    """Why HDF5 refused to open a file that has an HDF5 signature."""
    message = str(e)
    # Checked first: "sblock" would match "lock".
    if cut := _TRUNCATED.search(message):
        found, base, stored = (int(g) for g in cut.groups())
        return (
            f"the file is truncated: its superblock records {base + stored:,} "
            f"bytes, but only {found:,} bytes are on disk ({message}). An "
            "interrupted download or copy: copy the file again from its source."
        )
    if _LOCKED.search(message):
        return (
            f"another process holds it open for writing (HDF5 file lock: "
            f"{message}). Wait until the writer closes it. Only if no process "
            "writes it any more (a writer crashed), set HDF5_USE_FILE_LOCKING="
            "FALSE to read it."
        )
    if "already open for write" in message:
        return (
            f"its writer did not close it, or has it open now ({message}). If "
            "no process writes it, clear the flag with `h5clear -s <file>` (HDF5 "
            "tools), then read it."
        )
    return f"HDF5 cannot open it ({message}); the file is probably truncated or corrupt"


@atexit.register
def _close_at_exit() -> None:  # before HDF5's own (design notes, hdf5-remote)
    for f in list(range_files.keys()):
        with contextlib.suppress(Exception):  # exiting: nothing to report to
            f.close()


def _load_metadata(url: str, key: tuple) -> Pieces:
    """HDF5's reads of one object version, as saved in the cache (else none)."""
    digest = hashlib.sha256("\0".join(map(str, key)).encode()).hexdigest()
    meta = Pieces(
        pathlib.Path(cache_root(xdg=False)) / "remote" / f"{digest[:32]}.pieces"
    )
    try:
        meta.load()
    except FileNotFoundError:
        pass
    except Exception as e:  # a damaged cache file: read the object again
        _log.warning("%s: ignoring the metadata cache %s (%s)", url, meta.path, e)
    return meta


def _bare(e: Exception) -> Exception:
    """A copy of `e` without traceback, cause or context (else an OSError)."""
    try:
        copy = type(e)(*e.args)
        copy.__dict__.update(getattr(e, "__dict__", {}))
    except Exception:
        copy = OSError(f"{type(e).__name__}: {e}")
    return copy


class RangeFile(io.RawIOBase):
    """One object version as a file for h5py; once gone, every read raises `failure`."""

    def __init__(self, url: str, storage_options: dict | None, stat: FileStat):
        super().__init__()
        self.url = url
        self.stat = stat
        self.recording = True
        self._bytes = RemoteByteReader(url, storage_options, stat)
        key = (url, stat.etag, stat.size, stat.mtime_ns, stat.content)
        self._meta = _metadata.get_or_make(key, lambda: _load_metadata(url, key))
        self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._pos = 0
        self.failure: Exception | None = None
        self.error: Exception | None = None  # the last failed read's (the open's)

    def __repr__(self) -> str:  # h5py names the file by it, in ASCII
        return self.url.encode("ascii", "backslashreplace").decode()

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
            except Exception as e:  # e.g. a request that failed: not sticky
                del b
                self.error = _bare(e)
                raise _bare(e) from None
        if self.failure is not None:  # a copy, `b` dropped (design notes, hdf5-remote)
            del b
            raise _bare(self.failure)
        memoryview(b).cast("B")[:n] = data
        self._pos += n
        return n

    def _read(self, off: int, n: int):
        """Bytes `[off, off + n)`: from the metadata, else whole blocks (LRU)."""
        data = self._meta.find(off, n)
        if data is not None:
            return data
        if n >= BLOCK_BYTES:
            data = self._get(off, n)
        else:
            first, last = off // BLOCK_BYTES, (off + n - 1) // BLOCK_BYTES
            blocks = []
            for k in range(first, last + 1):
                if k not in self._blocks:
                    self._blocks[k] = self._get(k * BLOCK_BYTES, BLOCK_BYTES)
                    while len(self._blocks) > CACHE_BLOCKS:
                        self._blocks.popitem(last=False)
                self._blocks.move_to_end(k)
                blocks.append(self._blocks[k])
            data = b"".join(blocks)[off - first * BLOCK_BYTES :][:n]
        if self.recording:
            self._meta.add(off, data)
        return data

    def opened(self) -> None:
        """The open is done: saves the metadata HDF5 read, stops recording."""
        self.recording = False
        try:
            self._meta.save()
        except OSError as e:
            _log.warning("cannot write the metadata cache %s (%s)", self._meta.path, e)

    def _get(self, off: int, n: int) -> bytes:
        n = min(n, self.stat.size - off)
        out = np.empty(n, np.uint8)
        self._bytes.read_into(out, [off], [n], [0])
        return out.tobytes()


def open_remote(url: str, storage_options: dict | None, stat: FileStat | None):
    """`open_h5` of a URL: `FileNotFoundError`, `AnnDataFormatError` (not HDF5)."""
    if stat is None:
        stat = version_of(url, storage_options)
    rf = RangeFile(url, storage_options, stat)
    f = None
    try:
        f = h5py.File(rf, "r")
    except OSError as e:
        if rf.failure is None and rf.error is None:
            raise errors.AnnDataFormatError(
                f"{url}: HDF5 cannot open it ({e}); the object is probably "
                "truncated or not HDF5"
            ) from e
    except Exception:
        if rf.failure is None and rf.error is None:
            raise
    # The version gone, or a request failed (not the bytes): its error, outside
    # `except`.
    if rf.failure is not None or (f is None and rf.error is not None):
        if f is not None:
            f.close()
        raise _bare(rf.failure or rf.error)
    range_files[f] = rf
    return f

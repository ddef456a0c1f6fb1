"""The stored bytes of a zarr store's keys, read without zarr's event loop.

`KeyReader.for_store` wraps the store a zarr array was opened from:

* `zarr.storage.LocalStore`: each key is a file under the store's root, read
  with `os.pread` (releases the GIL, so reader threads overlap);
* `zarr.storage.ZipStore`: members of the zip file (`zipfile` serialises
  reads of one archive behind its lock; stored members are cheap to read);
* `zarr.storage.ObjectStore` (obstore: S3, GCS, Azure, HTTP): range GETs,
  all of a read's requests in flight at once on obstore's runtime.

Anything else returns None and the reader goes through zarr's own slicing.

Every method returns None for a key that does not exist (zarr's meaning of
"chunk never written"); the caller decides whether that is allowed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import zipfile

import zarr


class KeyReader:
    """Reads whole keys or byte ranges of keys of one store. Thread-safe."""

    remote = False

    @staticmethod
    def for_store(store) -> KeyReader | None:
        """A reader of `store`'s keys, or None for a store kind not handled."""
        if isinstance(store, zarr.storage.LocalStore):
            return LocalKeys(os.fspath(store.root))
        if isinstance(store, zarr.storage.ZipStore):
            return ZipKeys(os.fspath(store.path))
        if isinstance(store, zarr.storage.ObjectStore):
            return ObjectKeys(store.store)
        return None

    def get(self, key: str) -> bytes | None:
        """The whole value of `key`, or None when it does not exist."""
        raise NotImplementedError

    def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        """Bytes `[start, stop)` of `key` (fewer at its end), or None."""
        raise NotImplementedError

    def get_suffix(self, key: str, nbytes: int) -> bytes | None:
        """The last `nbytes` of `key` (all of it if shorter), or None."""
        raise NotImplementedError

    def get_many(self, requests: list[tuple[str, int | None, int | None]]) -> list:
        """`get` (start None), `get_range`, or `get_suffix` (start < 0: the
        last `-start` bytes) for each `(key, start, stop)`.

        Remote readers send every request at once; local ones read in turn
        (the caller's threads give the concurrency).
        """
        return [
            self.get(k)
            if a is None
            else self.get_suffix(k, -a)
            if a < 0
            else self.get_range(k, a, b)
            for k, a, b in requests
        ]


class LocalKeys(KeyReader):
    """Keys of a directory store: one file per key."""

    def __init__(self, root: str):
        self.root = root

    def _open(self, key: str) -> int | None:
        try:
            return os.open(os.path.join(self.root, key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def get(self, key: str) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            return _pread_full(fd, size, 0)
        finally:
            os.close(fd)

    def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            return _pread_full(fd, stop - start, start)
        finally:
            os.close(fd)

    def get_suffix(self, key: str, nbytes: int) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - nbytes)
            return _pread_full(fd, size - start, start)
        finally:
            os.close(fd)


def _pread_full(fd: int, nbytes: int, offset: int) -> bytes:
    parts = []
    while nbytes > 0:
        got = os.pread(fd, nbytes, offset)
        if not got:
            break
        parts.append(got)
        nbytes -= len(got)
        offset += len(got)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class ZipKeys(KeyReader):
    """Keys of a `.zarr.zip`: members of the archive (opened per process)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._zip: zipfile.ZipFile | None = None
        self._pid = None

    def _archive(self) -> zipfile.ZipFile:
        with self._lock:
            if self._zip is None or self._pid != os.getpid():
                self._zip = zipfile.ZipFile(self.path, "r")
                self._pid = os.getpid()
            return self._zip

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

    def get(self, key: str) -> bytes | None:
        try:
            return self._archive().read(key)
        except KeyError:
            return None

    def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        try:
            with self._archive().open(key) as f:
                f.seek(start)
                return f.read(stop - start)
        except KeyError:
            return None

    def get_suffix(self, key: str, nbytes: int) -> bytes | None:
        try:
            info = self._archive().getinfo(key)
        except KeyError:
            return None
        start = max(0, info.file_size - nbytes)
        return self.get_range(key, start, info.file_size)


class ObjectKeys(KeyReader):
    """Keys of an obstore store (rooted at the zarr store): range GETs."""

    remote = True

    def __init__(self, store):
        self.store = store

    def get(self, key: str) -> bytes | None:
        return self.get_many([(key, None, None)])[0]

    def get_range(self, key: str, start: int, stop: int) -> bytes | None:
        return self.get_many([(key, start, stop)])[0]

    def get_suffix(self, key: str, nbytes: int) -> bytes | None:
        return self.get_many([(key, -nbytes, None)])[0]

    def get_many(self, requests):
        """Every request in flight at once (obstore's async API, one loop)."""
        import obstore

        async def one(key, start, stop):
            try:
                if start is not None and start >= 0:
                    return bytes(
                        await obstore.get_range_async(
                            self.store, key, start=start, end=stop
                        )
                    )
                options = None if start is None else {"range": {"suffix": -start}}
                resp = await obstore.get_async(self.store, key, options=options)
                return bytes(await resp.bytes_async())
            except FileNotFoundError:
                return None

        async def gather():
            return await asyncio.gather(*(one(*r) for r in requests))

        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(gather())
        # Called from a thread with a running loop (a notebook's): run ours
        # in a thread of its own.
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            return ex.submit(asyncio.run, gather()).result()

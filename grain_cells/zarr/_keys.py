"""The stored bytes of a zarr store's keys: files, zip members or range GETs.

In a bucket, reads are conditional on each key's version (ETag) as the process
opened the store: a re-upload raises `SourceChangedError`, never mixes versions.
Design notes: docs/reference/design.md#zarr-keys, #zarr-versions.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import zipfile

import numpy as np
import zarr

from grain_cells import errors
from grain_cells._util import fork
from grain_cells.formats import wait_all
from grain_cells.storage.remote import (
    check_not_forked_after_use,
    count_request,
)

FETCH_THREADS = 32  # keys one read of a remote store fetches at once, per process


def key_reader(store) -> KeyReader | None:
    """A reader of `store`'s keys, or None for a store kind not handled."""
    if isinstance(store, zarr.storage.LocalStore):
        return LocalKeys(os.fspath(store.root))
    if isinstance(store, zarr.storage.ZipStore):
        return ZipKeys(os.fspath(store.path))
    if isinstance(store, zarr.storage.ObjectStore):
        versions = getattr(store, "versions", None)
        return ObjectKeys(store.store, versions, getattr(store, "url", ""))
    return None


class KeyReader:
    """Reads whole keys or byte ranges of keys of one store. Thread-safe."""

    remote = False

    def get(self, key: str, start=None, stop=None) -> bytes | None:
        """Bytes `[start, stop)` of `key` (None: all; fewer at its end), or None."""
        return self.get_many([(key, start, stop)])[0]

    def get_many(self, requests: list[tuple[str, int | None, int | None]]) -> list:
        """`get` of each `(key, start, stop)` (start < 0: a suffix), remote at once."""
        return [self._get(*request) for request in requests]


class LocalKeys(KeyReader):
    """Keys of a directory store: one file per key."""

    def __init__(self, root: str):
        self.root = root

    def open(self, key: str) -> int | None:
        """A descriptor of `key`'s file (the caller closes it), or None."""
        try:
            return os.open(os.path.join(self.root, key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _get(self, key, start, stop):
        try:  # by path: an error then names the chunk's file, not a descriptor
            with open(os.path.join(self.root, key), "rb") as f:  # (reads all)
                if start is None:
                    return f.read()
                if start < 0:
                    start, stop = max(0, os.fstat(f.fileno()).st_size + start), None
                f.seek(start)
                return f.read(None if stop is None else max(0, stop - start))
        except (FileNotFoundError, NotADirectoryError):
            return None


class ZipKeys(KeyReader):
    """Keys of a `.zarr.zip`: members of the archive (opened per process)."""

    def __init__(self, path: str):
        self.path = path
        # One archive per process, read under a lock: threads race on its position.
        self._forget()
        fork.in_child_of(self, ZipKeys._forget)

    def _forget(self) -> None:  # a parent's thread may have held the lock
        self._lock, self._zip = threading.Lock(), None

    def _get(self, key, start, stop):
        try:
            with self._lock:
                if self._zip is None:
                    self._zip = zipfile.ZipFile(self.path, "r")
                if start is None:
                    return self._zip.read(key)
                if start < 0:
                    size = self._zip.getinfo(key).file_size
                    start, stop = max(0, size + start), size
                with self._zip.open(key) as f:
                    f.seek(start)
                    return f.read(stop - start)
        except KeyError:
            return None


class ObjectKeys(KeyReader):
    """Keys by range GETs; with `versions`, each conditional on the key's ETag."""

    remote = True

    def __init__(self, store, versions=None, url: str = ""):
        self._store, self._versions, self._url = store, versions, url or str(store)
        self._pid = os.getpid()
        self._lock = threading.Lock()

    @property
    def store(self):
        """This process's client of the store."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._store = pickle.loads(pickle.dumps(self._store))
                    self._pid = os.getpid()
        return self._store

    def get_many(self, requests):  # one call per key, in threads
        check_not_forked_after_use(self._url)
        by_key: dict[str, list[int]] = {}
        for i, (key, _, _) in enumerate(requests):
            by_key.setdefault(key, []).append(i)
        results: list = [None] * len(requests)

        def fetch(key: str, which: list[int]) -> None:
            got = self._fetch_key(key, [requests[i] for i in which])
            for i, value in zip(which, got, strict=False):
                results[i] = value

        groups = list(by_key.items())
        if len(groups) == 1:
            fetch(*groups[0])
            return results
        pool = fork.thread_pool("grain_cells-zarr-get", FETCH_THREADS)
        wait_all([pool.submit(fetch, key, which) for key, which in groups])
        return results

    def _fetch_key(self, key: str, reqs: list) -> list:
        import obstore
        from obstore import exceptions as ox

        etag = None
        if self._versions is not None:
            etag = self._versions.etag(key)
            if etag is None:  # not in the store when this process opened it
                return [None] * len(reqs)
        store = self.store
        try:
            ranges = [(a, b) for _, a, b in reqs if a is not None and a >= 0]
            if len(ranges) == len(reqs) and (len(ranges) > 1 or not etag):
                count_request("get", len(ranges))
                starts, ends = [a for a, _ in ranges], [b for _, b in ranges]
                got = obstore.get_ranges(store, key, starts=starts, ends=ends)
                if etag:  # get_ranges takes no If-Match: the key's version after
                    count_request("check")
                    now = obstore.head(store, key).get("e_tag") or ""
                    if now != etag:
                        raise self._changed(key, etag, now)
                return [bytes(x) for x in got]
            out = []
            for _, a, b in reqs:
                options = {"if_match": etag} if etag else {}
                if a is not None:
                    options["range"] = {"suffix": -a} if a < 0 else (a, b)
                count_request("get")
                out.append(bytes(obstore.get(store, key, options=options).bytes()))
            return out
        except ox.PreconditionError:
            raise self._changed(key, etag, "another") from None
        except FileNotFoundError:
            if etag is not None:  # listed when opened: removed since
                raise self._changed(key, etag, "none (removed)") from None
            return [None] * len(reqs)

    def _changed(self, key: str, then: str, now: str) -> errors.SourceChangedError:
        return errors.SourceChangedError(
            f"{self._url}: changed since the AnnDataSource was built: key "
            f"{key!r} had the ETag {then} when this process opened the store and "
            f"has {now} now (the store was rewritten or re-uploaded while being "
            "read; no value of the new version was returned). Build a new "
            "source over the store (and do not restore iterator state saved "
            "for the old data); upload a new version under a new prefix to "
            "keep a running loader's version readable."
        )


def _key_hash(key: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"
    )


class KeyVersions:
    """A LIST's ETag per key, by 64-bit key hash (a collision: a read refuses)."""

    def __init__(self, metas):  # obstore's `ObjectMeta`s, paths relative to the store
        pairs = sorted(
            (_key_hash(m["path"]), (m.get("e_tag") or "").encode()) for m in metas
        )
        self._hashes = np.fromiter((h for h, _ in pairs), np.uint64, len(pairs))
        width = max((len(e) for _, e in pairs), default=1) or 1
        self._etags = np.array([e for _, e in pairs], dtype=f"S{width}")
        self.nbytes = int(self._hashes.nbytes + self._etags.nbytes)

    def __len__(self) -> int:
        return int(self._hashes.size)

    def etag(self, key: str) -> str | None:
        """The key's ETag when listed ("" if the store sent none); None: not listed."""
        h = np.uint64(_key_hash(key))
        i = int(np.searchsorted(self._hashes, h))
        if i == self._hashes.size or self._hashes[i] != h:
            return None
        return self._etags[i].decode()


# `store_digest`'s listings by store, for this thread's next `zarr_store`.
_listed = threading.local()
fork.in_child(lambda: vars(_listed).clear())  # the parent's are not the child's


def remember(store, versions: KeyVersions) -> None:
    """Keeps this thread's latest listing of `store` (`storage.remote.store_at`)."""
    vars(_listed)[id(store)] = versions


def take(store) -> KeyVersions | None:
    """This thread's latest listing of `store` (removed), or None."""
    return vars(_listed).pop(id(store), None)


class VersionedObjectStore(zarr.storage.ObjectStore):
    """zarr's `ObjectStore` with its URL and `KeyVersions` (None: not listed)."""

    def __init__(self, store, *, read_only: bool = True, url: str = "", versions=None):
        super().__init__(store, read_only=read_only)
        self.url, self.versions = url, versions

    def with_read_only(self, read_only: bool = False) -> VersionedObjectStore:
        return type(self)(
            self.store, read_only=read_only, url=self.url, versions=self.versions
        )

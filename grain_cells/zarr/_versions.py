"""The version (ETag) of each key of a zarr store in a bucket, as a process opened it.

Chunk reads are conditional on them, so a re-upload raises
`SourceChangedError` at the first changed key instead of mixing versions.
Design notes: docs/reference/design.md#zarr-versions.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import zarr

from grain_cells._util import fork


def _key_hash(key: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"
    )


class KeyVersions:
    """The ETag of each key of a store, from one listing. Immutable, picklable.

    Keys are 64-bit hashes: a collision (about 1 in 10^9 at 100,000 keys) only
    makes a read refuse with `SourceChangedError`.
    """

    def __init__(self, listing):  # (key, etag) pairs; an etag "" is unknown
        pairs = sorted((_key_hash(k), (e or "").encode()) for k, e in listing)
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

    @classmethod
    def of_metas(cls, metas) -> KeyVersions:
        """From obstore's `ObjectMeta`s of a LIST (paths relative to the store)."""
        return cls((m["path"], m.get("e_tag") or "") for m in metas)


# Listings taken by `store_digest`, by (thread, obstore store), waiting for the
# `zarr_store` call that opens the same store in the same thread.
_waiting: dict = {}
_waiting_lock = threading.Lock()


@fork.in_child
def _after_fork() -> None:
    # A parent's thread may have held the lock at the fork; its listings
    # belong to threads the child does not have.
    global _waiting_lock
    _waiting_lock = threading.Lock()
    _waiting.clear()


def remember(store, versions: KeyVersions) -> None:
    """Keeps this thread's latest listing of `store` (`storage.remote.store_at`)."""
    with _waiting_lock:
        _waiting[threading.get_ident(), id(store)] = versions


def take(store) -> KeyVersions | None:
    """This thread's latest listing of `store` (removed), or None."""
    with _waiting_lock:
        return _waiting.pop((threading.get_ident(), id(store)), None)


class VersionedObjectStore(zarr.storage.ObjectStore):
    """zarr's `ObjectStore` with its URL and `KeyVersions` (None: not listed)."""

    def __init__(self, store, *, read_only: bool = True, url: str = "", versions=None):
        super().__init__(store, read_only=read_only)
        self.url, self.versions = url, versions

    def with_read_only(self, read_only: bool = False) -> VersionedObjectStore:
        return type(self)(
            self.store, read_only=read_only, url=self.url, versions=self.versions
        )

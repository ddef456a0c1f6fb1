"""Partial reads of uncompressed chunks: only the bytes the ranges need (`os.preadv`).

Design notes: docs/reference/design.md#zarr-raw.
"""

from __future__ import annotations

import itertools
import os

import numpy as np

from grain_cells import errors
from grain_cells.formats import run_parts
from grain_cells.zarr._chunks import Chunks, pieces
from grain_cells.zarr._codecs import MAX_UINT_64
from grain_cells.zarr._keys import LocalKeys

# Below this many bytes a read is not split over the pool's threads.
_MIN_BYTES_PER_TASK = 1 << 20
_MAX_TASKS = 4


def applies(chunks: Chunks, cache_bytes: int) -> bool:
    """Whether `RawReads` serves this array (see the design notes)."""
    dtype = chunks.codec.stored_dtype
    return (
        not chunks.codec.stages
        and isinstance(chunks.keys, LocalKeys)
        and len(chunks.shape) == 1
        and not cache_bytes
        and (dtype.isnative or dtype.itemsize == 1)
    )


class RawReads:
    """Reads ranges of an uncompressed 1-D zarr array by byte range. Thread-safe."""

    def __init__(self, chunks: Chunks):
        self._chunks, self._codec, self._keys = chunks, chunks.codec, chunks.keys
        self._item = self._codec.stored_dtype.itemsize
        self._chunk_len = int(self._codec.chunk_shape[0])
        self._chunk_bytes = self._codec.chunk_items * self._item
        # A 1-D chunk's key is its number inside a fixed text (zarr's key
        # encoding: "x/12", "x/c/12", "x.12"): formatted, not re-encoded.
        probe = chunks.key((987654321,))
        self._key = lambda k: chunks.key((k,))
        if probe.count("987654321") == 1 and not {"{", "}"} & set(probe):
            template = probe.replace("987654321", "{}")
            if template.format(0) == chunks.key((0,)):
                self._key = template.format

    def plan(self, starts: np.ndarray, stops: np.ndarray):
        """`(names, key_id, ks, offsets, nbytes, dests, missing)` of reading ranges.

        The keys read, and per piece its key's index in `names`, row chunk, byte
        offset and count in the key, byte offset in the destination, and whether
        its chunk has no stored bytes (its shard's index says so, or no shard).
        """
        ks, src, dests, nbytes = pieces(starts, stops, self._chunk_len)
        item = self._item
        dests, nbytes = dests * item, nbytes * item
        missing = np.zeros(ks.size, bool)
        if self._codec.shard is None:
            uniq, key_id = np.unique(ks, return_inverse=True)
            names = [self._key(k) for k in uniq.tolist()]
            base = np.zeros(ks.size, np.int64)
        else:
            per = int(self._codec.shard.per_shard[0])
            shard_id = ks // per
            shards = np.unique(shard_id)
            self._chunks.load_shard_indices([(s,) for s in shards.tolist()])
            key_id = np.searchsorted(shards, shard_id)
            names = [self._chunks.key((s,)) for s in shards.tolist()]
            base = np.zeros(ks.size, np.int64)
            for i, s in enumerate(shards.tolist()):
                sel = key_id == i
                index = self._chunks.shard_index((s,))
                if index is None:
                    missing[sel] = True
                    continue
                entry = index[ks[sel] % per]
                empty = (entry[:, 0] == MAX_UINT_64) & (entry[:, 1] == MAX_UINT_64)
                missing[np.flatnonzero(sel)[empty]] = True
                wrong = ~empty & (entry[:, 1] != self._chunk_bytes)
                if wrong.any():
                    j = int(np.flatnonzero(wrong)[0])
                    self._corrupt(
                        int(ks[sel][j]),
                        names[i],
                        int(entry[j, 0]),
                        f"its shard's index gives it {int(entry[j, 1])} bytes",
                    )
                base[sel] = np.where(empty, 0, entry[:, 0].astype(np.int64))
        offsets = base + src * item
        return names, key_id, ks, offsets, nbytes, dests, missing

    def read(self, starts, stops, dest: np.ndarray, pool=None, pending=None) -> None:
        """Reads sorted, disjoint, non-empty ranges, concatenated, into `dest`."""
        names, key_id, ks, offsets, nbytes, dests, missing = self.plan(starts, stops)
        view = memoryview(dest.reshape(-1).view(np.uint8))
        for p in np.flatnonzero(missing).tolist():  # fill value or an error
            self._fill(view, int(ks[p]), int(offsets[p]), int(nbytes[p]), int(dests[p]))
        if missing.any():
            keep = ~missing
            key_id, ks, offsets, nbytes, dests = (
                a[keep] for a in (key_id, ks, offsets, nbytes, dests)
            )
        if not ks.size:
            return
        lists = [a.tolist() for a in (key_id, ks, offsets, nbytes, dests)]

        def task(a, b):
            self._read_pieces(view, names, *(x[a:b] for x in lists))

        for a, b in run_parts(
            pool,
            ks.size,
            task,
            pending,
            max_tasks=_MAX_TASKS,
            sizes=nbytes,
            min_bytes=_MIN_BYTES_PER_TASK,
        ):
            task(a, b)

    def advise(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """Asks the OS to start reading these ranges (`POSIX_FADV_WILLNEED`)."""
        if not hasattr(os, "posix_fadvise"):  # pragma: no cover - not Linux
            return
        names, key_id, _, offsets, nbytes, _, missing = self.plan(starts, stops)
        keep = ~missing
        key_id, offsets, nbytes = key_id[keep], offsets[keep], nbytes[keep]
        bounds = np.flatnonzero(np.diff(key_id)) + 1
        for lo, hi in itertools.pairwise([0, *bounds.tolist(), key_id.size]):
            fd = self._keys.open(names[int(key_id[lo])])
            if fd is None:
                continue
            try:
                for off, nb in zip(
                    offsets[lo:hi].tolist(), nbytes[lo:hi].tolist(), strict=True
                ):
                    os.posix_fadvise(fd, off, nb, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def _read_pieces(self, view, names, key_id, ks, offsets, nbytes, dests) -> None:
        for kid, group in itertools.groupby(range(len(key_id)), key_id.__getitem__):
            ps = list(group)
            key = names[kid]
            fd = self._keys.open(key)
            if fd is None:  # no chunk file (or no shard): Chunks' rule applies
                for p in ps:
                    self._fill(view, ks[p], offsets[p], nbytes[p], dests[p])
                continue
            try:
                if self._codec.shard is None:
                    size = os.fstat(fd).st_size
                    if size != self._chunk_bytes:
                        self._corrupt(
                            ks[ps[0]], key, None, f"its file holds {size} bytes"
                        )
                for p in ps:
                    off, nb, d = offsets[p], nbytes[p], dests[p]
                    got = os.preadv(fd, [view[d : d + nb]], off)
                    while got < nb:  # short reads are legal; zero means the end
                        more = os.preadv(fd, [view[d + got : d + nb]], off + got)
                        if more == 0:
                            self._corrupt(
                                ks[p], key, off, f"its file ends at byte {off + got}"
                            )
                        got += more
            finally:
                os.close(fd)

    def _fill(self, view, k: int, off: int, nb: int, d: int) -> None:
        """A piece of a chunk with no stored bytes: `Chunks.chunk` fills or raises."""
        chunk = self._chunks.chunk((k,), None)
        flat = memoryview(np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        base = 0
        if self._codec.shard is not None:
            _, a, _, _ = self._chunks.request((k,))
            base = a if a is not None and a >= 0 else 0
        view[d : d + nb] = flat[off - base : off - base + nb]

    def _corrupt(self, k, key, offset, found: str):
        rows = self._chunks.rows(k)
        held = f" It holds rows [{rows[0]}, {rows[1]})."
        raise errors.CorruptChunkError(
            f"{self._chunks.path}: {self._chunks.name} chunk key {key!r} "
            f"(uncompressed) is corrupt: {found}, an uncompressed chunk of "
            f"{self._codec.chunk_items} x {self._item}-byte values is "
            f"{self._chunk_bytes}.{held} The store is damaged (truncated or "
            "rewritten during a copy): rewrite or re-copy it.",
            path=self._chunks.path,
            dataset=self._chunks.name,
            byte_offset=offset,
            rows=rows,
            chunk_key=key,
        )

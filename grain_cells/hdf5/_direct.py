"""Positional reads of byte pieces: what the cache holds inline, the rest on threads.

`RangeReader` (`grain_cells.hdf5._reads`) turns element ranges of an
uncompressed dataset into byte pieces: a file offset, a byte count and a
place in the destination. `read_pieces` reads them:

* Pieces that follow each other in the file are read by one `preadv` into
  their places, wherever those are (`LocalByteReader.read_groups`): a fetch
  whose cells are wanted in shuffled order is read straight into that order,
  with the same calls as a read in file order.
* A large read (2 MiB or more, two groups or more) with a thread pool first
  reads, on the calling thread, the leading groups the page cache holds
  (`RWF_NOWAIT`), then splits the rest over the pool's threads: on a warm
  cache, handing pieces to threads costs more CPU than the copies; on a cold
  one the threads keep several reads in flight.
* A `ByteReader` without `read_groups` (an object store's) reads piece by
  piece with `read_into`, inline: it runs its own requests concurrently.
"""

from __future__ import annotations

import itertools

import numpy as np

from grain_cells import errors
from grain_cells.storage._readers import ByteReader, TruncatedError

# Below this many bytes a thread pool costs more than it saves.
MIN_BYTES_PER_THREAD = 1 << 20
# Buffers per `preadv` (Linux's IOV_MAX is 1024).
_MAX_IOV = 1024


def group_ends(offsets: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Ends (exclusive) of runs of pieces that follow each other in the file.

    A run is cut every `_MAX_IOV` pieces (one `preadv` each).
    """
    n = offsets.size
    joins = offsets[1:] == offsets[:-1] + nbytes[:-1]
    ends = np.append(np.flatnonzero(~joins) + 1, n).astype(np.int64)
    lengths = np.diff(ends, prepend=0)
    if n and lengths.max() > _MAX_IOV:
        long = lengths > _MAX_IOV
        cuts = [
            np.arange(e - k + _MAX_IOV, e, _MAX_IOV)
            for e, k in zip(ends[long].tolist(), lengths[long].tolist(), strict=True)
        ]
        ends = np.union1d(ends, np.concatenate(cuts)).astype(np.int64)
    return ends


def read_pieces(
    fd: ByteReader,
    dest: np.ndarray,
    offsets: np.ndarray,
    nbytes: np.ndarray,
    dest_starts: np.ndarray,
    pool,
    what,
) -> None:
    """Reads `nbytes[i]` bytes at `offsets[i]` into `dest[dest_starts[i]:]`.

    Args:
        fd: Where the bytes are.
        dest: A uint8 array.
        offsets: File offsets of the pieces, int64 (any order).
        nbytes: Their sizes.
        dest_starts: Their places in `dest`.
        pool: Optional thread pool (`file_set.ReadPool`).
        what: The reader, for messages (`path`, `name`).

    Raises:
        errors.CorruptDataError: The file is shorter than the pieces need.
    """
    total = int(nbytes.sum()) if nbytes.size else 0
    read_groups = getattr(fd, "read_groups", None)
    if read_groups is None or fd.remote:
        # A remote reader runs its own GETs concurrently and copies what
        # read-ahead holds with the GIL held: splitting its read over the
        # pool's threads only adds GIL hand-offs (a third of a 0-worker
        # reader's time went waiting on them).
        lists = (offsets.tolist(), nbytes.tolist(), dest_starts.tolist())
        _checked(what, fd.read_into, dest, *lists)
        return
    ends = group_ends(offsets, nbytes)
    lists = (offsets.tolist(), nbytes.tolist(), dest_starts.tolist())
    if pool is None or total < 2 * MIN_BYTES_PER_THREAD or ends.size < 2:
        _checked(what, read_groups, dest, *lists, ends.tolist())
        return
    # What the page cache holds is read here; the threads read the rest.
    k = read_groups(dest, *lists, ends.tolist(), nowait=True)
    if k == ends.size:
        return
    first = int(ends[k - 1]) if k else 0
    ends = ends[k:] - first
    offsets, nbytes, dest_starts = offsets[first:], nbytes[first:], dest_starts[first:]
    total = int(nbytes.sum())
    n_jobs = min(getattr(pool, "threads", 4), ends.size, total // MIN_BYTES_PER_THREAD)
    if n_jobs < 2:
        lists = (offsets.tolist(), nbytes.tolist(), dest_starts.tolist())
        _checked(what, read_groups, dest, *lists, ends.tolist())
        return
    # Cut between groups, near equal byte counts.
    done = np.cumsum(nbytes)[ends - 1]
    cuts = np.searchsorted(done, np.linspace(0, total, n_jobs + 1)[1:-1])
    bounds = np.unique([0, *cuts.tolist(), ends.size]).tolist()
    futures = []
    for a, b in itertools.pairwise(bounds):
        lo = int(ends[a - 1]) if a else 0
        hi = int(ends[b - 1])
        futures.append(
            pool.submit(
                _checked,
                what,
                read_groups,
                dest,
                offsets[lo:hi].tolist(),
                nbytes[lo:hi].tolist(),
                dest_starts[lo:hi].tolist(),
                (ends[a:b] - lo).tolist(),
            )
        )
    for f in futures:
        f.result()


def _checked(what, read, *args):
    """`read(*args)`, a truncated file reported as corrupt data."""
    try:
        return read(*args)
    except TruncatedError as e:
        raise errors.CorruptDataError(
            f"{what.path}: {what.name} ends at byte {e.end_of_file} of the "
            f"file but HDF5 places data up to byte {e.needed}: the file is "
            "truncated."
        ) from None

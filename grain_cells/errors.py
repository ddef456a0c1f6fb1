"""Errors raised for bad input.

Every error names the file, the element inside it, what was expected and what
was found, and the fix when there is one. They subclass builtins so callers can
catch them broadly (`ValueError`, `KeyError`, `IndexError`).
"""

from __future__ import annotations

import errno


class AnnDataFormatError(ValueError):
    """A file is not a readable AnnData `.h5ad`, or an element is malformed."""


class UnsupportedLayoutError(AnnDataFormatError):
    """An element is valid AnnData but stored in a layout this reader refuses."""


class CorruptDataError(AnnDataFormatError):
    """Stored values contradict the format (e.g. `indptr` decreasing)."""


class _Fields:
    """Keyword attributes `_fields` (None when not given) that cross worker
    processes intact; `str()` is the message.
    """  # noqa: D205

    _fields: tuple[str, ...] = ()
    _errno: int | None = None  # an OSError's code, its first argument

    def __init__(self, message: str, **fields):
        if unknown := set(fields).difference(self._fields):
            raise TypeError(f"{type(self).__name__} takes no {sorted(unknown)}")
        super().__init__(*(() if self._errno is None else (self._errno,)), message)
        for name in self._fields:
            setattr(self, name, fields.get(name))

    def __str__(self) -> str:
        return str(self.args[-1]) if self.args else ""

    def __reduce__(self):
        return (type(self), self.args[-1:], self.__dict__)


class CorruptChunkError(_Fields, CorruptDataError):
    """A compressed chunk fails to decode or fails its checksum.

    Attributes:
        path: The file.
        dataset: The HDF5 dataset (or zarr array) holding the chunk.
        byte_offset: Where the chunk is stored in the file (in its shard,
            for a sharded zarr array).
        rows: `(first, stop)`: the rows (elements of a 1-D dataset) it holds.
        chunk_key: For a zarr store, the key of the chunk (or its shard).
    """

    _fields = ("path", "dataset", "byte_offset", "rows", "chunk_key")


class SourceChangedError(AnnDataFormatError):
    """A file changed on disk after the `AnnDataSource` was built."""


class GeneMismatchError(ValueError):
    """Files of one source do not share the same genes in the same order."""


class MissingColumnError(KeyError):
    """A requested obs column (or gene, or layer) does not exist."""

    def __str__(self) -> str:
        # KeyError quotes its message; this one is a sentence.
        return str(self.args[0]) if self.args else ""


class CheckpointMismatchError(ValueError):
    """An iterator state does not fit the loader restoring it (another
    pipeline: data, sampler, operations), or one of its fields is out of range.
    """  # noqa: D205


class ObjectStoreError(_Fields, OSError):
    """A range read from an object store failed and its retries ran out.

    Attributes:
        url: The object.
        byte_range: `(start, stop)`: the bytes the read asked for.
        status: The last HTTP status (None when no answer came: a dropped
            connection, a timeout).
        cause: One line: status and S3 error code, or the transport error.
        attempts: Requests made for the read (None when the store did not
            say).
    """

    _fields = ("url", "byte_range", "status", "cause", "attempts")


class SharedMemoryFullError(_Fields, OSError):
    """Shared memory (`/dev/shm`) has no room for a worker's minibatch slot.

    Raised in the worker, re-raised in the trainer (instead of a SIGBUS).

    Attributes:
        requested: Bytes the worker asked for.
        size: Bytes of the shared-memory file system (`/dev/shm`).
        free: Bytes free in it when the reservation failed.
    """

    _fields = ("requested", "size", "free")
    _errno = errno.ENOSPC


class MainGuardError(RuntimeError):
    """Worker processes were started from a script's unguarded top level."""

    def add_note(self, note: str) -> None:
        """Adds `note`, except Grain's "cannot be pickled" (this error says why)."""
        if not note.endswith("cannot be pickled!"):
            super().add_note(note)


class NotAMinibatchError(TypeError):
    """A block record of an `AnnDataSource` was used as a minibatch: a plain
    `grain.DataLoader` without `grain_cells.fetch_operations(...)` yields
    `Block` descriptors; raised when one is indexed by a key such as `"X"`.
    """  # noqa: D205


class TruncationError(ValueError):
    """A cell has more stored values than a fixed-width output holds.

    Raised by `PaddedSparseOutput(truncate="error")`; the message names the
    cell (global row id), its count of stored values and the width.
    """


class TruncationWarning(UserWarning):
    """Cells were truncated to a fixed-width output (shown once per process)."""


class WorkerCountWarning(UserWarning):
    """More worker processes were asked for than this process has cores (once
    per loader; the message names both).
    """  # noqa: D205


class WorkerDiedError(RuntimeError):
    """A worker process of a data iterator died (killed, or out of memory).

    The message names the worker (pid) and how it ended; restore the last
    saved state into a new iterator.
    """


class IteratorClosedError(RuntimeError):
    """A data iterator was used after `close()` (or the end of its `with`)."""
